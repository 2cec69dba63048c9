"""The scheduler's pure decisions, checked against ReactantServer.jl's worked examples."""

from __future__ import annotations

import math

import pytest

from hloserve.engine.policy import (
    MIN_COST_S,
    BatchPlan,
    Candidate,
    ModelPolicy,
    Pending,
    PolicyParams,
    charge,
    decay,
    drop_reason,
    fair_priority,
    learn_cost,
    plan_batch,
    queue_delay,
    record_execution,
    select,
    split_rows,
)


def rows(*counts: int, variant: tuple[int, ...] = ()) -> list[Pending]:
    return [Pending(r, enqueued_at=i, variant=variant) for i, r in enumerate(counts)]


class TestPlanBatch:
    """upstream §2.4, every listed case, then the split and variant cases."""

    def test_two_two_two_with_sizes_1_4_8_runs_4_taking_2(self) -> None:
        assert plan_batch(rows(2, 2, 2), [1, 4, 8], coalescable=True) == BatchPlan(4, 2, 4)

    def test_one_row_with_sizes_4_8_is_padded_to_4(self) -> None:
        assert plan_batch(rows(1), [4, 8], coalescable=True) == BatchPlan(4, 1, 1)

    def test_six_and_one_with_sizes_1_4_8_runs_8_taking_both(self) -> None:
        assert plan_batch(rows(6, 1), [1, 4, 8], coalescable=True) == BatchPlan(8, 2, 7)

    def test_cap_4_with_four_two_row_requests_runs_4_taking_2(self) -> None:
        assert plan_batch(rows(2, 2, 2, 2), [1, 4, 8], coalescable=True, cap=4) == BatchPlan(4, 2, 4)

    def test_cap_2_with_sizes_4_8_runs_4_taking_2(self) -> None:
        assert plan_batch(rows(1, 1, 1), [4, 8], coalescable=True, cap=2) == BatchPlan(4, 2, 2)

    def test_six_row_front_with_cap_2_runs_8_taking_only_the_front(self) -> None:
        assert plan_batch(rows(6, 1), [4, 8], coalescable=True, cap=2) == BatchPlan(8, 1, 6)

    def test_only_the_leading_run_of_one_variant_coalesces(self) -> None:
        queue = [*rows(1, 1, variant=(32,)), *rows(1, variant=(64,)), *rows(1, variant=(32,))]
        assert plan_batch(queue, [1, 2, 4], coalescable=True) == BatchPlan(2, 2, 2)

    def test_a_model_that_cannot_coalesce_takes_exactly_one(self) -> None:
        assert plan_batch(rows(2, 2), [1, 4, 8], coalescable=False) == BatchPlan(4, 1, 2)
        assert plan_batch(rows(1, 1), [0], coalescable=False) == BatchPlan(0, 1, 1)
        assert plan_batch(rows(9), [1, 4, 8], coalescable=False) == BatchPlan(8, 1, 9)

    def test_exact_fill_takes_everything_that_fits(self) -> None:
        assert plan_batch(rows(1, 1, 1, 1, 1), [1, 4, 8, 16], coalescable=True) == BatchPlan(4, 4, 4)
        assert plan_batch(rows(*[1] * 20), [1, 4, 8, 16], coalescable=True) == BatchPlan(16, 16, 16)

    def test_empty_queue(self) -> None:
        assert plan_batch([], [1, 4], coalescable=True) is None

    def test_a_request_larger_than_every_size_is_split(self) -> None:
        plan = plan_batch(rows(37, 1), [1, 4, 8, 16], coalescable=True)
        assert plan == BatchPlan(16, 1, 37, ((16, 16), (16, 16), (5, 8)))
        assert split_rows(32, [1, 4, 8, 16]) == ((16, 16), (16, 16))
        assert split_rows(17, [4, 16]) == ((16, 16), (1, 4))


