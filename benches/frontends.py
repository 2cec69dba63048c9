"""Frontends: what the engine costs per request when frontends feed it (`python -m benches frontends`).

Today this measures the engine alone: an engine process (the worker's actors and models, pinned
to core 0) accepting links on a Unix socket, fed at full speed by a driver in this process that
writes requests into the link directly (`hloserve.link.FrontendLink`: inputs staged in its
shared-memory arena, one frame per request). Per scenario: requests per second, p99 latency, the
engine's CPU per request (from /proc) and the driver's (the link's share of a frontend's cost).
The issue's target is the engine's CPU per tiny request at concurrency 16 at most a fifth of a
frontend's. K=0/1/2 through gRPC come with the frontend process (docs/frontends.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benches.serving import ROOT, _cpu_seconds, _pin

SCENARIOS = (
    ("mlp c=1", "mlp", (1, 16), 1),
    ("mlp c=16", "mlp", (1, 16), 16),
    ("mlp c=64", "mlp", (1, 16), 64),
    ("4.8 MB c=1", "pool", (8, 224, 224, 3), 1),
)
"""(name, model, input shape (float32, batch axis first), requests in flight)."""
OUT_BYTES = 4 << 10


@dataclass(frozen=True)
class Row:
    scenario: str
    throughput: float
    p99_ms: float
    engine_cpu_ms_per_request: float
    driver_cpu_ms_per_request: float
    requests: int


def run(window_ms: int = 3000) -> list[Row]:
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "engine.sock")
        engine = subprocess.Popen(
            [*_pin(0), sys.executable, "-m", "benches.frontends", "--engine", path],
            cwd=ROOT,
            env={**os.environ, "HLOSERVE_LOGGING_LEVEL": "warning"},
            stdout=subprocess.PIPE,
        )
        try:
            assert engine.stdout is not None
            for line in engine.stdout:  # its log lines, then "ready"
                if line.strip() == b"ready":
                    break
            else:
                raise RuntimeError(f"the engine did not start (exit {engine.wait()})")
            return [_scenario(path, engine.pid, *s, window_ms / 1e3) for s in SCENARIOS]
        finally:
            engine.terminate()
            engine.wait(30)


def _scenario(
    path: str, pid: int, name: str, model: str, shape: tuple[int, ...], inflight: int, seconds: float
) -> Row:
    import trio

    from hloserve.buffer_pool import BufferPool
    from hloserve.link import FrontendLink

    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    latencies: list[float] = []

    async def drive() -> tuple[float, float, float]:
        stream = await trio.open_unix_socket(path)
        with BufferPool(max(2 * inflight * (x.nbytes + OUT_BYTES + 256), 1 << 20), 2 * inflight) as arena:
            link = FrontendLink(stream, arena)
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)

                async def client(until: float, record: bool) -> None:
                    while (now := time.perf_counter()) < until:
                        await link.infer(model, [x], shape[0], [0], None, OUT_BYTES)
                        if record:
                            latencies.append(time.perf_counter() - now)

                for record, span in ((False, 0.5), (True, seconds)):  # warm up, then measure
                    engine_before, driver_before = _cpu_seconds(pid), time.process_time()
                    started = time.perf_counter()
                    async with trio.open_nursery() as clients:
                        for _ in range(inflight):
                            clients.start_soon(client, started + span, record)
                    elapsed = time.perf_counter() - started
                    engine_cpu = _cpu_seconds(pid) - engine_before
                    driver_cpu = time.process_time() - driver_before
                nursery.cancel_scope.cancel()
        return elapsed, engine_cpu, driver_cpu

    elapsed, engine_cpu, driver_cpu = trio.run(drive)
    n = max(len(latencies), 1)
    return Row(
        name,
        len(latencies) / elapsed,
        float(np.percentile(latencies, 99)) * 1e3 if latencies else float("nan"),
        engine_cpu / n * 1e3,
        driver_cpu / n * 1e3,
        len(latencies),
    )


def table(rows: list[Row]) -> str:
    lines = [
        f"{'engine alone':<14} {'req/s':>9} {'p99 ms':>8} {'engine CPU ms/req':>18} {'driver CPU ms/req':>18}"
    ]
    for r in rows:
        lines.append(
            f"{r.scenario:<14} {r.throughput:>9.0f} {r.p99_ms:>8.2f} "
            f"{r.engine_cpu_ms_per_request:>18.3f} {r.driver_cpu_ms_per_request:>18.3f}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def _engine(path: str) -> None:
    """An engine with no frontend process: the worker, and links accepted on `path`."""
    import trio

    from hloserve.config import load_config
    from hloserve.link import EngineLink
    from hloserve.worker import serve

    config = load_config().replace("server", grpc_port=0, http_port=-1, metrics_port=-1)

    async def main() -> None:
        async with serve(config) as worker:
            listener = trio.SocketListener(await _unix_listener(path))
            print("ready", flush=True)

            async def link(stream: Any) -> None:
                await EngineLink(stream, worker.models).run()

            await trio.serve_listeners(link, [listener])

    trio.run(main)


async def _unix_listener(path: str) -> Any:
    import trio

    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(16)
    return sock


if __name__ == "__main__":
    assert sys.argv[1:2] == ["--engine"], "usage: python -m benches.frontends --engine SOCKET"
    _engine(sys.argv[2])
