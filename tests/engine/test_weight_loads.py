"""Weight loads on a live server: while one model executes, the dispatcher starts the copy of a
queued model that is not on the device, within the budget, evicting nothing in use; a traced
request's weight_load span says whether its load overlapped that execution; and a cold model's
load time counts against a request's deadline on arrival.

On a CPU the real copy aliases host memory and takes microseconds, so the copy here is a stand-in
of known duration (`weight_cache.device_copy`, the one thing that cannot exist without a device):
it sleeps `COPY_S`, then does the real copy, and records when it ran and what the budget held.
One process: the weight cache is the engine's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from support.bundles import write_heavy
from support.clients import infer
from support.numerics import assert_close
from support.otlp import Receiver, attributes, new_traceparent
from support.servers import ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.actors import weight_cache
from hloserve.export.jax import InputSpec, export_bundle

COPY_S = 0.25
"""How long the stand-in copy takes at most: less where `h` executes faster than twice that (the
tests set it from `h`'s measured execution, so that a copy fits inside one)."""
HEAVY_PRODUCTS = 1000
"""The heavy model's matrix products per row: 0.15-0.7 s of execution on these machines."""
HEAVY_BYTES = 256 * 256 * 4


def _columns(params: Any, x: Any) -> Any:
    return x @ params["w"][:, :4]


def write_sized(directory: Path, columns: int) -> Path:
    """A cheap model with 64 * `columns` bytes of weights (`w`: [16, columns]), so that its copies
    are told apart by size. INPUT0 [n, 16] → output_0 [n, 4]."""
    w = np.arange(16 * columns, dtype=np.float32).reshape(16, columns) / 100
    return export_bundle(
        _columns, {"w": w}, [InputSpec("INPUT0", (16,))], directory, batch_sizes=(1,), verify=False
    )


def _expected(columns: int, x: np.ndarray) -> np.ndarray:
    w = np.arange(16 * columns, dtype=np.float32).reshape(16, columns) / 100
    return x @ w[:, :4]


COPY_DURATION = [COPY_S]
"""The stand-in copy's duration now (see `_load_heavy`)."""
A_COLUMNS, B_COLUMNS = 8, 16
A_BYTES, B_BYTES = 64 * A_COLUMNS, 64 * B_COLUMNS


@dataclass(frozen=True)
class Copy:
    nbytes: int
    started: float
    ended: float
    budget_count: int
    """What the cache counted against the budget when the copy started (itself included)."""


@pytest.fixture(name="repository", scope="module")
def _repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("overlap")
    write_heavy(root / "h", HEAVY_PRODUCTS)
    write_sized(root / "a", A_COLUMNS)
    write_sized(root / "b", B_COLUMNS)
    return root


@pytest.fixture(name="copies")
def _copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[Copy], list[ServerThread]]]:
    """The stand-in copy: records each copy in the list; reads the budget's count from the
    server put in the second list."""
    recorded: list[Copy] = []
    servers: list[ServerThread] = []
    real = weight_cache.device_copy

    def copy(arrays: Sequence[Any]) -> list[Any]:
        started = time.monotonic()
        count = servers[0].worker.statistics.device_weight_bytes if servers else 0
        time.sleep(COPY_DURATION[0])
        placed = real(arrays)
        recorded.append(Copy(sum(int(a.nbytes) for a in arrays), started, time.monotonic(), count))
        return placed

    monkeypatch.setattr(weight_cache, "device_copy", copy)
    COPY_DURATION[0] = COPY_S
    yield recorded, servers


def _heavy_executing(server: ServerThread, pool: ThreadPoolExecutor) -> Any:
    """A request to `h`, from `pool`, returned once it has left its queue (it is executing);
    the future gives the time its answer came back."""
    taken = server.call(lambda: server.worker.statistics["h"].queue.count)

    def call() -> float:
        infer(grpcclient.InferenceServerClient(server.url), "h", {"INPUT0": np.ones((1, 256), np.float32)})
        return time.monotonic()

    future = pool.submit(call)
    deadline = time.monotonic() + 30
    while server.call(lambda: server.worker.statistics["h"].queue.count) == taken:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return future


