"""What a worker keeps for a model is released when the model is unloaded (issue 38): a worker
whose models are loaded and unloaded for hours holds the same heap, statistics and metric series
as after its first cycles."""

from __future__ import annotations

import gc
import os
import re
import tracemalloc
import urllib.request
from collections.abc import Iterator
from contextlib import closing

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.clients import infer
from support.servers import ServerThread, make_config, start_worker

from hloserve.memory_probe import allocator_bytes

HEAP_BOUND_BYTES = 384 << 10
"""Python heap a worker may gain over any number of load/unload cycles once warm. What fills up
and then stays (measured: ~220 KB over 300 cycles after 140, and 3,000 cycles stay under the
bound): each gRPC connection's last 400 closed streams (~75 KB), trio's deadline heap, pruned
only past 1,000 stale entries (~100 KB with their cancel scopes), a model's last 1,024 queue
waits (~35 KB), parser and MLIR caches. A leak of 40 bytes a cycle crosses the bound within
10,000 cycles (the long test), one of 2 KB within 200."""


C_HEAP_BOUND_BYTES = 2 << 20
"""glibc's bytes in use the process may gain over the same cycles (tracemalloc's own tables
included, which grow with what it traces). Measured over 10,000 cycles: +1.21 MB by the 1,000th,
+1.29 MB at the 10,000th, within ±0.12 MB between; the ~0.8 KB a load first measured in the
churn of 2026-11-28 would add 8 MB over the long test's 10,000."""

_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ", re.MULTILINE)


@pytest.fixture(name="worker")
def _worker() -> Iterator[ServerThread]:
    with start_worker(make_config()) as server:
        assert isinstance(server, ServerThread)
        yield server


def _series(worker: ServerThread) -> set[str]:
    """The names and label sets of the worker's metric series (values left out)."""
    url = f"http://127.0.0.1:{worker.worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as answer:
        return set(_SERIES.findall(answer.read().decode()))


def _cycle(client: grpcclient.InferenceServerClient) -> None:
    """Unload `mlp`, load it again and serve it one request, as a churning operator does."""
    client.unload_model("mlp")
    client.load_model("mlp")
    result = infer(client, "mlp", {"INPUT0": np.ones((2, 16), np.float32)})
    assert result.as_numpy("OUTPUT0").shape == (2, 4)


IN_FLIGHT = tracemalloc.Filter(False, "*/asyncio/selector_events.py")
"""Bytes just read from a socket (asyncio's `recv`) and not yet parsed: data in flight on one of
the process's connections (the suite's other servers share it), not something a cycle kept."""


def _held() -> tracemalloc.Snapshot:
    """What the process's Python heap holds now, less the bytes in flight."""
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces([IN_FLIGHT])


def _c_heap() -> int:
    """glibc's bytes in use in this process."""
    figures = allocator_bytes()
    if figures is None:
        pytest.fail("no mallinfo2: this test runs where the server runs, on glibc")
    return int(figures["in_use"])


def _assert_cycles_release(worker: ServerThread, cycles: int) -> None:
    with closing(grpcclient.InferenceServerClient(worker.url)) as client:
        for _ in range(140):  # fill what is bounded (caches, the deadline heap, 400 closed streams)
            _cycle(client)
        tracemalloc.start(1)
        try:
            series, statistics = _series(worker), set(worker.call(worker.worker.statistics.snapshot))
            before, c_before = _held(), _c_heap()
            for _ in range(cycles):
                _cycle(client)
            changes, c_grown = _held().compare_to(before, "lineno"), _c_heap() - c_before
        finally:
            tracemalloc.stop()
        assert c_grown < C_HEAP_BOUND_BYTES, f"glibc's bytes in use grew {c_grown} B in {cycles} cycles"
        grown = sum(change.size_diff for change in changes)
        assert grown < HEAP_BOUND_BYTES, f"heap grew {grown} B in {cycles} cycles:\n" + "\n".join(
            map(str, changes[:8])
        )
        assert set(worker.call(worker.worker.statistics.snapshot)) == statistics
        assert _series(worker) == series


def test_an_unloaded_model_leaves_no_statistics_and_no_metric_series(worker: ServerThread) -> None:
    with closing(grpcclient.InferenceServerClient(worker.url)) as client:
        infer(client, "mlp", {"INPUT0": np.ones((2, 16), np.float32)})
        assert any('model="mlp"' in s for s in _series(worker))
        client.unload_model("mlp")
        assert "mlp" not in worker.call(worker.worker.statistics.snapshot)
        assert not [s for s in _series(worker) if 'model="mlp"' in s]
        client.load_model("mlp")  # as Triton: a model loaded again counts from zero
        stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
        assert stats["inference_stats"]["success"].get("count", 0) == 0
        _cycle(client)
        assert any('model="mlp",status="OK"' in s for s in _series(worker))


def test_load_unload_cycles_return_the_heap_and_the_counters_to_their_start(worker: ServerThread) -> None:
    _assert_cycles_release(worker, 200)


@pytest.mark.serial  # six minutes of loads on both cores: a timed test beside it misses its waits
@pytest.mark.timeout(1800)
def test_thousands_of_load_unload_cycles_return_the_heap_and_the_counters_to_their_start(
    worker: ServerThread,
) -> None:
    """Issue 38's count, 10,000 cycles (5.5 to 9 minutes alone on two cores), where a leak of 40 bytes a
    cycle crosses HEAP_BOUND_BYTES; `TEST_UNLOAD_CYCLES` runs another count."""
    _assert_cycles_release(worker, int(os.environ.get("TEST_UNLOAD_CYCLES", "10000")))
