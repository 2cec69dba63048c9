"""How many bytes of weights may be on the device at once: ReactantServer.jl's `weight_budget`, and
`resolve_budget`, which sizes it when a worker starts.

Of the allocator's arena, a `wiggle` fraction stays free for fragmentation; the largest scratch
any model needs is set aside; of what remains, at most `fraction` of the arena holds weights
(the weight pool). Device-pinned weights live in the pool permanently, and the rest of it is
the on-demand budget the weight cache evicts to stay within.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from hloserve.config import Config, ModelSettings
from hloserve.models import _xla

if TYPE_CHECKING:
    from hloserve.models.compiled import CompiledModel

__all__ = ["WeightBudget", "resolve_budget", "scratch_of", "weight_budget"]

log = structlog.get_logger("hloserve.budget")


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
    its peak less the largest weights placed so far (ReactantServer.jl's startup probe)."""
    largest, scratch = 0, 0
    for weight_bytes, peak in peaks:
        largest = max(largest, weight_bytes)
        scratch = max(scratch, peak - largest)
    return scratch


def resolve_budget(config: Config, models: Sequence[tuple[CompiledModel, int | None]]) -> int | None:
    """The on-demand weight budget for `models` (each with the allocator's peak after its
    warm-up, None where the backend keeps no statistics): `weights.budget_bytes` if set, else
    sized from the arena by `weight_budget`, with scratch from the peaks or, on a CPU, from the
    executables' memory analysis; None when there is no arena either (every model stays
    resident). Logs the resolved figures, with a warning when nothing is left."""
    weights = config.weights
    if weights.budget_bytes is not None:
        return weights.budget_bytes
    limit = (_xla.memory_stats() or {}).get("bytes_limit")
    arena = weights.arena_bytes if weights.arena_bytes is not None else limit
    if arena is None or weights.fraction == 0:
        log.info("weight cache off: every model stays resident", arena_bytes=arena, fraction=weights.fraction)
        return None
    peaks = [(c.bundle.weight_nbytes, peak) for c, peak in models if peak is not None]
    measured = bool(models) and len(peaks) == len(models)
    max_scratch = scratch_of(peaks) if measured else max((c.scratch_bytes for c, _ in models), default=0)
    floors = config.scheduler.models
    pinned = sum(
        c.bundle.weight_nbytes for c, _ in models if floors.get(c.name, ModelSettings()).floor == "device"
    )
    budget = weight_budget(arena, weights.fraction, weights.wiggle, max_scratch, pinned)
    report = {
        "arena_bytes": arena,
        "arena_from": "configured" if weights.arena_bytes is not None else "allocator limit",
        "max_scratch_bytes": max_scratch,
        "scratch_from": "allocator peaks" if measured else "executables' memory analysis",
        "pinned_bytes": pinned,
        "weight_pool_bytes": budget.weight_pool,
        "on_demand_bytes": budget.on_demand,
    }
    if budget.pinned_over_commit:
        log.warning("pinned weights exceed the weight pool: nothing loads on demand", **report)
    elif budget.on_demand == 0:
        log.warning("no room for weights on demand: scratch and pinned weights fill the arena", **report)
    else:
        log.info("weight budget resolved", **report)
    return budget.on_demand
