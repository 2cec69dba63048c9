"""`Statistics.snapshot`: the copy a scrape reads from another thread equals the live record and
shares nothing that the serving loop goes on changing."""

from __future__ import annotations

import copy
import dataclasses
import sys

from hloserve.engine.statistics import WAITS_KEPT, Statistics


def _busy(statistics: Statistics, name: str) -> None:
    s = statistics[name]
    for batch in (1, 4, 8):
        s.record_execution(batch, batch, 1e-4, 1e-3, 2e-4)
    s.success.add(0.002)
    s.fail.add(0.001)
    s.queue.add(0.0005)
    s.waits.extend([0.001, 0.002])
    s.drops["deadline"] += 1
    s.cost[8] = 0.003
    s.record_load(0.01, 1 << 20)
    s.evictions_by_cause["budget"] += 1
    s.last_load = (1.0, 2.0, 1 << 20, True)


def test_a_snapshot_equals_the_record_and_shares_nothing_mutable() -> None:
    statistics = Statistics()
    for name in ("a", "b"):
        _busy(statistics, name)
    snapshot = statistics.snapshot()
    before = copy.deepcopy(snapshot)
    assert snapshot == copy.deepcopy(statistics._models)
    _busy(statistics, "a")  # every mutable field of "a" changes after the copy
    statistics["a"].by_batch_size[16].compute_infer.add(1.0)
    assert snapshot == before
    assert statistics["a"] != snapshot["a"]
    copied = snapshot["a"]
    for field in dataclasses.fields(copied):
        value = getattr(copied, field.name)
        if not isinstance(value, (int, float, str, bool, tuple, type(None))):
            assert value is not getattr(statistics["a"], field.name), field.name
    assert copied.by_batch_size[32].compute_input.count == 0  # still a defaultdict of its kind


def test_a_bounded_snapshot_keeps_the_resident_then_the_busiest() -> None:
    statistics = Statistics()
    for name, executions in (("idle", 0), ("busy", 5), ("busier", 9)):
        for _ in range(executions):
            statistics[name].record_execution(1, 1, 0.0, 1e-3, 0.0)
    statistics["idle"].resident = True
    assert list(statistics.snapshot(2)) == ["busier", "idle"]  # sorted by name


def test_the_wait_quantiles_come_from_the_recent_waits() -> None:
    statistics = Statistics()
    s = statistics["a"]
    assert s.wait_quantiles((0.5, 0.99)) == [0.0, 0.0]
    s.waits.extend(i / 1000 for i in range(2000))  # only the last 1,024 are kept: 0.976 .. 1.999
    median, tail = s.wait_quantiles((0.5, 0.99))
    assert median == (976 + 512) / 1000 and tail == (976 + 1013) / 1000


def test_the_recent_waits_of_a_busy_model_take_one_array_and_no_object_per_wait() -> None:
    """A deque of floats took 32 bytes a wait from the heap for every request (issue 38's soak
    saw it grow for as long as the catalogue's tail kept filling its models' deques)."""
    s = Statistics()["a"]
    s.waits.extend(i / 1000 for i in range(WAITS_KEPT))
    full = sys.getsizeof(s.waits._values)
    s.waits.extend(i / 1000 for i in range(5 * WAITS_KEPT))
    assert len(s.waits) == WAITS_KEPT and sys.getsizeof(s.waits._values) == full
    assert full <= 8 * WAITS_KEPT + 256
    assert sorted(s.waits) == [i / 1000 for i in range(4 * WAITS_KEPT, 5 * WAITS_KEPT)]