def _load_heavy(client: Any) -> float:
    """Load `h` and time a warm execution; the stand-in copy takes at most half of one from now."""
    x = {"INPUT0": np.ones((1, 256), np.float32)}
    infer(client, "h", x)
    started = time.monotonic()
    infer(client, "h", x)
    heavy_s = time.monotonic() - started
    COPY_DURATION[0] = min(COPY_S, heavy_s / 2)
    return heavy_s


def _ask(client: Any, model: str, columns: int) -> float:
    """Infer `model` and check its answer; the seconds it took."""
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    started = time.monotonic()
    out = infer(client, model, {"INPUT0": x}).as_numpy("output_0")
    assert_close(out, _expected(columns, x))
    return time.monotonic() - started


def _cold_a_beside_heavy(
    repository: Path, copies: tuple[list[Copy], list[ServerThread]], overlap: bool
) -> tuple[float, float, Copy, dict[str, Any]]:
    """`h` warm and executing, then a request to cold `a`: (how long after h's answer a's came,
    when h's answer came, a's copy, the statistics). The time after h's answer is what the load
    adds to a's wait; a's whole latency would depend on how long h ran, which varies here."""
    recorded, servers = copies
    config = make_config(repository).replace(
        "weights", budget_bytes=HEAVY_BYTES + A_BYTES + 100, overlap_loads=overlap
    )
    with start_worker(config) as server:
        servers[:] = [server]
        client = grpcclient.InferenceServerClient(server.url)
        _load_heavy(client)
        recorded.clear()
        with ThreadPoolExecutor(1) as pool:
            heavy = _heavy_executing(server, pool)
            a_sent = time.monotonic()
            a_done = a_sent + _ask(client, "a", A_COLUMNS)
            heavy_done = heavy.result()
        statistics = server.call(server.worker.statistics.snapshot)
        client.close()
    [a_copy] = recorded
    assert a_copy.nbytes == A_BYTES
    return a_done - heavy_done, heavy_done, a_copy, statistics


