"""Admission: refuse at once a request that cannot meet its deadline, instead of queueing it.

Under overload a queued request that will miss its deadline costs what a served one costs and
holds a place that a request which could have made it needed; refusing it on arrival
(UNAVAILABLE, retryable) keeps the queue to what can finish in time.

The estimate, from running figures (O(1) per request, no scans):

- `rows`, per model: rows of its requests admitted and not yet answered (queued, executing, in
  a hook): the rows ahead of a new request;
- `seconds_per_row`, per model: how fast those rows drain, measured while a backlog stood: rows
  the dispatcher executed for the model (`executed`, its statistics' running count) over the
  wall-clock time, sampled every `SAMPLE_S` and `SAMPLE_BATCHES` batches while at least
  `backlog_rows` (a full batch) were ahead the whole time, so that the dispatcher, not the
  arrivals, set the pace. A measured drain rate includes everything that bounds it: the
  executions, the front end's CPU per request (for the MLP, about 25 times its execution), and
  the turns other models take under the scheduling discipline. Until a backlog was measured,
  and as a floor, the dispatcher's learned cost of a row in the model's largest batch stands
  in (`cost[largest] / largest`: a backlog runs full batches);
- `loop_lag`: how long the event loop takes to come back to a callback queued now (probed at
  most every `LAG_PROBE_S`). An overloaded front end has parsed requests waiting that long
  before their handler starts, where the gRPC deadline is read, and a reply waits about as
  long again to go out; neither shows in the queue.

A request with a deadline is refused when `2 * loop_lag + load_s + (rows ahead + its rows) *
seconds_per_row` is more than `fraction` of the time it has left (`server.admission_fraction`),
where `load_s` is the time the model's
weights take to load when they are not on the device (their bytes at the weight cache's
measured seconds per byte; 0 when they are there). One without a deadline is never refused
here (the queue's depth limit still applies).

Why a fraction: admitting whatever is predicted to finish just inside its deadline lets the
queue fill to a deadline's worth of work, so under overload every admitted request is answered
at its deadline, and the estimate's errors (a stall, a reply's wait to go out, the client's
own clock) make nearly all of them miss it: goodput falls to zero. With `fraction` < 1 the queue
holds at most that fraction of a deadline, and what is admitted is answered with room to spare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hloserve.errors import CannotMeetDeadline, DeadlineExceeded

__all__ = ["Admission", "Ticket"]

SAMPLE_S = 0.05
"""Least wall-clock time between two measurements of a model's drain rate..."""
SAMPLE_BATCHES = 4
"""...and least number of full batches executed in it, so that one stall (a collection, a
long execution of another model) moves the estimate only a little."""
LEARNING_RATE = 0.3
"""Weight of the newest measurement in `seconds_per_row`."""
LAG_PROBE_S = 0.01
"""Least time between two probes of the event loop's lag."""
LAG_FRESH_S = 0.1
"""A lag measured longer ago than this no longer counts (the loop was idle since)."""


@dataclass(slots=True)
class _Load:
    rows: int = 0
    seconds_per_row: float = 0.0
    """Measured; 0 until a backlog was."""
    sampled_at: float = 0.0
    sampled_executed: int = 0
    least_rows: int = 0
    """The fewest rows ahead since `sampled_at`."""
    costs: Mapping[int, float] | None = None
    """The dispatcher's costs `floor_s_per_row` was computed from (replaced, never mutated,
    after each execution, so identity tells a change)."""
    floor_s_per_row: float = 0.0


@dataclass(slots=True)
class Ticket:
    """One admitted request; hand it back to `Admission.release` when it is done."""

    model: str
    rows: int


class Admission:
    """The front end's admission figures; see the module docstring.

    `call_soon` queues a callback on the event loop the requests are handled on; `fraction` is
    the part of a request's time left that its predicted answer may take.
    """

    def __init__(self, call_soon: Callable[[Callable[..., Any], float], Any], fraction: float = 1.0) -> None:
        self._call_soon = call_soon
        self._fraction = fraction
        self._loads: dict[str, _Load] = {}
        self._probe_sent: float | None = None
        self._lag = 0.0
        self._lag_at = -LAG_FRESH_S

    def admit(
        self,
        model: str,
        rows: int,
        now: float,
        deadline: float | None,
        *,
        executed: int,
        costs: Mapping[int, float],
        backlog_rows: int,
        load_s: float = 0.0,
    ) -> Ticket:
        """Count a request of `rows` in, or raise `CannotMeetDeadline` (nothing counted), or
        `DeadlineExceeded` when its deadline has passed already (DEADLINE_EXCEEDED, as Triton).

        `executed` is the model's running count of executed rows, `costs` its learned seconds
        per execution by batch size, `backlog_rows` its largest batch, `load_s` what loading its
        weights would take now.
        """
        load = self._loads.get(model)
        if load is None:
            load = self._loads[model] = _Load(sampled_at=now, sampled_executed=executed)
        done = executed - load.sampled_executed
        if now - load.sampled_at >= SAMPLE_S and done >= SAMPLE_BATCHES * backlog_rows:
            if load.least_rows >= backlog_rows:
                measured = (now - load.sampled_at) / done
                old = load.seconds_per_row or measured
                load.seconds_per_row = LEARNING_RATE * measured + (1 - LEARNING_RATE) * old
            load.sampled_at, load.sampled_executed, load.least_rows = now, executed, load.rows
        ahead = load.rows
        if deadline is not None and deadline <= now:  # spent already (a budget of 1 ns): no retry helps
            raise DeadlineExceeded(model, now - deadline)
        if deadline is not None:
            per_row = max(load.seconds_per_row, _floor(load, costs))
            lag = self._loop_lag(now)
            expected = 2 * lag + load_s + (ahead + rows) * per_row
            if expected > self._fraction * (deadline - now):
                raise CannotMeetDeadline(model, expected, deadline - now, ahead, rows, per_row, lag, load_s)
        load.rows += rows
        return Ticket(model, rows)

    def release(self, ticket: Ticket) -> None:
        """Count a request out (answered, failed or abandoned)."""
        load = self._loads[ticket.model]
        load.rows -= ticket.rows
        load.least_rows = min(load.least_rows, load.rows)

    def _loop_lag(self, now: float) -> float:
        """The loop's current lag: at least as long as a probe has been out, else the last one
        measured while fresh; sends a probe when none is out and the last is old enough."""
        if self._probe_sent is not None:
            return max(self._lag if now - self._lag_at < LAG_FRESH_S else 0.0, now - self._probe_sent)
        if now - self._lag_at >= LAG_PROBE_S:
            self._probe_sent = now
            self._call_soon(self._probe_returned, now)
        return self._lag if now - self._lag_at < LAG_FRESH_S else 0.0

    def _probe_returned(self, sent: float) -> None:
        self._lag_at = time.monotonic()
        self._lag = self._lag_at - sent
        self._probe_sent = None


def _floor(load: _Load, costs: Mapping[int, float]) -> float:
    if costs is not load.costs:
        load.costs = costs
        largest = max(costs, default=0)
        load.floor_s_per_row = costs[largest] / max(largest, 1) if costs else 0.0
    return load.floor_s_per_row
