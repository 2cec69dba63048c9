"""Placement of models on a node's workers by load and memory (`lpt_packing`): pure functions.

Longest processing time first: models in order of decreasing utilisation (then weight bytes,
then name) each go to the worker whose score after taking it is lowest, the score being the
larger of its compute load (busy fraction, capacity 1.0) and its weight bytes over its budget.
While any worker's budget still fits a model, only those are candidates (unless memory
oversubscription is allowed); a tie goes to the worker holding fewer bytes, then fewer models.
Hysteresis keeps a model where it was unless the best worker
scores better by more than that fraction, so a stable load gives a stable placement. A model with
k replicas takes the k best workers, charging each 1/k of its load and all of its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Demand", "Placement", "assign", "ewma", "replica_count"]


@dataclass(frozen=True, slots=True)
class Demand:
    """What one model asks of the node."""

    utilization: float  # busy fraction of one worker: arrival rate x cost per request
    weight_nbytes: int
    replicas: int = 0  # 0: the default; -1: every worker


@dataclass(slots=True)
class Placement:
    """The workers of each model, and what that puts on each worker."""

    workers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    moved: int = 0
    held_by_hysteresis: int = 0

    def oversubscribed(self, budgets: Mapping[str, int]) -> list[str]:
        """Workers given more weight bytes than their budget (eviction churn to expect)."""
        return [w for w, used in self.memory.items() if budgets.get(w, 0) > 0 and used > budgets[w]]


def replica_count(replicas: int, default_replicas: int, workers: int) -> int:
    """How many workers a model goes to: its own count, else the default; -1 means all."""
    wanted = replicas or default_replicas
    return workers if wanted < 0 else max(1, min(wanted, workers))


def ewma(old: float | None, sample: float, dt: float, halflife: float) -> float:
    """An average whose weight halves every `halflife` of `dt`; the first sample is taken as is."""
    if old is None:
        return sample
    alpha = 1.0 - math.pow(2.0, -dt / halflife) if halflife > 0 else 1.0
    return old + alpha * (sample - old)


def assign(
    demands: Mapping[str, Demand],
    workers: Sequence[str],
    budgets: Mapping[str, int],
    previous: Mapping[str, Sequence[str]],
    *,
    default_replicas: int = 1,
    hysteresis: float = 0.0,
    forbid_memory_oversubscription: bool = True,
) -> Placement:
    """Place every model of `demands` on `workers` (budgets: weight bytes, 0 = unbounded)."""
    ordered = sorted(workers)
    placement = Placement(compute=dict.fromkeys(ordered, 0.0), memory=dict.fromkeys(ordered, 0))
    held = dict.fromkeys(ordered, 0)  # models placed on each worker
    if not ordered:
        return placement

    def fits(worker: str, nbytes: int) -> bool:
        cap = budgets.get(worker, 0)
        return cap <= 0 or placement.memory[worker] + nbytes <= cap

    def score(worker: str, load: float, nbytes: int) -> float:
        cap = budgets.get(worker, 0)
        memory = (placement.memory[worker] + nbytes) / cap if cap > 0 else 0.0
        return max(placement.compute[worker] + load, memory)

    for name in sorted(demands, key=lambda m: (-demands[m].utilization, -demands[m].weight_nbytes, m)):
        demand = demands[name]
        k = replica_count(demand.replicas, default_replicas, len(ordered))
        before = tuple(w for w in previous.get(name, ()) if w in placement.compute)
        load, nbytes = demand.utilization / k, demand.weight_nbytes
        if k == 1:
            fitting = [w for w in ordered if fits(w, nbytes)]
            candidates = fitting if forbid_memory_oversubscription and fitting else ordered
            # Ties go to the worker holding fewer bytes, then fewer models, then the first by name:
            # with no budgets and no traffic yet, models still spread over the workers.
            best = min(candidates, key=lambda w: (score(w, load, nbytes), placement.memory[w], held[w], w))
            chosen: tuple[str, ...] = (best,)
            if len(before) == 1 and before[0] in candidates and before[0] != best:
                if score(before[0], load, nbytes) <= score(best, load, nbytes) * (1 + hysteresis):
                    chosen = before
                    placement.held_by_hysteresis += 1
        else:
            ranked = sorted(
                ordered,
                key=lambda w: (not fits(w, nbytes), score(w, load, nbytes), w not in before, held[w], w),
            )
            chosen = tuple(sorted(ranked[:k]))
        for worker in chosen:
            placement.compute[worker] += load
            placement.memory[worker] += nbytes
            held[worker] += 1
        placement.workers[name] = chosen
        if before and set(before) != set(chosen):
            placement.moved += 1
    return placement
