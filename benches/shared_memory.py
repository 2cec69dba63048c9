"""Inline against system shared memory for large inputs, through perf_analyzer.

The `pool` model (224x224x3 FP32 images, a per-channel mean: almost no compute) with 8 images
(4.8 MB) and 104 images (62.6 MB, run as 13 executions of 8) per request, sent inline in the
gRPC message and through Triton's system shared-memory extension. The shared-memory column
is the ratio of inline to shared-memory p50 latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from benches.serving import _free_port, install, measure, start_server

CASES = ((8, "4.8 MB"), (104, "62.6 MB"))


@dataclass(frozen=True)
class Row:
    request: str
    inline_p50_ms: float
    shm_p50_ms: float
    inline_cpu_ms: float
    shm_cpu_ms: float

    @property
    def speedup(self) -> float:
        return self.inline_p50_ms / self.shm_p50_ms


def run(window_ms: int = 3000) -> list[Row]:
    install()
    port = _free_port()
    server = start_server(port, allow_client_shm=True)
    url = f"127.0.0.1:{port}"
    rows = []
    try:
        for images, label in CASES:
            base = ["-b", str(images)]
            shm = ["--shared-memory", "system", "--output-shared-memory-size", str(images * 3 * 4)]
            inline = measure(url, server.pid, label, "pool", 1, base, window_ms=window_ms)
            shared = measure(url, server.pid, label, "pool", 1, [*base, *shm], window_ms=window_ms)
            rows.append(
                Row(
                    label,
                    inline.p50_ms,
                    shared.p50_ms,
                    inline.server_cpu_ms_per_request,
                    shared.server_cpu_ms_per_request,
                )
            )
    finally:
        server.terminate()
        server.wait(30)
    return rows


def table(rows: list[Row]) -> str:
    header = ("request", "inline p50 ms", "shm p50 ms", "speedup", "inline CPU ms", "shm CPU ms")
    lines = ["{:<9} {:>13} {:>10} {:>8} {:>13} {:>10}".format(*header)]
    for r in rows:
        lines.append(
            f"{r.request:<9} {r.inline_p50_ms:13.2f} {r.shm_p50_ms:10.2f} {r.speedup:7.1f}x "
            f"{r.inline_cpu_ms:13.2f} {r.shm_cpu_ms:10.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{**asdict(r), "speedup": r.speedup} for r in rows]
