"""Side by side: hloserve against Triton, MLServer and KServe, same models, same clients, one run.

Every server runs on loopback at once (pinned to core 0; the clients get core 1) and serves the
same models; hloserve twice, as one process (`hloserve`) and as an engine with two frontend
processes (`hloserve K=2`, all three on core 0 like every server: what the split costs when no
core is added; `python -m benches frontends` measures what it gains when one is). The models:
the example MLP, the `pool` model (a 4.8 MB request of 8 images) and a catalogue of ten 8 MB
models (`benches/peers/models.py`; hloserve serves the same maths as bundles).
Each scenario is measured with perf_analyzer where the server speaks Triton's extensions
(hloserve, Triton) and with a Python tritonclient loop everywhere, one server after another,
after waiting for the machine to be quiet (`benches/machine.py`); the busy cores seen just
before, and the load average, are kept beside each figure. Each client, perf_analyzer's contexts
and the loop's threads alike, has its own connection, as independent clients do (and as the
frontends need: the kernel gives each connection to one of them). A peer that cannot be
installed or started, and a scenario a server cannot run, are listed with the reason, never
dropped.

Scenarios: the MLP at concurrency 1, 4 and 16; 4.8 MB inline and through system shared
memory; over REST (perf_analyzer `-i http`, binary tensors; hloserve and Triton, which serve
it) the MLP at concurrency 1 and 16 and 4.8 MB; the catalogue under Zipf traffic (hloserve with
a weight budget of one model, a tenth of the catalogue, the peers with everything loaded); and
the cold request to an evicted model (hloserve only: the peers keep every model loaded).
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benches.frontends import CLIENT_ENV
from benches.loadgen import python_loop
from benches.machine import quiet_wait
from benches.serving import _cpu_seconds, _free_port, _pin, install, start_server
from benches.weight_cache import MODELS as CATALOGUE_SIZE
from benches.weight_cache import WEIGHT_FLOATS, _catalogue, cold_and_warm

OURS, OURS_K2 = "hloserve", "hloserve K=2"
SERVERS = (OURS, OURS_K2, "triton", "mlserver", "kserve")
PEERS = {
    "triton": "benches.peers.triton",
    "mlserver": "benches.peers.mlserver",
    "kserve": "benches.peers.kserve",
}
WITH_PERF_ANALYZER = {OURS, OURS_K2, "triton"}  # MLServer and KServe lack ModelConfig/statistics
WITH_SHM = {OURS, OURS_K2, "triton"}
ZIPF = 1.0 / np.arange(1, CATALOGUE_SIZE + 1) ** 1.1
ZIPF /= ZIPF.sum()


@dataclass(frozen=True)
class Figure:
    scenario: str
    client: str
    """`perf_analyzer` or `python` (the tritonclient loop)."""
    server: str
    p50_ms: float | None = None
    p99_ms: float | None = None
    throughput: float | None = None
    """Inferences (rows) per second."""
    server_cpu_ms: float | None = None
    """The server's process tree's CPU time per request."""
    errors: int = 0
    note: str = ""
    """Why there is no figure, or what to know about it."""
    busy_cores_before: float | None = None
    loadavg_1m: float | None = None


@dataclass
class _Server:
    name: str
    url: str
    pid: int
    process: Any
    http_url: str | None = None
    """Its V2 REST endpoint, where it serves one."""


def _start_peers(
    models: list[Any], peers: dict[str, str] = PEERS
) -> tuple[dict[str, _Server], dict[str, str]]:
    running, missing = {}, {}
    for name, module_name in peers.items():
        try:
            module = importlib.import_module(module_name)
            module.install()
            process, port = module.start(_pin(0), models)
        except Exception as e:  # an uninstallable or broken peer is reported, not dropped
            missing[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        http_port = getattr(module, "http_port", None)
        http_url = None if http_port is None else f"127.0.0.1:{http_port}"
        running[name] = _Server(name, f"127.0.0.1:{port}", process.pid, process, http_url)
    return running, missing


def _measure_pa(
    server: _Server,
    scenario: str,
    model: str,
    concurrency: int,
    extra: list[str],
    window_ms: int,
    protocol: str = "grpc",
) -> Figure:
    from benches.serving import measure

    quiet = quiet_wait()
    url = server.http_url if protocol == "http" else server.url
    assert url is not None
    try:
        row = measure(
            url, server.pid, scenario, model, concurrency, extra, window_ms, protocol, server.url, CLIENT_ENV
        )
    except Exception as e:
        return Figure(scenario, "perf_analyzer", server.name, note=f"failed: {str(e)[-300:]}")
    return Figure(
        scenario,
        "perf_analyzer",
        server.name,
        row.p50_ms,
        row.p99_ms,
        row.throughput,
        round(row.server_cpu_ms_per_request, 3),
        busy_cores_before=quiet.busy_cores,
        loadavg_1m=round(quiet.loadavg_1m, 2),
    )


def _measure_loop(
    server: _Server,
    scenario: str,
    pick: Callable[[np.random.Generator], str],
    input_name: str,
    array: np.ndarray,
    concurrency: int,
    seconds: float,
) -> Figure:
    quiet = quiet_wait()
    cpu = _cpu_seconds(server.pid)
    result = python_loop(server.url, pick, input_name, array, concurrency, seconds)
    cpu = _cpu_seconds(server.pid) - cpu
    return Figure(
        scenario,
        "python",
        server.name,
        result.p50_ms,
        result.p99_ms,
        result.throughput,
        round(cpu / max(1, result.requests) * 1e3, 3),
        result.errors,
        result.first_error[:300],
        quiet.busy_cores,
        round(quiet.loadavg_1m, 2),
    )


def _cold_load(seconds_between: float = 0.2, repeats: int = 7) -> list[Figure]:
    """hloserve alone: the request to a model just evicted against the same request warm."""
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "catalogue"
        _catalogue(repository)
        port = _free_port()
        budget = str(WEIGHT_FLOATS * 4 + 1024)  # one model's weights
        server = start_server(
            port,
            settings={
                "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
                "HLOSERVE_WEIGHTS_BUDGET_BYTES": budget,
            },
        )
        quiet = quiet_wait()
        try:
            cold, warm = cold_and_warm(f"127.0.0.1:{port}", "m0", "m1", repeats, seconds_between)
        finally:
            server.terminate()
            server.wait(60)
    note = f"warm p50 {statistics.median(warm):.2f} ms; cold = first request after eviction (8 MB)"
    figures = [
        Figure("cold load 8 MB", "python", "hloserve", round(statistics.median(cold), 3), round(max(cold), 3),
               None, note=note, busy_cores_before=quiet.busy_cores, loadavg_1m=round(quiet.loadavg_1m, 2)),
    ]  # fmt: skip
    for peer in PEERS:
        figures.append(Figure("cold load 8 MB", "python", peer, note="n/a: keeps every model loaded"))
    return figures


def run(window_ms: int = 3000) -> list[Figure]:
    from benches.peers.models import MLP, POOL, catalogue

    install()
    seconds = window_ms / 1000 * 2
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory() as tmp:
        peer_models = [MLP, POOL, *catalogue(Path(tmp) / "peer_catalogue", CATALOGUE_SIZE)]
        ours_repo = Path(tmp) / "repository"
        _catalogue(ours_repo)
        for example in ("mlp", "pool"):
            shutil.copytree(  # a link is refused: bundles load only from inside the repository
                Path(__file__).resolve().parents[1] / "examples" / "repository" / example, ours_repo / example
            )
        ours = {name: _start_ours(name, ours_repo, k) for name, k in ((OURS, 0), (OURS_K2, 2))}
        servers = dict(ours)
        peers, missing = _start_peers(peer_models)
        servers.update(peers)
        try:
            figures += _scenarios(servers, missing, window_ms, seconds)
        finally:
            from benches.peers import stop

            for server in ours.values():
                server.process.terminate()
                server.process.wait(60)
            for name in peers:
                stop(servers[name].process)
    figures += _cold_load()
    return figures


def _start_ours(name: str, repository: Path, frontends: int) -> _Server:
    port, http_port = _free_port(), _free_port()
    process = start_server(
        port,
        allow_client_shm=True,
        http_port=http_port,
        settings={
            "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
            "HLOSERVE_SERVER_FRONTENDS": str(frontends),
            # a tenth of the catalogue on the device at once; mlp and pool are tiny
            "HLOSERVE_WEIGHTS_BUDGET_BYTES": str(WEIGHT_FLOATS * 4 + (1 << 20)),
        },
    )
    return _Server(name, f"127.0.0.1:{port}", process.pid, process, f"127.0.0.1:{http_port}")


def _scenarios(
    servers: dict[str, _Server], missing: dict[str, str], window_ms: int, seconds: float
) -> list[Figure]:
    figures = []

    def absent(scenario: str, client: str, server: str) -> Figure | None:
        if server in missing:
            return Figure(scenario, client, server, note=f"not running: {missing[server]}")
        if client == "perf_analyzer" and server not in WITH_PERF_ANALYZER:
            return Figure(scenario, client, server, note="n/a: perf_analyzer needs Triton's ModelConfig")
        return None

    one_row, images = np.ones((1, 16), np.float32), np.ones((8, 224, 224, 3), np.float32)
    for c in (1, 4, 16):
        scenario = f"mlp c={c}"
        for client in ("perf_analyzer", "python"):
            for name in SERVERS:
                skip = absent(scenario, client, name)
                if skip is not None:
                    figures.append(skip)
                elif client == "perf_analyzer":
                    figures.append(_measure_pa(servers[name], scenario, "mlp", c, ["-b", "1"], window_ms))
                else:
                    figures.append(
                        _measure_loop(servers[name], scenario, lambda _: "mlp", "INPUT0", one_row, c, seconds)
                    )
    for client in ("perf_analyzer", "python"):
        for name in SERVERS:
            scenario = "4.8 MB inline c=1"
            skip = absent(scenario, client, name)
            if skip is not None:
                figures.append(skip)
            elif client == "perf_analyzer":
                figures.append(_measure_pa(servers[name], scenario, "pool", 1, ["-b", "8"], window_ms))
            else:
                figures.append(
                    _measure_loop(servers[name], scenario, lambda _: "pool", "IMAGE", images, 1, seconds)
                )
    scenario = "4.8 MB shm c=1"
    shm = ["-b", "8", "--shared-memory", "system", "--output-shared-memory-size", str(8 * 3 * 4)]
    for name in SERVERS:
        skip = absent(scenario, "perf_analyzer", name)
        if skip is not None:
            figures.append(skip)
        elif name not in WITH_SHM:
            figures.append(Figure(scenario, "perf_analyzer", name, note="n/a: no system shared memory"))
        else:
            figures.append(_measure_pa(servers[name], scenario, "pool", 1, shm, window_ms))
    rest = [(f"mlp c={c} REST", "mlp", c, ["-b", "1"]) for c in (1, 16)]
    for scenario, model, c, extra in [*rest, ("4.8 MB binary c=1 REST", "pool", 1, ["-b", "8"])]:
        for name in SERVERS:
            skip = absent(scenario, "perf_analyzer", name)
            if skip is not None:
                figures.append(skip)
            elif servers[name].http_url is None:
                figures.append(Figure(scenario, "perf_analyzer", name, note="n/a: no REST endpoint"))
            else:
                figures.append(_measure_pa(servers[name], scenario, model, c, extra, window_ms, "http"))
    scenario = "catalogue 10x8 MB Zipf c=4"
    for name in SERVERS:
        skip = absent(scenario, "python", name)
        if skip is not None:
            figures.append(skip)
            continue
        figure = _measure_loop(
            servers[name],
            scenario,
            lambda rng: f"m{rng.choice(CATALOGUE_SIZE, p=ZIPF)}",
            "INPUT0",
            one_row,
            4,
            seconds,
        )
        ours = name in (OURS, OURS_K2)
        note = "budget: one model (a tenth of the catalogue)" if ours else "everything loaded"
        figures.append(
            Figure(**{**asdict(figure), "note": (figure.note + "; " if figure.note else "") + note})
        )
    return figures


def ratios(figures: list[Figure]) -> dict[tuple[str, str, str], float]:
    """hloserve's (one process) throughput over each other server's, by (scenario, client, server)."""
    by_key = {(f.scenario, f.client, f.server): f for f in figures}
    out = {}
    for (scenario, client, server), f in by_key.items():
        ours = by_key.get((scenario, client, OURS))
        if server != OURS and ours and ours.throughput and f.throughput:
            out[(scenario, client, server)] = ours.throughput / f.throughput
    return out


def table(figures: list[Figure]) -> str:
    ratio = ratios(figures)
    header = (
        "scenario",
        "client",
        "server",
        "p50 ms",
        "p99 ms",
        "infer/s",
        "CPU ms/req",
        "hloserve x",
        "busy",
    )
    lines = ["{:<27} {:<13} {:<12} {:>8} {:>8} {:>9} {:>10} {:>10} {:>5}".format(*header)]

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for f in figures:
        x = ratio.get((f.scenario, f.client, f.server))
        lines.append(
            f"{f.scenario:<27} {f.client:<13} {f.server:<12} {number(f.p50_ms, '8.2f'):>8} "
            f"{number(f.p99_ms, '8.2f'):>8} {number(f.throughput, '9.1f'):>9} "
            f"{number(f.server_cpu_ms, '10.3f'):>10} "
            f"{number(x, '9.2f') + ('x' if x else ''):>10} {number(f.busy_cores_before, '5.2f'):>5}"
            + (f"  {f.note}" if f.note else "")
        )
    return "\n".join(lines)


def as_json(figures: list[Figure]) -> list[dict[str, Any]]:
    ratio = ratios(figures)
    return [{**asdict(f), "hloserve_ratio": ratio.get((f.scenario, f.client, f.server))} for f in figures]
