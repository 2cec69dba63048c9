"""Least outstanding *compute* through Envoy's least-request balancing: pure functions.

Envoy counts the requests a model's cluster has in flight on each worker, and so balances the
traffic of the models in that cluster (a pool: the models on the same workers with the same
weights); it cannot see what the worker's other models keep it busy with. Upstream
charges each request its compute cost and picks the worker with the least compute in flight
over every model. The node gets there in two halves: Envoy's least-request within a model, and
an endpoint weight per worker that says how much of that worker the *other* models leave free.

From each worker's ModelControlStatus counters the controller learns, per model, its cost per
request (compute seconds over requests, summed over the workers) and its arrival rate on each
worker (requests per wall second), each an average whose weight halves every `halflife` of
fleet compute. A worker's load is the sum of rate x cost over its models: the fraction of it
they keep busy. In model m's cluster a worker weighs `100 * (1 - load of the others)`, in
steps of 5 (so that noise does not rewrite Envoy's clusters every round), at least 1: among
workers with as many of m's requests in flight, Envoy picks the freer one, and a worker half
busy with other models gets about half the share of an idle one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hloserve.fleet.placement import ewma

__all__ = ["Counters", "Traffic", "WorkerLoads", "endpoint_weights", "learn", "worker_loads"]

MAX_WEIGHT = 100
_STEP = 5


@dataclass(frozen=True, slots=True)
class Counters:
    """One model's cumulative counters on one worker."""

    compute_s: float
    requests: int


@dataclass(slots=True)
class Traffic:
    """What is learned of one model."""

    cost_s: float | None = None  # compute seconds per request
    rates: dict[str, float] = field(default_factory=dict)  # worker -> requests per second


def learn(
    traffic: Mapping[str, Traffic],
    before: Mapping[tuple[str, str], Counters],
    now: Mapping[tuple[str, str], Counters],
    wall_s: float,
    halflife_s: float,
) -> dict[str, Traffic]:
    """`traffic` updated with the counters of each (worker, model) between two polls `wall_s`
    apart. A pair seen once, or whose counters went back (the worker restarted), only sets the
    baseline; a pair no longer reported is forgotten."""
    compute: dict[str, float] = {}
    requests: dict[str, int] = {}
    arrivals: dict[str, dict[str, float]] = {}
    for (worker, model), counters in now.items():
        old = before.get((worker, model))
        if old is None or counters.requests < old.requests or counters.compute_s < old.compute_s:
            continue
        compute[model] = compute.get(model, 0.0) + counters.compute_s - old.compute_s
        requests[model] = requests.get(model, 0) + counters.requests - old.requests
        arrivals.setdefault(model, {})[worker] = (
            (counters.requests - old.requests) / wall_s if wall_s > 0 else 0.0
        )
    fleet_s = sum(compute.values())
    learned: dict[str, Traffic] = {}
    for model in {m for _, m in now}:
        old_traffic = traffic.get(model, Traffic())
        cost = old_traffic.cost_s
        if requests.get(model):
            cost = ewma(cost, compute[model] / requests[model], fleet_s, halflife_s)
        rates = {
            worker: ewma(old_traffic.rates.get(worker), rate, fleet_s, halflife_s)
            for worker, rate in arrivals.get(model, {}).items()
        }
        kept = {w: r for w, r in old_traffic.rates.items() if (w, model) in now and w not in rates}
        learned[model] = Traffic(cost, {**kept, **rates})
    return learned


@dataclass(frozen=True, slots=True)
class WorkerLoads:
    """Per worker, the busy fraction each model keeps it at, and their sum: a model's weight
    needs what the *others* take, which is the sum less its own (not a walk over the worker's
    models per model, which at 10,000 models was 10^8 additions a round)."""

    by_model: Mapping[str, Mapping[str, float]]
    total: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", {w: sum(loads.values()) for w, loads in self.by_model.items()})

    def others(self, worker: str, model: str) -> float:
        """What the models other than `model` keep `worker` busy at."""
        return self.total.get(worker, 0.0) - self.by_model.get(worker, {}).get(model, 0.0)


def worker_loads(traffic: Mapping[str, Traffic]) -> WorkerLoads:
    """Per worker, the busy fraction each model keeps it at (rate x cost; 0 before a cost is known)."""
    loads: dict[str, dict[str, float]] = {}
    for model, learned in traffic.items():
        for worker, rate in learned.rates.items():
            loads.setdefault(worker, {})[model] = rate * (learned.cost_s or 0.0)
    return WorkerLoads(loads)


def endpoint_weights(model: str, workers: list[str], loads: WorkerLoads) -> dict[str, int]:
    """Each of `workers`' weight in `model`'s cluster: what the other models leave of it, out of
    `MAX_WEIGHT`, at least 1."""
    weights = {}
    for worker in workers:
        free = min(1.0, max(0.0, 1.0 - loads.others(worker, model)))
        weights[worker] = max(1, _STEP * round(MAX_WEIGHT * free / _STEP))
    return weights
