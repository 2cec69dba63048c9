"""Per-model counters in Triton's shape, read by ModelStatistics and the Prometheus collector.

Written only from the worker's event-loop thread (the planes and the dispatcher share it),
so the counters need no lock; readers in other threads take `snapshot()` copies.
"""

from __future__ import annotations

import bisect
import heapq
import time
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "LOAD_BUCKETS_S",
    "WAITS_KEPT",
    "Duration",
    "ExecutionTimes",
    "ModelStatistics",
    "RecentWaits",
    "Statistics",
]

LOAD_BUCKETS_S = tuple(0.0001 * 4**k for k in range(9))  # 0.1 ms .. 6.6 s: a weight load's duration

WAITS_KEPT = 1024
"""Recent queue waits kept per model, for the wait quantiles."""


class RecentWaits:
    """The last `WAITS_KEPT` queue waits of a model, as doubles in one array (8 KB once full).
    A deque of floats held an object per wait, 32 KB a busy model, and took a new float from
    the heap for every request: memory that grew for hours as the catalogue's tail filled."""

    __slots__ = ("_next", "_values")

    def __init__(self) -> None:
        self._values = array("d")
        self._next = 0
        """Where the next wait overwrites the oldest, once `WAITS_KEPT` are kept."""

    def append(self, seconds: float) -> None:
        if len(self._values) < WAITS_KEPT:
            self._values.append(seconds)
        else:
            self._values[self._next] = seconds
            self._next = (self._next + 1) % WAITS_KEPT

    def extend(self, waits: Iterable[float]) -> None:
        for seconds in waits:
            self.append(seconds)

    def copy(self) -> RecentWaits:
        copied = RecentWaits()
        copied._values, copied._next = array("d", self._values), self._next
        return copied

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[float]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecentWaits):
            return NotImplemented
        return (self._values, self._next) == (other._values, other._next)

    def __repr__(self) -> str:
        return f"RecentWaits({len(self._values)} kept)"


@dataclass(slots=True)
class Duration:
    """A count and the total nanoseconds spent, as Triton's StatisticDuration."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def copy(self) -> Duration:
        return Duration(self.count, self.ns)


@dataclass(slots=True)
class ExecutionTimes:
    """Time spent in one execution's three phases (Triton's compute_input/infer/output)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


def _times(times: ExecutionTimes) -> ExecutionTimes:
    return ExecutionTimes(times.compute_input.copy(), times.compute_infer.copy(), times.compute_output.copy())


