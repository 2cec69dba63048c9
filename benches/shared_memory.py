"""Inline against system shared memory for large inputs, hloserve beside Triton.

The `pool` model (224x224x3 FP32 images, a per-channel mean: almost no compute) with 8 images
(4.8 MB) and 107 images (64.4 MB; hloserve runs it as 14 executions, Triton in one) per
request, sent inline in the gRPC message and through Triton's system shared-memory extension,
by perf_analyzer at concurrency 1, and by hloserve's own client (inline, and staged in a
shared-memory BufferPool). p50 latency in ms for each server and path.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import trio
import trio_asyncio

from benches.peers import triton
from benches.serving import _free_port, _pin, install, measure, start_server
from hloserve.client import Client, encode_request_shm
from hloserve.engine.buffer_pool import BufferPool

CASES = ((8, "4.8 MB"), (107, "64.4 MB"))


@dataclass(frozen=True)
class Row:
    request: str
    inline_p50_ms: float
    shm_p50_ms: float
    triton_inline_p50_ms: float
    triton_shm_p50_ms: float
    shm_cpu_ms: float
    triton_shm_cpu_ms: float
    client_inline_p50_ms: float
    client_shm_p50_ms: float

    @property
    def speedup(self) -> float:
        return self.inline_p50_ms / self.shm_p50_ms


def run(window_ms: int = 3000) -> list[Row]:
    install()
    port = _free_port()
    server = start_server(port, allow_client_shm=True)
    peer, peer_port = triton.start(_pin(0))
    url, peer_url = f"127.0.0.1:{port}", f"127.0.0.1:{peer_port}"
    rows = []
    try:
        for images, label in CASES:
            base = ["-b", str(images)]
            shm = [*base, "--shared-memory", "system", "--output-shared-memory-size", str(images * 3 * 4)]
            inline = measure(url, server.pid, label, "pool", 1, base, window_ms=window_ms)
            shared = measure(url, server.pid, label, "pool", 1, shm, window_ms=window_ms)
            t_inline = measure(peer_url, peer.pid, label, "pool", 1, base, window_ms=window_ms)
            t_shared = measure(peer_url, peer.pid, label, "pool", 1, shm, window_ms=window_ms)
            client_inline, client_shm = trio.run(_through_client, port, images)
            rows.append(
                Row(
                    label,
                    inline.p50_ms,
                    shared.p50_ms,
                    t_inline.p50_ms,
                    t_shared.p50_ms,
                    shared.server_cpu_ms_per_request,
                    t_shared.server_cpu_ms_per_request,
                    client_inline,
                    client_shm,
                )
            )
    finally:
        for process in (server, peer):
            process.terminate()
            process.wait(60)
    return rows


async def _through_client(port: int, images: int, repeats: int = 15) -> tuple[float, float]:
    """p50 ms of hloserve's own client: inline, then staged in a shared-memory BufferPool slot."""
    async with trio_asyncio.open_loop():
        client = Client("127.0.0.1", port)
        call = trio_asyncio.aio_as_trio
        x = np.random.default_rng(0).random((images, 224, 224, 3), dtype=np.float32)
        inline = []
        for _ in range(repeats):
            started = time.perf_counter()
            await call(client.infer)("pool", {"IMAGE": x})
            inline.append(time.perf_counter() - started)
        shared = []
        with BufferPool(2 * x.nbytes + (1 << 20), n_slots=2) as pool:
            await call(client.register_pool)(pool, "bench")
            for _ in range(repeats):
                started = time.perf_counter()
                slot = await pool.acquire_slot(2)
                staged, out = pool.scratch(slot, [(x.shape, np.float32), ((images, 3), np.float32)])
                staged[:] = x
                request = encode_request_shm("pool", pool, "bench", {"IMAGE": staged}, outputs={"MEAN": out})
                await call(client.infer_message)(request)
                result = out.copy()
                pool.release(slot)
                shared.append(time.perf_counter() - started)
            del staged, out, result
            await call(client.unregister_system_shared_memory)("bench")
        client.close()
    return statistics.median(inline) * 1e3, statistics.median(shared) * 1e3


def table(rows: list[Row]) -> str:
    header = (
        "request",
        "inline",
        "shm",
        "speedup",
        "Triton inline",
        "Triton shm",
        "client inline",
        "client shm",
    )
    lines = ["{:<8} {:>8} {:>8} {:>8} {:>13} {:>10} {:>13} {:>10}".format(*header)]
    for r in rows:
        ours = f"{r.inline_p50_ms:8.2f} {r.shm_p50_ms:8.2f} {r.speedup:7.1f}x"
        theirs = f"{r.triton_inline_p50_ms:13.2f} {r.triton_shm_p50_ms:10.2f}"
        client = f"{r.client_inline_p50_ms:13.2f} {r.client_shm_p50_ms:10.2f}"
        lines.append(f"{r.request:<8} {ours} {theirs} {client}")
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{**asdict(r), "speedup": r.speedup} for r in rows]
