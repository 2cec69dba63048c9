"""Frontends: the worker with K frontend processes, and the engine alone (`python -m benches frontends`).

Through gRPC: `hloserve serve --frontends K` for K = 0, 1, 2 (not pinned: the point is using
both cores) under perf_analyzer, each of its contexts on its own connection (`CLIENT_ENV`); per
scenario, answers per second, p99, and CPU per request of the
engine (the worker process itself) and of one frontend (its children's, over K), from /proc.
With K=0 the engine column is the whole single-process server.

Machine CPU: each row also counts the CPU of everything that ran (perf_analyzer, the engine and
the frontends; for the engine alone, the engine and the driver) per request, and the cores it
kept busy. "ceiling" is what that row could serve with every core of this machine busy at its CPU
per request, over K=0's measured throughput: where it is near the measured ratio, the machine's
cores bound the run, not the design (for the engine alone, which has no client, the ceiling is
only in the JSON, in requests per second).

The engine alone: an engine process (pinned to core 0) accepting links on a Unix socket, fed at
full speed by a driver in this process that writes requests into the link directly
(`hloserve.frontends.frontend_link.FrontendLink`) and counts each call as a frontend does; the frontend
column is then the driver's CPU (the link's share of a frontend's cost). "mlp 5x c=16" drives
five links at once, 16 in flight on each: the engine as five frontends would load it. The
target: the engine's CPU per tiny request at most a fifth of a frontend's, so that one engine
feeds five frontends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benches.serving import ROOT, _cpu_seconds, _pin, machine_cpu

SCENARIOS = (
    ("mlp c=1", "mlp", (1, 16), 1, 1),
    ("mlp c=16", "mlp", (1, 16), 16, 1),
    ("mlp c=64", "mlp", (1, 16), 64, 1),
    ("mlp 5x c=16", "mlp", (1, 16), 16, 5),
    ("4.8 MB c=1", "pool", (8, 224, 224, 3), 1, 1),
    ("4.8 MB c=8", "pool", (8, 224, 224, 3), 8, 1),
)
"""The engine alone: (name, model, input shape (float32, batch axis first), requests in flight
on each link, links). "5x" is five links at once, the load of five frontends."""
OUT_BYTES = 4 << 10


GRPC_SCENARIOS = (
    ("mlp c=1", "mlp", 1, ["-b", "1"]),
    ("mlp c=16", "mlp", 16, ["-b", "1"]),
    ("mlp c=64", "mlp", 64, ["-b", "1"]),
    ("4.8 MB c=1", "pool", 1, ["-b", "8"]),
    ("4.8 MB c=8", "pool", 8, ["-b", "8"]),
)
FRONTENDS = (0, 1, 2)
CLIENT_ENV = {"TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT": "1"}
"""perf_analyzer's contexts each open their own connection, as independent clients do. By default
up to six share one, and the kernel (SO_REUSEPORT) sends a connection's every call to one
frontend, so at 16 in flight three connections would split unevenly between two frontends."""


@dataclass(frozen=True)
class Row:
    setup: str
    """`K=0`, `K=1`, `K=2` (through gRPC) or `engine alone` (the link driven directly)."""
    scenario: str
    throughput: float
    p99_ms: float
    engine_cpu_ms_per_request: float
    frontend_cpu_ms_per_request: float | None
    """One frontend's CPU per request it answered (the driver's, for the engine alone)."""
    requests: int
    machine_cpu_ms_per_request: float = 0.0
    """The CPU of everything that ran (client, engine, frontends) per request."""
    busy_cores: float = 0.0
    """Cores kept busy, the client included."""
    ceiling: float = 0.0
    """The most this row could serve here, every core busy at its machine CPU per request (in
    the throughput's unit)."""


def run(window_ms: int = 3000) -> list[Row]:
    return [*_grpc(window_ms), *_engine_alone(window_ms)]


def _grpc(window_ms: int) -> list[Row]:
    import tritonclient.grpc as grpcclient

    from benches.perf_analyzer import install
    from benches.serving import _free_port

    install()
    rows = []
    for k in FRONTENDS:
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "hloserve.cli", "serve", "--grpc-port", str(port), "--http-port", "-1",
             "--metrics-port", "-1", "--frontends", str(k)],
            cwd=ROOT, env={**os.environ, "HLOSERVE_LOGGING_LEVEL": "warning"}, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                try:
                    with grpcclient.InferenceServerClient(url) as client:
                        if client.is_server_ready():
                            break
                except Exception:
                    time.sleep(0.2)
            for name, model, concurrency, extra in GRPC_SCENARIOS:
                measure = partial(_counted_perf_analyzer, url, model, concurrency, extra, window_ms)
                engine, whole = _own_cpu(process.pid), _cpu_seconds(process.pid)
                (p99_ms, throughput, n), machine = machine_cpu(process.pid, measure, lambda r: r[2])
                engine = _own_cpu(process.pid) - engine
                frontends = _cpu_seconds(process.pid) - whole - engine
                rows.append(
                    Row(
                        f"K={k}",
                        name,
                        throughput,
                        p99_ms,
                        engine / n * 1e3,
                        frontends / n * 1e3 if k else None,
                        n,
                        machine.cpu_ms_per_request,
                        machine.busy_cores,
                        _ceiling(machine.cpu_ms_per_request, int(extra[-1])),
                    )
                )
        finally:
            process.terminate()
            process.wait(60)
    return rows