@dataclass(slots=True)
class ModelStatistics:
    """Everything counted for one model since the worker started."""

    last_inference_ms: int = 0
    """Wall-clock time of the last execution, milliseconds since the epoch."""
    inference_count: int = 0
    """Rows executed (Triton counts batch elements, not requests)."""
    execution_count: int = 0
    queue_depth: int = 0
    """Requests waiting now (kept by the model's queue actor)."""
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: ExecutionTimes = field(default_factory=ExecutionTimes)
    by_batch_size: defaultdict[int, ExecutionTimes] = field(
        default_factory=lambda: defaultdict(ExecutionTimes)
    )
    requests_served: int = 0
    """Requests answered from an execution (a batch counts each of its requests)."""
    waits: RecentWaits = field(default_factory=RecentWaits)
    """Queue waits of the last `WAITS_KEPT` requests taken, in seconds."""
    drops: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Requests that never ran, by reason: deadline, cancelled, queue_full."""
    cost: dict[int, float] = field(default_factory=dict)
    """The dispatcher's learned seconds per execution, by batch size."""
    residency: str = ""
    """The model's residency floor: unpinned, system or device."""
    resident: bool = False
    """Its weights are on the device now."""
    host_resident: bool = False
    """Its weights are held in host memory (a `system` floor)."""
    host_pinned: bool = False
    """That host copy is in pinned (page-locked) host memory."""
    weight: float = 1.0
    """Its scheduling weight (kept by the dispatcher)."""
    weight_bytes: int = 0
    weight_loads: int = 0
    weight_evictions: int = 0
    weight_load_seconds: float = 0.0
    """Seconds its loads took, from the start of each copy to its end (overlapped or not)."""
    weight_prefetches: int = 0
    """Loads started ahead of the model's execution, to overlap another's (counted in loads)."""
    weight_load_bytes: int = 0
    """Bytes copied to the device by its loads."""
    weight_load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS_S))
    """Its loads by duration: how many took at most each of `LOAD_BUCKETS_S` (not cumulative;
    a longer load counts in none)."""
    evictions_by_cause: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Its evictions by cause: budget (to fit another model), compaction, control (residency
    set by the control API)."""
    load_wait_seconds: float = 0.0
    """Time its requests waited for its weights to load, summed over the requests."""
    last_load: tuple[float, float, int, bool] | None = None
    """Its latest load: (start, end, bytes, overlapped), monotonic seconds; overlapped: begun
    while another model executed. A traced request's `weight_load` span."""

    def copy(self) -> ModelStatistics:
        """A copy that shares nothing mutable: field by field, the containers by their C-level
        copies (a `copy.deepcopy` walked every recent wait: 1.3 s on the loop for 1,000 models)."""
        copied = ModelStatistics.__new__(ModelStatistics)
        for name in ModelStatistics.__slots__:
            setattr(copied, name, getattr(self, name))
        copied.success, copied.fail, copied.queue = self.success.copy(), self.fail.copy(), self.queue.copy()
        copied.compute = _times(self.compute)
        copied.by_batch_size = defaultdict(
            ExecutionTimes, {b: _times(t) for b, t in self.by_batch_size.items()}
        )
        copied.waits = self.waits.copy()
        copied.drops = self.drops.copy()
        copied.cost = self.cost.copy()
        copied.weight_load_buckets = self.weight_load_buckets.copy()
        copied.evictions_by_cause = self.evictions_by_cause.copy()
        return copied

    def record_load(self, seconds: float, nbytes: int) -> None:
        """One load of its weights to the device."""
        self.weight_loads += 1
        self.weight_load_seconds += seconds
        self.weight_load_bytes += nbytes
        index = bisect.bisect_left(LOAD_BUCKETS_S, seconds)
        if index < len(LOAD_BUCKETS_S):
            self.weight_load_buckets[index] += 1

    def wait_quantiles(self, qs: Sequence[float]) -> list[float]:
        """Quantiles of the recent queue waits (0 when none), from one sort: a scrape asks for
        two of each exposed model's, and sorting was a fifth of its time at 1,000 models."""
        if not self.waits:
            return [0.0] * len(qs)
        ordered = sorted(self.waits)
        return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]

    def record_execution(
        self, batch_size: int, rows: int, input_s: float, infer_s: float, output_s: float
    ) -> None:
        self.last_inference_ms = int(time.time() * 1e3)
        self.inference_count += rows
        self.execution_count += 1
        for times in (self.compute, self.by_batch_size[batch_size]):
            times.compute_input.add(input_s)
            times.compute_infer.add(infer_s)
            times.compute_output.add(output_s)


class Statistics:
    """The worker's per-model statistics, created on first use of a model name."""

    def __init__(self) -> None:
        self._models: dict[str, ModelStatistics] = {}
        self.compactions = 0
        """Weight-cache compactions since start."""
        self.device_weight_bytes = 0
        """Bytes of on-demand weights on the device or being copied there (the budget's count)."""
        self.seconds_per_weight_byte = 0.0
        """The weight cache's measured seconds per byte copied from a host floor (0: none yet)."""
        self.weight_budget_bytes: int | None = None
        """The weight cache's byte budget (None: every model stays resident)."""

    def __getitem__(self, model: str) -> ModelStatistics:
        stats = self._models.get(model)
        if stats is None:
            stats = self._models[model] = ModelStatistics()
        return stats

    def __len__(self) -> int:
        return len(self._models)

    def snapshot(self, limit: int = 0) -> dict[str, ModelStatistics]:
        """A copy sharing nothing mutable, safe to read from another thread, of `busiest(limit)`."""
        return self.copies(self.busiest(limit))

    def busiest(self, limit: int = 0) -> list[str]:
        """Every model's name, or when `limit` is not 0 and there are more, the `limit` busiest
        (resident first, then by executions: O(models log limit)), sorted by name."""
        if not limit or len(self._models) <= limit:
            return list(self._models)
        busiest = heapq.nlargest(
            limit, self._models.items(), key=lambda item: (item[1].resident, item[1].execution_count)
        )
        return sorted(name for name, _ in busiest)

    def copies(self, names: list[str]) -> dict[str, ModelStatistics]:
        """Copies of the named models' records (those still counted), each sharing nothing
        mutable: about 25 us a model, so a caller on the serving loop takes a hundred at a time."""
        return {name: stats.copy() for name in names if (stats := self._models.get(name)) is not None}

    def forget(self, model: str) -> None:
        """Drop what was counted for `model` (at its unload: a worker that loads and unloads
        ever new names must not keep a record, and a `/metrics` series, for each; as Triton, a
        model loaded again counts from zero)."""
        self._models.pop(model, None)
