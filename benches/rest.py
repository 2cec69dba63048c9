"""REST beside gRPC, hloserve beside Triton: only compare's HTTP rows and the gRPC rows they are
judged against, in a couple of minutes (`python -m benches rest`).

perf_analyzer drives both servers, one after the other for each scenario, over `-i http` (binary
tensors) and `-i grpc`: the MLP at concurrency 1 and 16 and the 4.8 MB `pool` request at
concurrency 1. The targets (issue 18) are read off the ratios of one run: hloserve's REST at
least 0.8x its own gRPC for the MLP at 16, and at least 1.0x Triton's REST for 4.8 MB.
"""

from __future__ import annotations

from typing import Any

from benches.compare import PEERS, Figure, _measure_pa, _Server, _start_peers, as_json
from benches.compare import table as _table
from benches.serving import _free_port, install, start_server

__all__ = ["as_json", "run", "table"]

SCENARIOS = (
    ("mlp c=1", "mlp", 1, ["-b", "1"]),
    ("mlp c=16", "mlp", 16, ["-b", "1"]),
    ("4.8 MB c=1", "pool", 1, ["-b", "8"]),
)
"""(name, model, concurrency, perf_analyzer flags), each measured over gRPC and REST."""


def run(window_ms: int = 3000) -> list[Figure]:
    from benches.peers import stop
    from benches.peers.models import MLP, POOL

    install()
    figures: list[Figure] = []
    port, http_port = _free_port(), _free_port()
    ours = start_server(port, http_port=http_port)  # the example repository: mlp and pool among it
    servers = {"hloserve": _Server("hloserve", f"127.0.0.1:{port}", ours.pid, ours, f"127.0.0.1:{http_port}")}
    peers: dict[str, Any] = {}
    try:
        peers, missing = _start_peers([MLP, POOL], {"triton": PEERS["triton"]})
        servers.update(peers)
        for scenario, model, c, extra in SCENARIOS:
            for protocol in ("grpc", "http"):
                name = f"{scenario} {'REST' if protocol == 'http' else 'gRPC'}"
                for server in ("hloserve", "triton"):
                    if server in missing:
                        figures.append(Figure(name, "perf_analyzer", server, note=missing[server][:200]))
                    else:
                        figures.append(
                            _measure_pa(servers[server], name, model, c, extra, window_ms, protocol)
                        )
    finally:
        ours.terminate()
        ours.wait(60)
        for peer in peers.values():
            stop(peer.process)
    return figures


def table(figures: list[Figure]) -> str:
    """compare's table, then hloserve's REST over its own gRPC per scenario."""
    by = {(f.scenario, f.server): f.throughput for f in figures}
    lines = [_table(figures), ""]
    for scenario, *_ in SCENARIOS:
        rest, grpc = by.get((f"{scenario} REST", "hloserve")), by.get((f"{scenario} gRPC", "hloserve"))
        if rest and grpc:
            lines.append(f"hloserve {scenario}: REST / gRPC = {rest / grpc:.2f}x")
    return "\n".join(lines)
