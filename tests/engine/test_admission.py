"""The admission estimate without a server: rows ahead, the drain rate, the loop's lag."""

from __future__ import annotations

from typing import Any

import pytest

from hloserve.engine.admission import Admission
from hloserve.errors import CannotMeetDeadline, DeadlineExceeded

COSTS = {1: 0.001, 8: 0.004}  # 0.5 ms per row in a full batch of 8


class _Loop:
    """Keeps the callbacks queued on it, to run when the test says."""

    def __init__(self) -> None:
        self.queued: list[tuple[Any, float]] = []

    def call_soon(self, callback: Any, arg: float) -> None:
        self.queued.append((callback, arg))


def _admit(admission: Admission, rows: int, now: float, deadline: float | None, executed: int = 0) -> Any:
    return admission.admit("m", rows, now, deadline, executed=executed, costs=COSTS, backlog_rows=8)


def test_without_a_deadline_nothing_is_refused_and_rows_are_counted() -> None:
    admission = Admission(_Loop().call_soon)
    tickets = [_admit(admission, 500, 0.0, None) for _ in range(4)]
    assert admission._loads["m"].rows == 2000
    for ticket in tickets:
        admission.release(ticket)
    assert admission._loads["m"].rows == 0


def test_refused_when_the_rows_ahead_outlast_the_deadline_at_the_learned_cost() -> None:
    admission = Admission(_Loop().call_soon)
    _admit(admission, 999, 0.0, None)  # 1000 rows with the next one: 0.5 s at 0.5 ms per row
    with pytest.raises(CannotMeetDeadline, match=r"cannot meet its deadline.*999 rows ahead.*retry"):
        _admit(admission, 1, 0.0, 0.4)
    assert admission._loads["m"].rows == 999  # a refusal counts nothing
    _admit(admission, 1, 0.0, 0.6)
    assert admission._loads["m"].rows == 1000


def test_the_drain_rate_is_learned_only_while_a_backlog_stands() -> None:
    admission = Admission(_Loop().call_soon)
    _admit(admission, 400, 0.0, None)
    _admit(admission, 1, 0.1, None, executed=100)  # first window: backlog not yet known
    assert admission._loads["m"].seconds_per_row == 0.0
    _admit(admission, 1, 0.2, None, executed=150)  # 50 rows in 0.1 s with 400 ahead: 2 ms per row
    assert admission._loads["m"].seconds_per_row == pytest.approx(0.002)
    with pytest.raises(CannotMeetDeadline):  # 403 rows at 2 ms: 0.8 s
        _admit(admission, 1, 0.2, 0.9)


def test_a_lagging_loop_counts_twice_against_the_deadline() -> None:
    loop = _Loop()
    admission = Admission(loop.call_soon)
    _admit(admission, 1, 1.0, 2.0)  # sends a probe
    assert len(loop.queued) == 1
    with pytest.raises(CannotMeetDeadline, match=r"server 300\.0 ms behind"):
        _admit(admission, 1, 1.3, 1.8)  # the probe is 0.3 s out: 0.6 s more than the 0.5 s left
    _admit(admission, 1, 1.3, 2.0)


def test_a_cold_model_counts_its_load_against_the_deadline() -> None:
    admission = Admission(_Loop().call_soon)
    # 1 row at 0.5 ms, plus 300 ms to load its weights: 300.5 ms
    with pytest.raises(CannotMeetDeadline, match=r"300\.5 ms.*its weights 300\.0 ms to load.*retry"):
        admission.admit("m", 1, 0.0, 0.3, executed=0, costs=COSTS, backlog_rows=8, load_s=0.3)
    assert admission.admit("m", 1, 0.0, 0.31, executed=0, costs=COSTS, backlog_rows=8, load_s=0.3).rows == 1
    assert admission.admit("m", 1, 0.0, 0.3, executed=0, costs=COSTS, backlog_rows=8).rows == 1  # resident


def test_a_budget_already_spent_is_deadline_exceeded_not_a_refusal_to_retry() -> None:
    """A relative budget of 1 ns was UNAVAILABLE (retryable); it can never be met (issue 25)."""
    admission = Admission(_Loop().call_soon)
    with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed 1.000 ms before execution"):
        _admit(admission, 1, 1.0, 0.999)
    assert admission._loads["m"].rows == 0
    _admit(admission, 1, 1.0, 2.0)
    assert admission._loads["m"].rows == 1


def test_a_fraction_admits_only_what_is_answered_within_that_part_of_the_time_left() -> None:
    """At 0.5, 1000 rows ahead at 0.5 ms (0.5 s) need 1 s left, not 0.5 s: under overload the
    queue holds half a deadline of work, and what is admitted is answered with room to spare."""
    admission = Admission(_Loop().call_soon, fraction=0.5)
    _admit(admission, 999, 0.0, None)
    with pytest.raises(CannotMeetDeadline, match=r"about 500\.0 ms.*and 900\.0 ms are left"):
        _admit(admission, 1, 0.0, 0.9)  # would be admitted at a fraction of 1
    assert admission._loads["m"].rows == 999
    _admit(admission, 1, 0.0, 1.01)
    assert admission._loads["m"].rows == 1000
