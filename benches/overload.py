"""Overload: goodput of the MLP under ten times the load it sustains, each request with a 1 s deadline.

First the sustainable rate: closed loop, `SATURATE` requests in flight, no deadline, one row per
request; answers per second. Then open loop: requests sent at `FACTOR` times that rate for
`SECONDS`, each with a 1 s gRPC timeout (the client gives up, and the server knows the
deadline). Reported: goodput (answers within the deadline per second) over the sustainable
rate, what the generator managed to offer, how fast refusals came back (p50, p99), and the
server's CPU time per request sent to it (written to its connections: under overload many are
never read, and are cancelled in its socket buffers). The server runs in its own process on
core 0, the generator (`benches.openloop`: raw HTTP/2, a few microseconds per request, so that
it offers what it is asked to) in another on core 1.

Then the same through the node (`hloserve node --cpu-workers 2`, Envoy in front, the MLP placed
on one worker), twice: as configured by default (`before`: Envoy passes every request on, the
worker queues what it cannot serve in time) and with `node.max_requests_per_worker` =
`NODE_MAX_REQUESTS` (`after`: Envoy's circuit breaker refuses UNAVAILABLE what would pass it,
before any worker parses it). Each node run measures its own sustainable rate first; the
generator is pointed at Envoy's public port. Target: goodput >= 80% at 10x.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benches import node
from benches.openloop import UNSENT
from benches.serving import ROOT, _cpu_seconds, _free_port, _pin, start_server

SATURATE = 64
"""Requests in flight while measuring the sustainable rate."""
FACTOR = float(os.environ.get("BENCH_OVERLOAD_FACTOR", "10"))
"""The overload, as a multiple of the sustainable rate (the environment variable: a smaller one,
to see where this machine's generator and node stop keeping up)."""
SECONDS = 10.0
DEADLINE_S = 1.0
CONNECTIONS = 64
NODE_MAX_REQUESTS = 32
"""`node.max_requests_per_worker` of the `after` node run: a few batches in flight per worker."""
"""Clients, each on its own HTTP/2 connection (the server allows 100 streams on each)."""


@dataclass(frozen=True)
class Row:
    phase: str
    offered_per_s: float
    answered_per_s: float
    goodput_fraction: float
    """Answers per second over the sustainable rate."""
    outcomes: dict[str, int]
    """Requests by final status."""
    answer_p50_ms: float
    answer_p99_ms: float
    refusal_p50_ms: float
    refusal_p99_ms: float
    """Latency of UNAVAILABLE answers (nan when there were none)."""
    server_cpu_ms_per_request: float
    """The server's CPU time over the requests written to its connections (not those that
    expired waiting for a stream)."""
    messages: dict[str, list[str]]
    """The first few error messages of each kind."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


def _mlp_request() -> bytes:
    """One row of ones for the MLP, serialized."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    return bytes(request.SerializeToString())


def _load(url: str, **settings: Any) -> dict[str, Any]:
    """`openloop.generate` in its own process on core 1 (this one's GIL and core stay out of it)."""
    code = (
        "import json, sys; from benches.openloop import generate; from benches.overload import _mlp_request; "
        "url, settings = json.loads(sys.argv[1]); "
        "print(json.dumps(generate(url, _mlp_request(), **settings)))"
    )
    arguments = json.dumps([url, {"connections": CONNECTIONS, **settings}])
    command = [*_pin(1), sys.executable, "-c", code, arguments]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=settings["seconds"] + 120, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"load generator failed: {result.stderr[-2000:]}")
    return dict(json.loads(result.stdout.splitlines()[-1]))


def _row(phase: str, load: dict[str, Any], sustainable: float, cpu_s: float) -> Row:
    elapsed = load["elapsed"]
    outcomes, latencies = load["outcomes"], load["latencies"]
    answered = outcomes.get("OK", 0) / elapsed
    return Row(
        phase,
        round(load["sent"] / elapsed, 1),
        round(answered, 1),
        round(answered / sustainable, 3) if sustainable else 1.0,
        dict(sorted(outcomes.items())),
        _percentile(latencies.get("OK", []), 0.5),
        _percentile(latencies.get("OK", []), 0.99),
        _percentile(latencies.get("UNAVAILABLE", []), 0.5),
        _percentile(latencies.get("UNAVAILABLE", []), 0.99),
        round(cpu_s / max(1, load["sent"] - outcomes.get(UNSENT, 0)) * 1e3, 3),
        load.get("messages", {}),
    )


