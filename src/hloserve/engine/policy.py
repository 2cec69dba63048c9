"""The scheduler's decisions as pure functions: which requests to batch, which model runs next.

The actors hold the state; these functions only compute from it, so every rule is tested
against ReactantServer.jl's worked examples without a server.

Coalescing (`plan_batch`): the leading run of requests with the same shape variant; the
largest compiled size not above the queued rows (the smallest when there are fewer rows than
that); grown to fit the front request; then requests taken in order while they fit. Beyond
upstream, a front request larger than the largest compiled size is split across executions
(`split_rows`), one per turn of the dispatcher, instead of refused. Fair share
(`fair_priority`): a model's share of the weights minus its share of recent compute (an
exponentially decayed sum, `decay`), clamped, divided by the cost of the batch it would run,
learned per batch size (`learn_cost`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from hloserve.types import Discipline

__all__ = [
    "MIN_COST_S",
    "BatchPlan",
    "Candidate",
    "ModelPolicy",
    "Pending",
    "Policies",
    "PolicyParams",
    "decay",
    "drop_reason",
    "fair_priority",
    "learn_cost",
    "plan_batch",
    "queue_delay",
    "record_execution",
    "select",
    "split_rows",
]

MIN_COST_S = 1e-9
"""The least a batch is taken to cost, whatever was measured."""


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """The dispatch loop's constants (config section `scheduler`)."""

    ema_halflife_s: float = 30.0
    recency_penalty_cap: float = 0.25
    coalescing_discount: float = 0.10
    cost_ema_alpha: float = 0.2
    default_cost_s: float = 0.01
    """Assumed cost of a batch size never measured (warm-up measures every size at start)."""


@dataclass(frozen=True, slots=True)
class Pending:
    """What planning needs to know of one queued request."""

    rows: int
    enqueued_at: float = 0.0
    deadline: float | None = None
    variant: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchPlan:
    batch_size: int
    """The compiled size to execute (for a split, the size of the first chunk)."""
    take: int
    """How many requests, from the front, go into this execution."""
    rows: int
    """Real rows taken; the rest of `batch_size` is zero padding."""
    chunks: tuple[tuple[int, int], ...] = ()
    """For a split request: (rows, compiled size) per execution; empty otherwise."""


