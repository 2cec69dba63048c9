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

Then the same through the node (`hloserve node --cpu-workers 2` on core 0 with every child,
Envoy in front, the MLP placed on one worker), as configured by default (`before`: Envoy passes
every request on, the worker queues what it cannot serve in time), then with each of `AFTER`
(Envoy refuses UNAVAILABLE what would pass its bounds, before any worker parses it), all offered
the same rate: `FACTOR` times what the node sustained before. Last, that rate sent to Envoy alone
on core 0 refusing every request from its route: the generator's share of its core and Envoy's
CPU per refusal there are what the offered load costs before any server work, and bound what
any server behind Envoy could reach on the same cores. Target: goodput >= 80% at 10x.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
"""Clients, each on its own HTTP/2 connection (the server allows 100 streams on each)."""
AFTER = {"after": {"HLOSERVE_NODE_MAX_REQUESTS_PER_WORKER": "32"}}
"""The node runs after shedding, by label: a few batches in flight per worker (circuit breakers
and admission control)."""


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
    generator_core: float
    """The generator's CPU time over the elapsed time: the share of its core the offered load
    itself took."""
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
    """`openloop.generate` in its own process on core 1 (this one's GIL and core stay out of it),
    with the CPU time it took (`cpu_s`)."""
    code = (
        "import json, sys, time; from benches.openloop import generate; "
        "from benches.overload import _mlp_request; "
        "url, settings = json.loads(sys.argv[1]); cpu = time.process_time(); "
        "load = generate(url, _mlp_request(), **settings); load['cpu_s'] = time.process_time() - cpu; "
        "print(json.dumps(load))"
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
        round(load["cpu_s"] / elapsed, 3),
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


def _through_node(label: str, settings: dict[str, str], sustainable: float | None = None) -> list[Row]:
    """The node on core 0 (Envoy, controller and workers), `settings` its HLOSERVE_* variables."""
    with tempfile.TemporaryDirectory() as directory:
        repository = Path(directory)
        shutil.copytree(ROOT / "examples" / "repository" / "mlp", repository / "mlp")
        process, port = node._start_node(settings, repository, core=0)
        try:
            return _phases(f"127.0.0.1:{port}", process.pid, f"node {label}: ", sustainable)
        finally:
            node._stop(process)


def _sink_config(port: int, admin: int) -> dict[str, Any]:
    """Envoy answering every gRPC request UNAVAILABLE from its route, reading nothing else."""
    refusal = {"content-type": "application/grpc", "grpc-status": "14", "grpc-message": "shed"}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "sink",
        "codec_type": "HTTP2",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "sink",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200},
                            "response_headers_to_add": [
                                {"header": {"key": k, "value": v}} for k, v in refusal.items()
                            ],
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }

    def address(port: int) -> dict[str, Any]:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    listener = {
        "name": "sink",
        "address": address(port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    return {"admin": {"address": address(admin)}, "static_resources": {"listeners": [listener]}}


def _sink(rate: float, sustainable: float) -> list[Row]:
    """What the offered load itself costs: `rate` sent to Envoy on core 0 refusing each request at
    once (the cheapest refusal there is in front of a worker). The generator's share of its core
    and Envoy's CPU per request bound the goodput of any server on these cores."""
    from hloserve.fleet.envoy import find_envoy

    port, admin = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "sink.json"
        config.write_text(json.dumps(_sink_config(port, admin)))
        command = [*_pin(0), find_envoy(), "-c", str(config), "--disable-hot-restart", "--log-level", "error"]
        envoy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"127.0.0.1:{port}"
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            cpu = _cpu_seconds(envoy.pid)
            load = _load(url, seconds=SECONDS, rate=rate, deadline_s=DEADLINE_S)
            phase = f"Envoy refusing at once, {FACTOR:g}x the node's rate"
            return [_row(phase, load, sustainable, _cpu_seconds(envoy.pid) - cpu)]
        finally:
            envoy.terminate()
            envoy.wait(30)


def run(window_ms: int = 3000) -> list[Row]:
    """The single process, then the node before and after, offered the same rate (`FACTOR` times
    what the node sustained before), then that rate refused by Envoy alone."""
    single = _single()
    before = _through_node("before", {})
    sustainable = before[0].answered_per_s
    after = [row for label, settings in AFTER.items() for row in _through_node(label, settings, sustainable)]
    return [*single, *before, *after, *_sink(FACTOR * sustainable, sustainable)]


def table(rows: list[Row]) -> str:
    header = (
        "phase",
        "offered/s",
        "answers/s",
        "goodput",
        "ok p50/p99 ms",
        "refusal p50/p99 ms",
        "CPU ms/req",
        "gen core",
    )
    lines = ["{:<52} {:>10} {:>10} {:>8} {:>14} {:>19} {:>11} {:>8}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.phase:<52} {r.offered_per_s:10.1f} {r.answered_per_s:10.1f} {r.goodput_fraction:8.0%} "
            f"{f'{r.answer_p50_ms:.1f}/{r.answer_p99_ms:.1f}':>14} "
            f"{f'{r.refusal_p50_ms:.1f}/{r.refusal_p99_ms:.1f}':>19} {r.server_cpu_ms_per_request:11.3f} "
            f"{r.generator_core:8.0%}"
        )
        lines.append(f"{'':<52} outcomes {json.dumps(r.outcomes)}")
    by_phase = {r.phase: r for r in rows}
    cases = [p.split(": ", 1)[1] for p in by_phase if p.startswith("node before: ")]
    if cases:
        labels = ["before", *AFTER]
        lines += ["", "through the node: goodput (answers within the deadline / sustainable rate)"]
        lines.append(f"{'case':<40}" + "".join(f" {label:>22}" for label in labels))
        for case in cases:
            found = [by_phase.get(f"node {label}: {case}") for label in labels]
            lines.append(
                f"{case:<40}" + "".join(f" {r.goodput_fraction if r else float('nan'):22.0%}" for r in found)
            )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