def _phases(url: str, pid: int, label: str, sustainable: float | None = None) -> list[Row]:
    """Warm-up, the sustainable rate (closed loop; unless given, measured with the same
    configuration before), then `FACTOR` times it with deadlines."""
    _load(url, seconds=2.0, concurrency=SATURATE)  # warm up
    rows = []
    cpu = _cpu_seconds(pid)
    if sustainable is None:
        closed = _load(url, seconds=5.0, concurrency=SATURATE)
        closed_cpu, cpu = _cpu_seconds(pid) - cpu, _cpu_seconds(pid)
        sustainable = closed["outcomes"].get("OK", 0) / closed["elapsed"]
        rows.append(_row(f"{label}closed loop, {SATURATE} in flight", closed, sustainable, closed_cpu))
    overload = _load(url, seconds=SECONDS, rate=FACTOR * sustainable, deadline_s=DEADLINE_S)
    overload_cpu = _cpu_seconds(pid) - cpu
    rows.append(
        _row(f"{label}open loop, {FACTOR:g}x, {DEADLINE_S:g} s deadline", overload, sustainable, overload_cpu)
    )
    return rows


def _single() -> list[Row]:
    port = _free_port()
    server = start_server(port)
    try:
        return _phases(f"127.0.0.1:{port}", server.pid, "")
    finally:
        server.terminate()
        server.wait(30)


def _through_node(label: str, max_requests_per_worker: int, sustainable: float | None = None) -> list[Row]:
    with tempfile.TemporaryDirectory() as directory:
        repository = Path(directory)
        shutil.copytree(ROOT / "examples" / "repository" / "mlp", repository / "mlp")
        settings = {"HLOSERVE_NODE_MAX_REQUESTS_PER_WORKER": str(max_requests_per_worker)}
        process, port = node._start_node(settings, repository)
        try:
            return _phases(f"127.0.0.1:{port}", process.pid, f"node {label}: ", sustainable)
        finally:
            node._stop(process)


def run(window_ms: int = 3000) -> list[Row]:
    """The single process, then the node before and after, offered the same rate (10 times what
    the node sustained before)."""
    single = _single()
    before = _through_node("before", 0)
    sustainable = before[0].answered_per_s
    return [*single, *before, *_through_node("after", NODE_MAX_REQUESTS, sustainable)]


def table(rows: list[Row]) -> str:
    header = (
        "phase",
        "offered/s",
        "answers/s",
        "goodput",
        "ok p50/p99 ms",
        "refusal p50/p99 ms",
        "CPU ms/req",
    )
    lines = ["{:<52} {:>10} {:>10} {:>8} {:>14} {:>19} {:>11}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.phase:<52} {r.offered_per_s:10.1f} {r.answered_per_s:10.1f} {r.goodput_fraction:8.0%} "
            f"{f'{r.answer_p50_ms:.1f}/{r.answer_p99_ms:.1f}':>14} "
            f"{f'{r.refusal_p50_ms:.1f}/{r.refusal_p99_ms:.1f}':>19} {r.server_cpu_ms_per_request:11.3f}"
        )
        lines.append(f"{'':<52} outcomes {json.dumps(r.outcomes)}")
    by_phase = {r.phase: r for r in rows}
    cases = [p.split(": ", 1)[1] for p in by_phase if p.startswith("node before: ")]
    if cases:
        lines += ["", "through the node: goodput (answers within the deadline / sustainable rate)"]
        lines.append(f"{'case':<40} {'before':>8} {'after':>8}")
        for case in cases:
            before, after = by_phase[f"node before: {case}"], by_phase.get(f"node after: {case}")
            lines.append(
                f"{case:<40} {before.goodput_fraction:8.0%} "
                f"{after.goodput_fraction if after else float('nan'):8.0%}"
            )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