def _ceiling(cpu_ms_per_request: float, batch: int) -> float:
    """Throughput (inferences per second, `batch` to a request) with every core busy."""
    return (os.cpu_count() or 1) * 1e3 / cpu_ms_per_request * batch if cpu_ms_per_request else 0.0


def _own_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _counted_perf_analyzer(
    url: str, model: str, concurrency: int, extra: list[str], window_ms: int
) -> tuple[float, float, int]:
    """p99 ms, throughput, and the requests the server answered meanwhile."""
    from benches.serving import _successes

    n = _successes(url, model)
    p99_ms, throughput = _perf_analyzer(url, model, concurrency, extra, window_ms)
    return p99_ms, throughput, max(_successes(url, model) - n, 1)


def _perf_analyzer(
    url: str, model: str, concurrency: int, extra: list[str], window_ms: int
) -> tuple[float, float]:
    import csv
    import io

    from benches.perf_analyzer import run_perf_analyzer

    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "perf.csv"
        args = [
            "-m", model, "-u", url, "-i", "grpc", "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(window_ms), "-s", "100", "--max-trials", "8",
            "-f", str(out), *extra,
        ]  # fmt: skip
        result = run_perf_analyzer(args, timeout=300, env=CLIENT_ENV)
        if result.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed: {result.stdout[-2000:]} {result.stderr[-2000:]}")
        row = next(csv.DictReader(io.StringIO(out.read_text())))
    return float(row["p99 latency"]) / 1e3, float(row["Inferences/Second"])