class TestQueueDelay:
    def test_waits_for_more_rows_until_full_or_the_delay_ends(self) -> None:
        sizes = [1, 4, 8, 16]
        assert queue_delay(3, sizes, waited_s=0.0002, max_delay_s=0.001) == pytest.approx(0.0008)
        assert queue_delay(1, sizes, waited_s=0.0, max_delay_s=0.001) == pytest.approx(0.001)
        assert queue_delay(3, sizes, waited_s=0.002, max_delay_s=0.001) == 0.0
        assert queue_delay(16, sizes, waited_s=0.0, max_delay_s=0.001) == 0.0  # full: go
        assert queue_delay(20, sizes, waited_s=0.0, max_delay_s=0.001) == 0.0
        assert queue_delay(3, sizes, waited_s=0.0, max_delay_s=0.0) == 0.0  # off


class TestFairShare:
    def test_upstream_worked_example(self) -> None:
        """Shares 1/3; recent compute .7/.2/.1; costs 10/30/100: B wins."""
        params = PolicyParams()
        priorities = [fair_priority(1 / 3, e, c, params) for e, c in ((0.7, 10), (0.2, 30), (0.1, 100))]
        assert priorities == pytest.approx([-0.0278, 0.00493, 0.00259], abs=1e-4)
        policies = {
            "A": ModelPolicy(ema=0.7, cost={1: 10}),
            "B": ModelPolicy(ema=0.2, cost={1: 30}),
            "C": ModelPolicy(ema=0.1, cost={1: 100}),
        }
        candidates = [Candidate(m, 1, 0.0, None) for m in "ABC"]
        assert select("fair", candidates, policies, now=0.0) == "B"

    def test_penalty_is_clamped(self) -> None:
        assert fair_priority(1 / 3, 0.7, 1 / 0.9) == pytest.approx(-0.25)

    def test_idle_models_count_in_the_totals(self) -> None:
        policies = {
            "A": ModelPolicy(weight=1, ema=1.0),
            "B": ModelPolicy(weight=1),
            "idle": ModelPolicy(weight=2),
        }
        candidates = [Candidate("A", 1, 0.0, None), Candidate("B", 1, 1.0, None)]
        # B: share 1/4 - 0 > A: 1/4 - 1
        assert select("fair", candidates, policies, now=0.0) == "B"

    def test_ties_go_to_the_older_front_then_the_name(self) -> None:
        policies = {"a": ModelPolicy(), "b": ModelPolicy()}
        assert (
            select("fair", [Candidate("b", 1, 1.0, None), Candidate("a", 1, 2.0, None)], policies, 0.0) == "b"
        )
        assert (
            select("fair", [Candidate("b", 1, 1.0, None), Candidate("a", 1, 1.0, None)], policies, 0.0) == "a"
        )

    def test_decay_halves_in_a_halflife(self) -> None:
        assert decay(8.0, 30.0, 30.0) == pytest.approx(4.0)
        assert decay(8.0, 0.0, 30.0) == 8.0

    def test_record_execution_decays_then_adds_and_learns_the_cost(self) -> None:
        policy = ModelPolicy(ema=2.0, ema_at=0.0)
        record_execution(policy, 4, 0.5, now=30.0)
        assert policy.ema == pytest.approx(1.5) and policy.ema_at == 30.0
        assert policy.cost == {4: 0.5}  # the first measurement seeds it
        learn_cost(policy.cost, 4, 1.0)
        assert policy.cost[4] == pytest.approx(0.2 * 1.0 + 0.8 * 0.5)
        assert policy.expected_cost(8) == PolicyParams().default_cost_s

    def test_a_zero_measured_cost_keeps_priorities_finite(self) -> None:
        # A clock can read the same time before and after a tiny execution.
        policies = {"instant": ModelPolicy(cost={1: 0.0}), "other": ModelPolicy(ema=1.0, cost={1: 0.001})}
        assert policies["instant"].expected_cost(1) == MIN_COST_S
        candidates = [Candidate("other", 1, 0.0, None), Candidate("instant", 1, 1.0, None)]
        assert select("fair", candidates, policies, now=0.0) == "instant"

    def test_a_load_is_charged_to_recent_compute_not_to_the_cost(self) -> None:
        policy = ModelPolicy(ema=2.0, ema_at=0.0, cost={1: 0.01})
        charge(policy, 0.5, now=30.0)
        assert policy.ema == pytest.approx(1.5) and policy.ema_at == 30.0
        assert policy.cost == {1: 0.01}

    def test_a_model_that_keeps_loading_yields_its_turn(self) -> None:
        """Equal weights and costs: the one whose loads were charged has used its share."""
        policies = {"cold": ModelPolicy(cost={1: 0.01}), "warm": ModelPolicy(cost={1: 0.01})}
        record_execution(policies["cold"], 1, 0.01, now=0.0)
        record_execution(policies["warm"], 1, 0.01, now=0.0)
        candidates = [Candidate("cold", 1, 0.0, None), Candidate("warm", 1, 1.0, None)]
        assert select("fair", candidates, policies, now=0.0) == "cold"  # a tie: the older front
        charge(policies["cold"], 0.2, now=0.0)
        assert select("fair", candidates, policies, now=0.0) == "warm"


