"""Coalescing under load, beside Triton: the MLP at concurrency 1, 4, 16 and 64.

hloserve serves the example MLP compiled for batch sizes 1, 4, 8 and 16; Triton 2.51 serves the
same weights in its Python backend with dynamic batching up to 16 (`benches/peers/triton.py`).
perf_analyzer sends one-row requests to each in turn, in the same run. The table shows
throughput, p99, server CPU per request (the whole process tree) and hloserve's mean rows per
execution; the last column is hloserve's throughput over Triton's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benches.peers import triton
from benches.serving import _free_port, _pin, install, measure, start_server

CONCURRENCY = (1, 4, 16, 64)


@dataclass(frozen=True)
class Row:
    concurrency: int
    hloserve_throughput: float
    hloserve_p99_ms: float
    hloserve_cpu_ms: float
    rows_per_execution: float
    triton_throughput: float
    triton_p99_ms: float
    triton_cpu_ms: float

    @property
    def ratio(self) -> float:
        return self.hloserve_throughput / self.triton_throughput


def _counts(url: str) -> tuple[int, int]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics("mlp").model_stats[0]
        return int(stats.inference_count), int(stats.execution_count)
    finally:
        client.close()


def run(window_ms: int = 3000) -> list[Row]:
    install()
    port = _free_port()
    server = start_server(port)
    peer, peer_port = triton.start(_pin(0))
    url, peer_url = f"127.0.0.1:{port}", f"127.0.0.1:{peer_port}"
    rows = []
    try:
        for c in CONCURRENCY:
            inferred, executed = _counts(url)
            ours = measure(url, server.pid, f"c={c}", "mlp", c, ["-b", "1"], window_ms=window_ms)
            inferred_after, executed_after = _counts(url)
            theirs = measure(peer_url, peer.pid, f"c={c}", "mlp", c, ["-b", "1"], window_ms=window_ms)
            rows.append(
                Row(
                    c,
                    ours.throughput,
                    ours.p99_ms,
                    ours.server_cpu_ms_per_request,
                    (inferred_after - inferred) / max(1, executed_after - executed),
                    theirs.throughput,
                    theirs.p99_ms,
                    theirs.server_cpu_ms_per_request,
                )
            )
    finally:
        for process in (server, peer):
            process.terminate()
            process.wait(60)
    return rows


def table(rows: list[Row]) -> str:
    header = ("conc.", "hloserve/s", "p99 ms", "CPU ms", "rows/exec", "Triton/s", "p99 ms", "CPU ms", "ratio")
    lines = ["{:>5} {:>10} {:>7} {:>7} {:>9} {:>9} {:>7} {:>7} {:>6}".format(*header)]
    for r in rows:
        ours = f"{r.hloserve_throughput:10.1f} {r.hloserve_p99_ms:7.2f} {r.hloserve_cpu_ms:7.3f}"
        theirs = f"{r.triton_throughput:9.1f} {r.triton_p99_ms:7.2f} {r.triton_cpu_ms:7.3f}"
        lines.append(f"{r.concurrency:5d} {ours} {r.rows_per_execution:9.2f} {theirs} {r.ratio:5.2f}x")
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{**asdict(r), "ratio": r.ratio} for r in rows]