def _engine_alone(window_ms: int) -> list[Row]:
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
    path: str,
    pid: int,
    name: str,
    model: str,
    shape: tuple[int, ...],
    inflight: int,
    links: int,
    seconds: float,
) -> Row:
    import trio

    from hloserve.engine.buffer_pool import BufferPool
    from hloserve.frontends.frontend_link import FrontendLink

    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    latencies: list[float] = []

    async def drive() -> tuple[float, float, float]:
        async with contextlib.AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            opened = []
            for _ in range(links):
                arena = stack.enter_context(
                    BufferPool(max(2 * inflight * (x.nbytes + OUT_BYTES + 256), 1 << 20), 2 * inflight)
                )
                link = FrontendLink(await trio.open_unix_socket(path), arena)
                await nursery.start(link.run)
                opened.append(link)

            async def client(link: FrontendLink, until: float, record: bool) -> None:
                while (now := time.perf_counter()) < until:
                    await link.infer(model, [x], shape[0], [0], None, OUT_BYTES)
                    elapsed = time.perf_counter() - now
                    link.count(model, "OK", elapsed)  # as a frontend counts each call
                    if record:
                        latencies.append(elapsed)

            for record, span in ((False, 0.5), (True, seconds)):  # warm up, then measure
                engine_before, driver_before = _cpu_seconds(pid), time.process_time()
                started = time.perf_counter()
                async with trio.open_nursery() as clients:
                    for link in opened:
                        for _ in range(inflight):
                            clients.start_soon(client, link, started + span, record)
                elapsed = time.perf_counter() - started
                engine_cpu = _cpu_seconds(pid) - engine_before
                driver_cpu = time.process_time() - driver_before
            nursery.cancel_scope.cancel()
        return elapsed, engine_cpu, driver_cpu

    elapsed, engine_cpu, driver_cpu = trio.run(drive)
    n = max(len(latencies), 1)
    machine_ms = (engine_cpu + driver_cpu) / n * 1e3
    return Row(
        "engine alone",
        name,
        len(latencies) / elapsed,
        float(np.percentile(latencies, 99)) * 1e3 if latencies else float("nan"),
        engine_cpu / n * 1e3,
        driver_cpu / n * 1e3,
        len(latencies),
        machine_ms,
        (engine_cpu + driver_cpu) / elapsed,
        _ceiling(machine_ms, 1),
    )


def _against_k0(rows: list[Row]) -> dict[tuple[str, str], float]:
    """Each gRPC row's ceiling over K=0's measured throughput in the same scenario (0 for the
    engine alone, which has no client and counts requests, not images)."""
    k0 = {r.scenario: r.throughput for r in rows if r.setup == "K=0"}

    def ratio(r: Row) -> float:
        return r.ceiling / k0[r.scenario] if r.setup != "engine alone" and k0.get(r.scenario) else 0.0

    return {(r.setup, r.scenario): ratio(r) for r in rows}


def table(rows: list[Row]) -> str:
    ceilings = _against_k0(rows)
    lines = [
        f"{'setup':<13} {'scenario':<11} {'req/s':>8} {'p99 ms':>8} {'engine CPU ms/req':>18} "
        f"{'frontend CPU ms/req':>20} {'machine CPU ms/req':>19} {'cores':>6} {'ceiling/K=0':>12}"
    ]
    for r in rows:
        frontend = "-" if r.frontend_cpu_ms_per_request is None else f"{r.frontend_cpu_ms_per_request:.3f}"
        ceiling = ceilings[r.setup, r.scenario]
        lines.append(
            f"{r.setup:<13} {r.scenario:<11} {r.throughput:>8.0f} {r.p99_ms:>8.2f} "
            f"{r.engine_cpu_ms_per_request:>18.3f} {frontend:>20} {r.machine_cpu_ms_per_request:>19.3f} "
            f"{r.busy_cores:>6.2f} {f'{ceiling:.2f}x' if ceiling else '-':>12}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    ceilings = _against_k0(rows)
    return [{**asdict(r), "ceiling_ratio": ceilings[r.setup, r.scenario]} for r in rows]


def _engine(path: str) -> None:
    """An engine with no frontend process: the worker, and links accepted on `path`."""
    import trio

    from hloserve.config import load_config
    from hloserve.frontends.pool import Frontends
    from hloserve.worker import serve

    config = load_config().replace("server", grpc_port=0, http_port=-1, metrics_port=-1)

    async def main() -> None:
        async with serve(config) as worker:
            assert worker.planes is not None
            frontends = Frontends(worker, worker.planes)  # its links, not its processes
            listener = trio.SocketListener(await _unix_listener(path))
            print("ready", flush=True)

            async def link(stream: Any) -> None:
                await frontends.engine_link(stream).run()

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