def test_a_cold_model_loads_while_another_executes_and_saves_the_copy(
    repository: Path, copies: tuple[list[Copy], list[ServerThread]]
) -> None:
    overlapped, heavy_done, a_copy, statistics = _cold_a_beside_heavy(repository, copies, overlap=True)
    assert a_copy.ended < heavy_done  # the copy ran inside h's execution (about 0.3 s)
    assert a_copy.budget_count == HEAVY_BYTES + A_BYTES  # counted from the copy's start
    assert statistics["a"].weight_prefetches == 1 and statistics["a"].weight_loads == 1
    assert statistics["h"].weight_evictions == 0

    serial, heavy_done, a_copy, statistics = _cold_a_beside_heavy(repository, copies, overlap=False)
    assert a_copy.started >= heavy_done - 0.05  # after h's execution, in a's own turn
    assert statistics["a"].weight_prefetches == 0
    copy_s = COPY_DURATION[0]
    assert serial > 0.8 * copy_s, (serial, copy_s)  # a waited for its copy after h's answer...
    assert serial - overlapped > 0.5 * copy_s, (serial, overlapped)  # ...unless it hid behind h


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_a_traced_request_s_weight_load_says_whether_it_overlapped_another_execution(
    repository: Path,
    copies: tuple[list[Copy], list[ServerThread]],
    monkeypatch: pytest.MonkeyPatch,
    overlap: bool,
) -> None:
    """Cold `a` asked while `h` executes: with overlapping loads, a's copy runs inside h's
    execution, within a's queue wait (overlapped); without, it runs in a's own turn, after its
    queue wait (not overlapped, which is all a load can be then)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms of a span's end
    receiver = Receiver()
    recorded, servers = copies
    config = (
        make_config(repository)
        .replace("weights", budget_bytes=HEAVY_BYTES + A_BYTES + 100, overlap_loads=overlap)
        .replace("tracing", exporter="otlp", endpoint=receiver.endpoint)
    )
    try:
        with start_worker(config) as server:
            servers[:] = [server]
            client = grpcclient.InferenceServerClient(server.url)
            _load_heavy(client)
            recorded.clear()
            traceparent, trace_id, _ = new_traceparent()
            with ThreadPoolExecutor(1) as pool:
                heavy = _heavy_executing(server, pool)
                x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
                infer(client, "a", {"INPUT0": x}, headers={"traceparent": traceparent})
                heavy_done = heavy.result()
            spans = receiver.trace(trace_id, {"queue", "weight_load", "execute", "reply"})
            client.close()
        loads = [s for _, s in receiver.spans if s.trace_id == trace_id and s.name == "weight_load"]
    finally:
        receiver.stop()
    [a_copy] = recorded
    assert len(loads) == 1
    load, queue = spans["weight_load"], spans["queue"]
    assert attributes(load) == {"hloserve.weights.bytes": A_BYTES, "hloserve.weights.overlapped": overlap}
    assert load.parent_span_id == queue.parent_span_id == spans["execute"].parent_span_id
    assert load.end_time_unix_nano <= spans["execute"].start_time_unix_nano
    if overlap:  # inside a's queue wait, which h's execution filled
        assert a_copy.ended < heavy_done
        assert queue.start_time_unix_nano <= load.start_time_unix_nano
        assert load.end_time_unix_nano <= queue.end_time_unix_nano
    else:  # after a's queue wait: the dispatcher took a's batch, then waited for its weights
        assert a_copy.started >= heavy_done - 0.05
        assert load.start_time_unix_nano >= queue.end_time_unix_nano


@pytest.mark.serial  # a must queue while h executes: another test's compile can outlast h
def test_a_prefetch_never_evicts_a_model_in_use_and_the_budget_counts_it_in_flight(
    repository: Path, copies: tuple[list[Copy], list[ServerThread]]
) -> None:
    """Room for h and a, not b: during h's execution a is copied, b is not (it could only make
    room by evicting h, executing, or a, in flight); b loads in its own turn, after h ended."""
    recorded, servers = copies
    budget = HEAVY_BYTES + A_BYTES + 100
    config = make_config(repository).replace("weights", budget_bytes=budget)
    with start_worker(config) as server:
        servers[:] = [server]
        clients = [grpcclient.InferenceServerClient(server.url) for _ in range(3)]
        _load_heavy(clients[0])
        for client in clients[1:]:  # connected now: a connection made inside h's run could outlast it
            assert client.is_model_ready("a") and client.is_model_ready("b")
        recorded.clear()
        with ThreadPoolExecutor(3) as pool:
            heavy = _heavy_executing(server, pool)
            a = pool.submit(_ask, clients[1], "a", A_COLUMNS)
            deadline = time.monotonic() + 10
            # a queued, or already past its queue (its copy done, or answered): b comes after it
            while not (
                server.call(lambda: server.worker.statistics["a"].queue_depth) or recorded or a.done()
            ):
                assert time.monotonic() < deadline, "a's request neither queued nor answered in 10 s"
                time.sleep(0.002)
            b = pool.submit(_ask, clients[2], "b", B_COLUMNS)
            heavy_done = heavy.result()
            a.result()
            b.result()
        statistics = server.call(server.worker.statistics.snapshot)
        for client in clients:
            client.close()
    assert [c.nbytes for c in recorded] == [A_BYTES, B_BYTES]
    a_copy, b_copy = recorded
    assert a_copy.ended < heavy_done and a_copy.budget_count == HEAVY_BYTES + A_BYTES
    assert b_copy.started >= heavy_done - 0.05  # only once h's execution no longer needs it
    assert b_copy.budget_count <= budget
    assert statistics["a"].weight_prefetches == 1 and statistics["b"].weight_prefetches == 0
    assert statistics["h"].weight_evictions == 1  # by b's load, after h ran


def test_admission_counts_a_cold_model_s_load_at_the_measured_rate(
    repository: Path, copies: tuple[list[Copy], list[ServerThread]]
) -> None:
    """a's load measures the copy at COPY_S per 512 bytes; b, twice the bytes, would take twice
    that to load: a deadline shorter than that is refused on arrival while b is cold, not once
    it is on the device."""
    config = make_config(repository).replace("weights", budget_bytes=10 << 20)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        _ask(client, "a", A_COLUMNS)
        deadline_s = 1.5 * COPY_S  # b's load: 2 * COPY_S
        with pytest.raises(InferenceServerException) as refused:
            infer(client, "b", {"INPUT0": x}, client_timeout=deadline_s)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert "cannot meet its deadline" in refused.value.message()
        load_ms = float(re.search(r"its weights ([0-9.]+) ms to load", refused.value.message())[1])  # type: ignore[index]
        assert 2 * COPY_S * 1e3 <= load_ms < 2 * COPY_S * 1e3 * 1.2
        assert [c.nbytes for c in copies[0]] == [A_BYTES]  # refused before anything was copied
        infer(client, "a", {"INPUT0": x}, client_timeout=deadline_s)  # resident: no load to count
        _ask(client, "b", B_COLUMNS)  # no deadline: loads
        infer(client, "b", {"INPUT0": x}, client_timeout=deadline_s)
        assert server.call(lambda: server.worker.statistics["b"].drops["cannot_meet_deadline"]) == 1
        client.close()


def test_a_prefetch_evicts_only_what_makes_room_and_nothing_when_nothing_would(tmp_path: Path) -> None:
    """The cache alone, room for x and y (512 bytes each) or for `big` (1024). Prefetching big
    with x kept could make room only by evicting x as well as y: it evicts nothing and copies
    nothing. With nothing kept it evicts both, least recently used first, and copies big."""
    from hloserve.actors.messages import AddWeights
    from hloserve.actors.weight_cache import WeightCache
    from hloserve.engine.statistics import Statistics
    from hloserve.models.bundle import load_bundle

    bundles = {name: load_bundle(write_sized(tmp_path / name, A_COLUMNS)) for name in "xy"}
    bundles["big"] = load_bundle(write_sized(tmp_path / "big", B_COLUMNS))
    statistics = Statistics()
    cache = WeightCache(statistics, budget_bytes=2 * A_BYTES + 10, externally_managed=False)

    def state() -> dict[str, tuple[bool, int, int, int]]:
        return {
            n: (s.resident, s.weight_loads, s.weight_evictions, s.weight_prefetches)
            for n, s in sorted(statistics.snapshot().items())
        }

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(cache.run)
            for name, bundle in bundles.items():
                await handle.forward(AddWeights(name, bundle, "unpinned"))
            await handle.acquire("y")
            await handle.acquire("x")
            await handle.prefetch("big", frozenset({"x"}))
            await handle.acquire("x")  # the prefetch has been handled
            assert state() == {"big": (False, 0, 0, 0), "x": (True, 1, 0, 0), "y": (True, 1, 0, 0)}
            await handle.prefetch("big", frozenset())
            await handle.acquire("big")
            assert state() == {"big": (True, 1, 0, 1), "x": (False, 1, 1, 0), "y": (False, 1, 1, 0)}
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert cache.resident_bytes == statistics.device_weight_bytes == B_BYTES


def test_edf_drops_a_request_that_cannot_load_and_run_before_its_deadline() -> None:
    """The queue alone, under edf: with 0.2 s left, a cost of 0.05 s leaves room, the same cost
    after a 0.3 s load does not: that request is dropped DEADLINE_EXCEEDED before anything loads."""
    import concurrent.futures

    from hloserve.actors.messages import Batch, Infer, Take
    from hloserve.actors.model_queue import ModelQueue, QueueSettings
    from hloserve.engine.statistics import Statistics
    from hloserve.errors import DeadlineExceeded

    statistics = Statistics()

    async def main() -> tuple[list[int], list[int]]:
        dispatcher_send, dispatcher_receive = trio.open_memory_channel[object](100)
        queue = ModelQueue("m", QueueSettings((1,), True, 16), dispatcher_send, statistics)  # type: ignore[arg-type]
        batches_send, batches_receive = trio.open_memory_channel[Batch](1)
        taken = []
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(queue.run)
            for load_s in (0.0, 0.3):
                now = time.monotonic()
                x = [np.zeros((1, 16), np.float32)]
                request = Infer("m", x, 1, [0], concurrent.futures.Future(), now, deadline=now + 0.2)
                handle.submit_nowait(request)
                await handle.take(Take(batches_send, edf=True, costs={1: 0.05}, load_s=load_s))
                batch = await batches_receive.receive()
                taken.append(len(batch.requests))
                if not batch.requests:
                    with pytest.raises(DeadlineExceeded):
                        request.reply.result(timeout=0)
            nursery.cancel_scope.cancel()
        dispatcher_receive.close()
        return taken, [statistics["m"].drops["deadline"]]

    assert trio.run(main) == ([1, 0], [1])
