"""Serving overhead: perf_analyzer against `hloserve serve` on the example repository.

Scenarios: the tiny MLP at concurrency 1 and 4, and a 4.8 MB request (8 images of 224x224x3
FP32 to the `pool` model) at concurrency 1, over gRPC; the MLP at concurrency 16 and the 4.8 MB
request over REST (binary tensors) and, beside them, over gRPC. Each prints perf_analyzer's p50, p99 and
throughput, and the server's CPU time per request: the worker process's user+system time over
the run (from /proc) divided by the requests it counted (ModelStatistics). The server runs in
its own process, pinned to core 0 when the machine has two, perf_analyzer to the other.
"""

from __future__ import annotations

import csv
import io
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
from perf_analyzer import install, run_perf_analyzer  # noqa: E402

SCENARIOS = (
    ("mlp c=1", "mlp", 1, ["-b", "1"], "grpc"),
    ("mlp c=4", "mlp", 4, ["-b", "1"], "grpc"),
    ("4.8 MB c=1", "pool", 1, ["-b", "8"], "grpc"),
    ("mlp c=16", "mlp", 16, ["-b", "1"], "grpc"),
    ("mlp c=16 REST", "mlp", 16, ["-b", "1"], "http"),
    ("4.8 MB c=1 REST", "pool", 1, ["-b", "8"], "http"),
)
"""(name, model, concurrency, perf_analyzer flags, protocol)."""


@dataclass(frozen=True)
class Row:
    scenario: str
    p50_ms: float
    p99_ms: float
    throughput: float
    server_cpu_ms_per_request: float
    requests: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process and all its descendants (Triton runs backend stubs)."""
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = int(fields[11]) + int(fields[12])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class MachineCpu:
    """CPU per request of the client and a server's process tree, and the cores they kept busy."""

    cpu_ms_per_request: float
    busy_cores: float


def machine_cpu(pid: int, run: Any, requests: Any) -> tuple[Any, MachineCpu]:
    """`run()`'s result, and the CPU that the process tree of `pid`, this process and its waited
    children (perf_analyzer) spent per request (`requests(result)`) while it ran."""

    def client() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    started, before = time.monotonic(), _cpu_seconds(pid) + client()
    result = run()
    cpu, wall = _cpu_seconds(pid) + client() - before, time.monotonic() - started
    return result, MachineCpu(cpu / max(requests(result), 1) * 1e3, cpu / wall)


def _pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if (os.cpu_count() or 1) >= 2 and _has("taskset") else []


def _has(program: str) -> bool:
    return any((Path(p) / program).exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def _successes(url: str, model: str) -> int:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        return int(client.get_inference_statistics(model).model_stats[0].inference_stats.success.count)
    finally:
        client.close()


def start_server(
    port: int,
    allow_client_shm: bool = False,
    settings: dict[str, str] | None = None,
    module: tuple[str, ...] | None = None,
    http_port: int = -1,
) -> subprocess.Popen[bytes]:
    """`hloserve serve` on `port` (REST on `http_port`, -1: none), pinned to core 0; `settings`
    are HLOSERVE_* variables; `module` runs `python -m MODULE ARGS... serve` instead of
    `hloserve.cli` (a patched server)."""
    env = {
        **os.environ,
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_SERVER_ALLOW_CLIENT_SHM": str(allow_client_shm),
        **(settings or {}),
    }
    command = [
        *_pin(0),
        sys.executable,
        "-m",
        *(module or ("hloserve.cli",)),
        "serve",
        "--grpc-port",
        str(port),
        "--http-port",
        str(http_port),
        "--metrics-port",
        "-1",
    ]
    # The server's stderr, to say why if it dies starting (its logs are a few lines at start).
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if client.is_server_ready():
                    client.close()
                    return process
            except Exception:
                time.sleep(0.2)
            if process.poll() is not None:
                client.close()
                errors.seek(0)
                last = errors.read().decode(errors="replace").strip().splitlines()[-20:]
                raise RuntimeError("hloserve exited during start-up:\n" + "\n".join(last))
        client.close()
        process.kill()
        raise RuntimeError("hloserve did not become ready in 120 s")


def measure(
    url: str,
    pid: int,
    name: str,
    model: str,
    concurrency: int,
    extra: list[str],
    window_ms: int,
    protocol: str = "grpc",
    grpc_url: str | None = None,
    client_env: dict[str, str] | None = None,
) -> Row:
    """perf_analyzer at `url` over `protocol` (grpc or http), with `client_env` added to its
    environment; the request count comes from the server's statistics over gRPC (`grpc_url`,
    default `url`)."""
    stats_url = grpc_url or url
    before_cpu, before_n = _cpu_seconds(pid), _successes(stats_url, model)
    with_csv = ROOT / "benches" / "results" / "tmp"
    with_csv.mkdir(parents=True, exist_ok=True)
    out = with_csv / "perf.csv"
    args = [
        "-m", model, "-u", url, "-i", protocol, "--concurrency-range", f"{concurrency}:{concurrency}",
        "--measurement-interval", str(window_ms), "-s", "100", "--max-trials", "3", "-f", str(out), *extra,
    ]  # fmt: skip
    command_prefix = _pin(1)
    if command_prefix:
        os.sched_setaffinity(0, {1})
    try:
        result = run_perf_analyzer(args, timeout=300, env=client_env)
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if result.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed on {name}: {result.stdout[-2000:]} {result.stderr[-2000:]}")
    cpu, n = _cpu_seconds(pid) - before_cpu, _successes(stats_url, model) - before_n
    row = next(csv.DictReader(io.StringIO(out.read_text())))
    return Row(
        name,
        float(row["p50 latency"]) / 1e3,
        float(row["p99 latency"]) / 1e3,
        float(row["Inferences/Second"]),
        cpu / max(n, 1) * 1e3,
        n,
    )


def run(window_ms: int = 3000) -> list[Row]:
    install()
    port, http_port = _free_port(), _free_port()
    server = start_server(port, http_port=http_port)
    try:
        url, http_url = f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"
        return [
            measure(
                http_url if protocol == "http" else url,
                server.pid,
                name,
                model,
                concurrency,
                extra,
                window_ms,
                protocol,
                url,
            )
            for name, model, concurrency, extra, protocol in SCENARIOS
        ]
    finally:
        server.terminate()
        server.wait(30)


def table(rows: list[Row]) -> str:
    header = ("scenario", "p50 ms", "p99 ms", "infer/s", "server CPU ms/req", "requests")
    lines = ["{:<16} {:>8} {:>8} {:>9} {:>18} {:>9}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.scenario:<16} {r.p50_ms:8.2f} {r.p99_ms:8.2f} {r.throughput:9.1f} "
            f"{r.server_cpu_ms_per_request:18.3f} {r.requests:9d}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
