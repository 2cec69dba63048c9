"""How many bytes of weights may be on the device at once: the seeds' `weight_budget`.

Of the allocator's arena, a `wiggle` fraction stays free for fragmentation; the largest scratch
any model needs is set aside; of what remains, at most `fraction` of the arena holds weights
(the weight pool). Device-pinned weights live in the pool permanently, and the rest of it is
the on-demand budget the weight cache evicts to stay within.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WeightBudget", "scratch_of", "weight_budget"]


@dataclass(frozen=True, slots=True)
class WeightBudget:
    weight_pool: int
    """Bytes weights may take on the device, pinned ones included."""
    on_demand: int
    """Bytes left for weights loaded on demand and evicted least-recently-used."""
    pinned_over_commit: bool
    """Pinned weights alone exceed the pool (logged as a warning: nothing fits on demand)."""


def weight_budget(
    arena: int, fraction: float, wiggle: float, max_scratch: int, pinned_bytes: int
) -> WeightBudget:
    """The budget for an arena of `arena` bytes; see the module docstring."""
    scratch_ceiling = math.floor((1 - wiggle) * arena)
    pool = max(0, min(math.floor(fraction * arena), scratch_ceiling - max_scratch))
    return WeightBudget(pool, min(max(pool - pinned_bytes, 0), pool), pinned_bytes > pool)


def scratch_of(peaks: list[tuple[int, int]]) -> int:
    """The largest scratch of models warmed up one after another, from `(weight bytes, allocator
    peak after its warm-up)` pairs in load order: the peak never falls, so each model's scratch is
    its peak less the largest weights placed so far (the seeds' startup probe)."""
    largest, scratch = 0, 0
    for weight_bytes, peak in peaks:
        largest = max(largest, weight_bytes)
        scratch = max(scratch, peak - largest)
    return scratch
