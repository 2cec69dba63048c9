"""The node: what Envoy in front costs, and what a second worker buys (`python -m benches node`).

Overhead: one `hloserve node --cpu-workers 2` (lpt_packing, one replica per model, so each
model lives on one worker) measured by perf_analyzer through the public port and, in the same
run, directly against the worker the model is placed on: the tiny MLP at concurrency 1 and 16,
and the 4.8 MB `pool` request (8 images) at concurrency 1 inline and through system shared
memory. "proxy CPU" is Envoy's user+system time per request through the node.

Machine CPU: every figure also counts the CPU of everything that ran (the client and every
process of the node: Envoy, the workers, the controller) per request, and the cores it kept
busy. When the node run keeps all the machine's cores busy, the throughput it can reach is
bounded by that CPU, not by the node's design: "ceiling" is the most the node run could
serve on this machine (its cores over its CPU per request) against the direct run's measured
throughput, the best ratio this machine allows, against which the measured ratio and the
target are read.

Catalogue: ten models of 8 MB of weights, four Python clients picking models by a Zipf law (as
the weight-cache suite); one worker with a budget of a fifth of the catalogue against the node's
two workers, each with that budget, after the controller has learned the load and repacked.

Targets: Envoy adds at most 0.3 ms p50 and costs at most 15% throughput at concurrency 16; two
workers serve the overflowing catalogue at least 1.5x one worker's throughput.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benches.loadgen import python_loop
from benches.serving import ROOT, _free_port, _pin, install, machine_cpu, measure, start_server
from benches.weight_cache import MODELS, WEIGHT_FLOATS, _catalogue, _residency_counts

SCENARIOS = (
    ("mlp c=1", "mlp", 1, ["-b", "1"]),
    ("mlp c=16", "mlp", 16, ["-b", "1"]),
    ("4.8 MB inline", "pool", 1, ["-b", "8"]),
    ("4.8 MB shm", "pool", 1, ["-b", "8", "--shared-memory", "system", "--output-shared-memory-size", "96"]),
)
CATALOGUE_SECONDS = 10.0
ZIPF = 1.0 / np.arange(1, MODELS + 1) ** 1.1


@dataclass(frozen=True)
class Row:
    scenario: str
    direct_p50_ms: float
    node_p50_ms: float
    direct_throughput: float
    node_throughput: float
    proxy_cpu_ms_per_request: float | None
    direct_loads: int | None = None  # the catalogue: weight loads during the measured run
    node_loads: int | None = None
    direct_cpu_ms: float = 0.0
    """CPU of the client and every server process per request, direct (the catalogue: one worker)."""
    node_cpu_ms: float = 0.0
    node_busy_cores: float = 0.0
    """Cores kept busy during the node run, the client included."""
    rows_per_request: int = 1
    """Throughput counts rows (images); CPU is per request."""

    @property
    def added_p50_ms(self) -> float:
        return self.node_p50_ms - self.direct_p50_ms

    @property
    def throughput_ratio(self) -> float:
        return self.node_throughput / self.direct_throughput if self.direct_throughput else 0.0

    @property
    def ceiling_ratio(self) -> float:
        """The node run's most on this machine (every core busy at its CPU per request) over
        the direct run's measured throughput."""
        if not self.node_cpu_ms or not self.direct_throughput:
            return 0.0
        most = (os.cpu_count() or 1) * 1e3 / self.node_cpu_ms * self.rows_per_request
        return most / self.direct_throughput


def _requests(result: Any) -> int:
    return int(result.requests)


