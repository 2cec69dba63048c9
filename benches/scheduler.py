"""Coalescing under load: the MLP (compiled for 1, 4, 8, 16) at concurrency 1, 4, 16 and 64.

perf_analyzer sends one-row requests; the table shows throughput, p99, the server's CPU per
request and the mean rows per execution the scheduler achieved by joining concurrent requests.
Triton with dynamic batching on the same model belongs beside it (issue 7's peer suite).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benches.serving import _free_port, install, measure, start_server

CONCURRENCY = (1, 4, 16, 64)


@dataclass(frozen=True)
class Row:
    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_request: float
    rows_per_execution: float


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
    url = f"127.0.0.1:{port}"
    rows = []
    try:
        for c in CONCURRENCY:
            inferred, executed = _counts(url)
            r = measure(url, server.pid, f"c={c}", "mlp", c, ["-b", "1"], window_ms=window_ms)
            inferred_after, executed_after = _counts(url)
            per_execution = (inferred_after - inferred) / max(1, executed_after - executed)
            rows.append(Row(c, r.throughput, r.p50_ms, r.p99_ms, r.server_cpu_ms_per_request, per_execution))
    finally:
        server.terminate()
        server.wait(30)
    return rows


def table(rows: list[Row]) -> str:
    header = ("concurrency", "infer/s", "p50 ms", "p99 ms", "server CPU ms/req", "rows/execution")
    lines = ["{:>11} {:>9} {:>8} {:>8} {:>18} {:>15}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.concurrency:11d} {r.throughput:9.1f} {r.p50_ms:8.2f} {r.p99_ms:8.2f} "
            f"{r.server_cpu_ms_per_request:18.3f} {r.rows_per_execution:15.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
