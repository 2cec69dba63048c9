"""A Python load generator over tritonclient: the client every peer can serve.

perf_analyzer needs Triton's extension RPCs (model config, statistics), which MLServer and
KServe lack, so the side-by-side suite also drives every server with this: `concurrency`
threads, each with its own synchronous `tritonclient.grpc` client, sending for `seconds` and
recording each request's latency. The same client for every server keeps the comparison fair
(it costs about 0.4 ms of CPU per request itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["LoopResult", "python_loop"]


@dataclass(frozen=True)
class LoopResult:
    p50_ms: float
    p99_ms: float
    throughput: float
    """Inferences (rows) per second."""
    requests: int
    errors: int
    first_error: str


def python_loop(
    url: str,
    pick_model: Callable[[np.random.Generator], str],
    input_name: str,
    array: np.ndarray,
    concurrency: int,
    seconds: float,
) -> LoopResult:
    """Send `array` as `input_name` to `pick_model(rng)` from `concurrency` threads."""
    import tritonclient.grpc as grpcclient

    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        # Its own connection, as an independent client's (grpcio otherwise shares one per process).
        client = grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        tensor = grpcclient.InferInput(input_name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        try:
            while time.monotonic() < stop:
                model = pick_model(rng)
                started = time.perf_counter()
                try:
                    client.infer(model, [tensor])
                except Exception as e:
                    errors.append(f"{model}: {e}")
                    continue
                latencies[index].append(time.perf_counter() - started)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    elapsed = time.monotonic() - started
    every = np.concatenate([np.asarray(x) for x in latencies]) if any(latencies) else np.zeros(1)
    count = sum(len(x) for x in latencies)
    return LoopResult(
        round(float(np.percentile(every, 50)) * 1e3, 3),
        round(float(np.percentile(every, 99)) * 1e3, 3),
        round(count * array.shape[0] / elapsed, 1),
        count,
        len(errors),
        errors[0] if errors else "",
    )