def _start_node(
    settings: dict[str, str], repository: Path | None = None, core: int | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """`hloserve node` with two CPU workers (on `core` with its children, Envoy included, when
    given), ready once its controller has placed the models."""
    port = _free_port()
    env = {
        **os.environ,
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.5",
        **settings,
    }
    pinned = _pin(core) if core is not None else []
    command = [*pinned, sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "2",
               "--scheduling", "lpt_packing", "--grpc-port", str(port), "--metrics-port", "-1",
               "--http-port", "-1", "--allow-client-shm"]  # fmt: skip
    if repository is not None:
        command += ["--model-repository", str(repository)]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if client.is_server_ready() and _status(port).repack.count:
                return process, port
        except Exception:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("the node did not become ready in 180 s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(60)


def _gateway(port: int, method: str, request: Any) -> Any:
    from grpclib.client import Channel

    from hloserve._proto import hloserve_gateway as gateway

    async def call() -> Any:
        channel = Channel("127.0.0.1", port)
        try:
            return await getattr(gateway.GatewayControlServiceStub(channel), method)(request, timeout=150)
        finally:
            channel.close()

    return asyncio.run(call())


def _status(port: int) -> Any:
    from hloserve._proto import hloserve_gateway as gateway

    return _gateway(port, "get_scheduling_status", gateway.GetSchedulingStatusRequest())


def _children(pid: int) -> dict[str, int]:
    """The node's children by what they run: envoy, or the worker's gRPC address."""
    found = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            if "serve" in argv:
                found[f"127.0.0.1:{argv[argv.index('--grpc-port') + 1]}"] = int(child)
            elif "-c" in argv:
                found["envoy"] = int(child)
    return found


def run_overhead(window_ms: int) -> list[Row]:
    process, port = _start_node({})
    try:
        placed = {m.name: m.replicas[0].worker for m in _status(port).models}
        addresses = {w.name: w.address for w in _status(port).workers}
        children = _children(process.pid)
        rows = []
        for name, model, concurrency, extra in SCENARIOS:
            direct_url = addresses[placed[model]]
            scenario = (name, model, concurrency, extra, window_ms)
            direct, direct_cpu = machine_cpu(
                process.pid, partial(measure, direct_url, children[direct_url], *scenario), _requests
            )
            node_url = f"127.0.0.1:{port}"
            node, node_cpu = machine_cpu(
                process.pid, partial(measure, node_url, children["envoy"], *scenario), _requests
            )
            rows.append(
                Row(
                    name,
                    round(direct.p50_ms, 3),
                    round(node.p50_ms, 3),
                    direct.throughput,
                    node.throughput,
                    round(node.server_cpu_ms_per_request, 3),
                    direct_cpu_ms=round(direct_cpu.cpu_ms_per_request, 3),
                    node_cpu_ms=round(node_cpu.cpu_ms_per_request, 3),
                    node_busy_cores=round(node_cpu.busy_cores, 2),
                    rows_per_request=int(extra[extra.index("-b") + 1]),
                )
            )
        return rows
    finally:
        _stop(process)


def _loads(ports: list[int]) -> int:
    return sum(_residency_counts(port)[0] for port in ports)


def _zipf_load(url: str) -> Any:
    def pick(rng: np.random.Generator) -> str:
        return f"m{rng.choice(MODELS, p=ZIPF / ZIPF.sum())}"

    result = python_loop(url, pick, "INPUT0", np.ones((1, 16), np.float32), 4, CATALOGUE_SECONDS)
    if result.errors:
        raise RuntimeError(f"catalogue load failed: {result.first_error}")
    return result


def run_catalogue() -> Row:
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "catalogue"
        _catalogue(repository)
        budget = str(MODELS * WEIGHT_FLOATS * 4 // 5)  # a fifth of the catalogue's weights
        settings = {
            "HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository),
            "HLOSERVE_WEIGHTS_BUDGET_BYTES": budget,
        }
        port = _free_port()
        server = start_server(port, settings=settings)
        try:
            before = _loads([port])
            one, one_cpu = machine_cpu(server.pid, partial(_zipf_load, f"127.0.0.1:{port}"), _requests)
            one_loads = _loads([port]) - before
        finally:
            server.terminate()
            server.wait(60)
        node_settings = {**settings, "HLOSERVE_NODE_EMA_HALFLIFE_COMPUTE_S": "0.5"}
        process, node_port = _start_node(node_settings, repository)
        try:
            url = f"127.0.0.1:{node_port}"
            _zipf_load(url)  # the controller learns the load...
            from hloserve._proto import hloserve_gateway as gateway

            _gateway(node_port, "repack", gateway.RepackRequest(wait_seconds=60))  # ...and places it
            workers = [int(w.address.rpartition(":")[2]) for w in _status(node_port).workers]
            before = _loads(workers)
            two, two_cpu = machine_cpu(process.pid, partial(_zipf_load, url), _requests)
            two_loads = _loads(workers) - before
        finally:
            _stop(process)
    return Row(
        "catalogue", 0.0, 0.0, one.throughput, two.throughput, None, one_loads, two_loads,
        direct_cpu_ms=round(one_cpu.cpu_ms_per_request, 3),
        node_cpu_ms=round(two_cpu.cpu_ms_per_request, 3),
        node_busy_cores=round(two_cpu.busy_cores, 2),
    )  # fmt: skip


def run(window_ms: int = 3000) -> list[Row]:
    install()
    return [*run_overhead(window_ms), run_catalogue()]


def table(rows: list[Row]) -> str:
    header = ("scenario", "direct p50", "node p50", "added", "direct /s", "node /s", "ratio", "proxy CPU ms",
              "CPU ms direct", "node", "busy", "ceiling")  # fmt: skip
    lines = ["{:<14} {:>10} {:>9} {:>7} {:>10} {:>9} {:>6} {:>12} {:>13} {:>6} {:>5} {:>7}".format(*header)]
    for r in rows:
        cpu = "" if r.proxy_cpu_ms_per_request is None else f"{r.proxy_cpu_ms_per_request:.3f}"
        machine = (
            f"{r.direct_cpu_ms:13.3f} {r.node_cpu_ms:6.3f} {r.node_busy_cores:5.2f} {r.ceiling_ratio:6.2f}x"
        )
        if r.scenario == "catalogue":
            lines.append(
                f"{'catalogue':<14} {'1 worker':>10} {'2 workers':>9} {'':>7} {r.direct_throughput:10.1f} "
                f"{r.node_throughput:9.1f} {r.throughput_ratio:5.2f}x {'':>12} {machine}   weight loads "
                f"{r.direct_loads} -> {r.node_loads}"
            )
            continue
        lines.append(
            f"{r.scenario:<14} {r.direct_p50_ms:10.3f} {r.node_p50_ms:9.3f} {r.added_p50_ms:7.3f} "
            f"{r.direct_throughput:10.1f} {r.node_throughput:9.1f} {r.throughput_ratio:5.2f}x {cpu:>12} "
            f"{machine}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [
        {
            **asdict(r),
            "added_p50_ms": r.added_p50_ms,
            "throughput_ratio": r.throughput_ratio,
            "ceiling_ratio": r.ceiling_ratio,
        }
        for r in rows
    ]