def split_rows(rows: int, sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Cover `rows` with executions: full largest-size chunks, then the rest padded up."""
    largest = max(sizes)
    chunks = [(largest, largest)] * (rows // largest)
    rest = rows % largest
    if rest:
        chunks.append((rest, min(s for s in sizes if s >= rest)))
    return tuple(chunks)


def plan_batch(
    queue: Sequence[Pending], sizes: Sequence[int], *, coalescable: bool, cap: int | None = None
) -> BatchPlan | None:
    """The next execution for a model's queue (None when it is empty); see the module docstring.

    `sizes` are the compiled batch sizes (`(0,)` for a single unbatched module); `cap` is the
    model's `max_batch_size` setting, limiting how many rows are joined.
    """
    if not queue:
        return None
    front = queue[0]
    ordered = sorted(sizes)
    smallest, largest = ordered[0], ordered[-1]
    if not coalescable:
        if 0 in ordered:
            return BatchPlan(0, 1, front.rows)
        return BatchPlan(next((s for s in ordered if s >= front.rows), largest), 1, front.rows)
    if front.rows > largest:
        chunks = split_rows(front.rows, ordered)
        return BatchPlan(chunks[0][1], 1, front.rows, chunks)
    limit = largest if cap is None else min(cap, largest)
    window = 0
    for pending in queue:
        if pending.variant != front.variant:
            break
        window += pending.rows
    rows = min(window, limit)
    batch = max((s for s in ordered if s <= rows), default=smallest)
    if front.rows > batch:
        batch = next((s for s in ordered if s >= front.rows), largest)
    fill = batch if cap is None else min(batch, cap)
    take, taken = 0, 0
    for pending in queue:
        if pending.variant != front.variant or taken + pending.rows > fill:
            break
        take, taken = take + 1, taken + pending.rows
    if take == 0:  # nothing fits under the cap: the front alone, for progress
        take, taken = 1, front.rows
    return BatchPlan(batch, take, taken)


def queue_delay(rows: int, sizes: Sequence[int], waited_s: float, max_delay_s: float) -> float:
    """Seconds to hold a batch for more rows (Triton's max_queue_delay); 0 = go now.

    Holds while fewer rows are queued than the largest compiled size and the oldest request has
    waited less than `max_delay_s`, as Triton's dynamic batcher fills its max batch size.
    """
    if max_delay_s <= 0 or rows >= max(sizes):
        return 0.0
    return max(0.0, max_delay_s - waited_s)


def decay(ema: float, elapsed_s: float, halflife_s: float) -> float:
    """An exponentially decayed sum of compute seconds, `elapsed_s` later."""
    return ema * math.exp(-max(0.0, elapsed_s) * math.log(2) / halflife_s)


def fair_priority(
    share: float, recent_share: float, cost_s: float, params: PolicyParams = PolicyParams()
) -> float:
    """How much a model is owed, per second of the batch it would run; higher runs first."""
    cap = params.recency_penalty_cap
    deficit = min(cap, max(-cap, share - recent_share))
    return deficit / (cost_s * (1 - params.coalescing_discount))


@dataclass(slots=True)
class ModelPolicy:
    """The dispatcher's per-model scheduling state."""

    weight: float = 1.0
    ema: float = 0.0
    """Recent compute seconds, decayed to `ema_at`."""
    ema_at: float = 0.0
    cost: dict[int, float] = field(default_factory=dict)
    """Learned seconds per execution, by batch size."""
    discipline: Discipline | None = None
    """Overrides the global discipline for this model's own queue (edf: laxity drops)."""
    latency_budget_s: float | None = None
    charged_load_s: float = 0.0
    """The model's weight-load seconds already charged to `ema` (its statistics count them)."""

    def expected_cost(self, batch_size: int, params: PolicyParams = PolicyParams()) -> float:
        """The learned seconds of a batch; never zero (a clock can read two equal times), so
        that priorities stay finite, as upstream seeds `max(elapsed, eps)`."""
        return max(self.cost.get(batch_size, params.default_cost_s), MIN_COST_S)


def learn_cost(
    cost: dict[int, float], batch_size: int, seconds: float, params: PolicyParams = PolicyParams()
) -> None:
    """Blend a measured execution into the batch size's entry of `cost` (the first one seeds it)."""
    old = cost.get(batch_size, seconds)
    cost[batch_size] = params.cost_ema_alpha * seconds + (1 - params.cost_ema_alpha) * old


def record_execution(
    policy: ModelPolicy, batch_size: int, seconds: float, now: float, params: PolicyParams = PolicyParams()
) -> None:
    """After an execution: recent compute decays to now and grows by it; the cost is learned."""
    policy.ema = decay(policy.ema, now - policy.ema_at, params.ema_halflife_s) + seconds
    policy.ema_at = now
    learn_cost(policy.cost, batch_size, seconds, params)


def charge(policy: ModelPolicy, seconds: float, now: float, params: PolicyParams = PolicyParams()) -> None:
    """Charge a load of the model's weights to its recent compute (it caused the load), without
    touching its learned cost: a model that keeps being evicted pays for its reloads in fair share."""
    policy.ema = decay(policy.ema, now - policy.ema_at, params.ema_halflife_s) + seconds
    policy.ema_at = now


class Policies(MutableMapping[str, ModelPolicy]):
    """Every model's policy, with the sums fair share divides by kept up to date, so that a
    decision costs the same with ten models or ten thousand: the total weight, and the total
    recent compute (every model's decays at one rate, so the sum decays as each part does).

    Adding a model or recording compute (`record`) is O(1); removing one or changing a weight
    (`reweigh`) sums afresh, O(models), which also clears any rounding the increments gathered.
    """

    def __init__(self, policies: Mapping[str, ModelPolicy] | None = None, halflife_s: float = 30.0) -> None:
        self._policies: dict[str, ModelPolicy] = {}
        self._halflife_s = halflife_s
        self.total_weight = 0.0
        self._recent = 0.0
        self._recent_at = 0.0
        for name, policy in (policies or {}).items():
            self[name] = policy

    def __getitem__(self, model: str) -> ModelPolicy:
        return self._policies[model]

    def __setitem__(self, model: str, policy: ModelPolicy) -> None:
        if model in self._policies:
            del self[model]
        self._policies[model] = policy
        self.total_weight += policy.weight
        at = max(self._recent_at, policy.ema_at)
        self._recent = self._decayed(self._recent, self._recent_at, at) + self._decayed(
            policy.ema, policy.ema_at, at
        )
        self._recent_at = at

    def __delitem__(self, model: str) -> None:
        del self._policies[model]
        self.reweigh()

    def __iter__(self) -> Iterator[str]:
        return iter(self._policies)

    def __len__(self) -> int:
        return len(self._policies)

    def __contains__(self, model: object) -> bool:
        return model in self._policies

    def _decayed(self, value: float, at: float, now: float) -> float:
        return decay(value, now - at, self._halflife_s)

    def record(self, seconds: float, now: float) -> None:
        """A model's recent compute grew by `seconds` at `now` (`record_execution`, `charge`)."""
        self._recent = self._decayed(self._recent, self._recent_at, now) + seconds
        self._recent_at = max(self._recent_at, now)

    def recent(self, now: float) -> float:
        """Every model's recent compute seconds, decayed to `now`."""
        return self._decayed(self._recent, self._recent_at, now)

    def reweigh(self) -> None:
        """Sum the weights and the recent compute afresh (after a weight changed, a removal)."""
        self.total_weight = sum(p.weight for p in self._policies.values())
        at = max((p.ema_at for p in self._policies.values()), default=0.0)
        self._recent = sum(self._decayed(p.ema, p.ema_at, at) for p in self._policies.values())
        self._recent_at = at


@dataclass(frozen=True, slots=True)
class Candidate:
    """A model with a batch ready to run, as the dispatcher sees it."""

    model: str
    batch_size: int
    front_enqueued_at: float
    earliest_deadline: float | None
    load_s: float = 0.0
    """Seconds its weights take to load before it can run (0 when they are on the device)."""


def _urgent_at(candidate: Candidate, policy: ModelPolicy, params: PolicyParams) -> float:
    """When the model's oldest request stops meeting its latency budget if not started."""
    if policy.latency_budget_s is None:
        return math.inf
    return (
        candidate.front_enqueued_at
        + policy.latency_budget_s
        - policy.expected_cost(candidate.batch_size, params)
        - candidate.load_s
    )


def select(
    discipline: Discipline,
    candidates: Iterable[Candidate],
    policies: Mapping[str, ModelPolicy],
    now: float,
    params: PolicyParams = PolicyParams(),
) -> str | None:
    """The model to run next.

    Models whose oldest request is about to miss its latency budget go first (soonest first).
    Otherwise: `fifo` takes the oldest front request; `edf` the earliest deadline less the
    model's load time, when to start its load at the latest (none counts as latest); `fair` the
    highest `fair_priority`, with shares and recent compute summed over every model, idle ones
    included. Ties go to the older front request, then the smaller name.
    """
    ready = list(candidates)
    if len(ready) <= 1:  # every discipline picks a lone candidate (the common case): skip the maths
        return ready[0].model if ready else None
    urgent = [(u, c) for c in ready if (u := _urgent_at(c, policies[c.model], params)) <= now]
    if urgent:
        return min(urgent, key=lambda uc: (uc[0], uc[1].front_enqueued_at, uc[1].model))[1].model
    if discipline == "fifo":
        return min(ready, key=lambda c: (c.front_enqueued_at, c.model)).model
    if discipline == "edf":
        return min(
            ready,
            key=lambda c: (
                math.inf if c.earliest_deadline is None else c.earliest_deadline - c.load_s,
                c.front_enqueued_at,
                c.model,
            ),
        ).model
    if isinstance(policies, Policies):  # the dispatcher's: sums kept, O(candidates)
        total_weight, total_recent = policies.total_weight, policies.recent(now)
    else:
        total_weight = sum(p.weight for p in policies.values())
        total_recent = sum(decay(p.ema, now - p.ema_at, params.ema_halflife_s) for p in policies.values())

    def priority(c: Candidate) -> float:
        policy = policies[c.model]
        share = policy.weight / total_weight
        recent = decay(policy.ema, now - policy.ema_at, params.ema_halflife_s)
        recent_share = recent / total_recent if total_recent else 0.0
        return fair_priority(share, recent_share, policy.expected_cost(c.batch_size, params), params)

    return min(ready, key=lambda c: (-priority(c), c.front_enqueued_at, c.model)).model


def drop_reason(pending: Pending, now: float, *, edf: bool, expected_cost_s: float) -> str | None:
    """Why a request must not run: 'deadline' when its deadline has passed (under edf, when it
    cannot finish in its expected cost), else None."""
    if pending.deadline is None:
        return None
    margin = expected_cost_s if edf else 0.0
    return "deadline" if now + margin >= pending.deadline else None