class TestFifoAndEdf:
    def test_fifo_ignores_weights(self) -> None:
        policies = {"a": ModelPolicy(weight=100), "b": ModelPolicy()}
        assert (
            select("fifo", [Candidate("a", 1, 2.0, None), Candidate("b", 1, 1.0, None)], policies, 3.0) == "b"
        )
        assert (
            select("fifo", [Candidate("b", 1, 1.0, None), Candidate("a", 1, 1.0, None)], policies, 3.0) == "a"
        )

    def test_edf_takes_the_earliest_deadline_and_none_is_least_urgent(self) -> None:
        policies = {m: ModelPolicy() for m in "abc"}
        candidates = [Candidate("a", 1, 0.0, None), Candidate("b", 1, 1.0, 9.0), Candidate("c", 1, 2.0, 5.0)]
        assert select("edf", candidates, policies, 0.0) == "c"
        assert (
            select("edf", [Candidate("a", 1, 1.0, None), Candidate("b", 1, 0.0, None)], policies, 0.0) == "b"
        )

    def test_edf_starts_the_load_of_a_cold_model_in_time(self) -> None:
        """Deadline less load time: a cold model due at 12 s that takes 5 s to load goes before a
        resident one due at 10 s."""
        policies = {m: ModelPolicy() for m in "cw"}
        candidates = [Candidate("w", 1, 0.0, 10.0), Candidate("c", 1, 1.0, 12.0, load_s=5.0)]
        assert select("edf", candidates, policies, 0.0) == "c"
        candidates[1] = Candidate("c", 1, 1.0, 12.0, load_s=1.0)
        assert select("edf", candidates, policies, 0.0) == "w"

    def test_a_latency_budget_counts_the_load(self) -> None:
        policies = {"slow": ModelPolicy(), "budget": ModelPolicy(latency_budget_s=0.010, cost={1: 0.002})}
        warm = [Candidate("slow", 1, 0.0, None), Candidate("budget", 1, 1.0, None)]
        cold = [Candidate("slow", 1, 0.0, None), Candidate("budget", 1, 1.0, None, load_s=0.005)]
        assert select("fifo", warm, policies, now=1.004) == "slow"
        assert select("fifo", cold, policies, now=1.004) == "budget"  # 6 ms left, 2 to run + 5 to load

    def test_an_endangered_latency_budget_goes_first(self) -> None:
        policies = {
            "slow": ModelPolicy(weight=10),
            "budget": ModelPolicy(latency_budget_s=0.010, cost={1: 0.002}),
        }
        candidates = [Candidate("slow", 1, 0.0, None), Candidate("budget", 1, 1.0, None)]
        assert select("fifo", candidates, policies, now=1.005) == "slow"  # 5 ms left: fine
        assert select("fifo", candidates, policies, now=1.009) == "budget"  # 1 ms left, costs 2


class TestDrops:
    def test_deadline_passed(self) -> None:
        assert drop_reason(Pending(1, deadline=1.0), 1.0, edf=False, expected_cost_s=0.5) == "deadline"
        assert drop_reason(Pending(1, deadline=1.0), 0.9, edf=False, expected_cost_s=0.5) is None
        assert drop_reason(Pending(1), math.inf, edf=True, expected_cost_s=0.5) is None

    def test_edf_drops_what_cannot_finish_in_its_cost(self) -> None:
        assert drop_reason(Pending(1, deadline=1.0), 0.6, edf=True, expected_cost_s=0.5) == "deadline"
        assert drop_reason(Pending(1, deadline=1.0), 0.4, edf=True, expected_cost_s=0.5) is None
