"""lpt_packing's maths as pure functions: the order, the score, memory, replicas, hysteresis."""

from __future__ import annotations

import pytest

from hloserve.fleet.controller import changed_workers
from hloserve.fleet.placement import Demand, assign, ewma, replica_count

WORKERS = ["w0", "w1"]


def test_a_skewed_load_goes_to_separate_workers() -> None:
    demands = {
        "hot": Demand(0.8, 100),
        "warm": Demand(0.7, 100),
        "a": Demand(0.05, 10),
        "b": Demand(0.05, 10),
    }
    plan = assign(demands, WORKERS, {}, {})
    assert plan.workers["hot"] != plan.workers["warm"]
    assert plan.workers["hot"] == ("w0",)  # largest first, ties to the first worker in order
    # the light models fill the worker that is less busy after the two big ones
    assert plan.workers["a"] == ("w1",) and plan.workers["b"] == ("w1",)
    assert plan.compute == pytest.approx({"w0": 0.8, "w1": 0.8})


def test_models_without_traffic_are_packed_by_memory() -> None:
    demands = {m: Demand(0.0, 600) for m in ("a", "b", "c")}
    plan = assign(demands, WORKERS, {"w0": 1000, "w1": 1000}, {})
    assert plan.workers == {"a": ("w0",), "b": ("w1",), "c": ("w0",)}
    assert plan.oversubscribed({"w0": 1000, "w1": 1000}) == ["w0"]


def test_without_budgets_or_traffic_models_still_spread_over_the_workers() -> None:
    demands = {"a": Demand(0.0, 300), "b": Demand(0.0, 200), "c": Demand(0.0, 100), "d": Demand(0.0, 0)}
    plan = assign(demands, WORKERS, {}, {})
    assert plan.workers == {"a": ("w0",), "b": ("w1",), "c": ("w1",), "d": ("w0",)}
    assert plan.memory == {"w0": 300, "w1": 300}


def test_only_workers_whose_budget_fits_are_candidates() -> None:
    # busy goes to w0, big (900 of w1's 1000 bytes) to w1; new fits only on the busy w0...
    demands = {"busy": Demand(1.5, 10), "big": Demand(0.2, 900), "new": Demand(0.1, 200)}
    budgets = {"w0": 1000, "w1": 1000}
    plan = assign(demands, WORKERS, budgets, {})
    assert (plan.workers["busy"], plan.workers["big"], plan.workers["new"]) == (("w0",), ("w1",), ("w0",))
    assert plan.oversubscribed(budgets) == []
    # ...and, allowed to oversubscribe, goes by score alone: w1 at 1100/1000 beats w0 at 1.6
    plan = assign(demands, WORKERS, budgets, {}, forbid_memory_oversubscription=False)
    assert plan.workers["new"] == ("w1",) and plan.oversubscribed(budgets) == ["w1"]


def test_replicas_take_the_best_workers_charging_each_a_share_of_load_and_all_bytes() -> None:
    demands = {"m": Demand(0.6, 100, replicas=2), "n": Demand(0.2, 50, replicas=-1)}
    plan = assign(demands, ["w0", "w1", "w2"], {}, {})
    assert plan.workers["m"] == ("w0", "w1")
    assert plan.workers["n"] == ("w0", "w1", "w2")
    assert plan.memory == {"w0": 150, "w1": 150, "w2": 50}
    assert plan.compute["w0"] == pytest.approx(0.3 + 0.2 / 3)


@pytest.mark.parametrize(
    ("replicas", "default", "expected"), [(0, 1, 1), (0, -1, 3), (2, 1, 2), (7, 1, 3), (-1, 1, 3), (0, 2, 2)]
)
def test_replica_count(replicas: int, default: int, expected: int) -> None:
    assert replica_count(replicas, default, 3) == expected


def test_hysteresis_keeps_a_model_unless_another_worker_is_better_by_more_than_it() -> None:
    demands = {"big": Demand(0.5, 0), "m": Demand(0.3, 0)}
    fresh = assign(demands, WORKERS, {}, {"big": ["w0"]})
    assert fresh.workers["m"] == ("w1",)
    previous = {"big": ["w0"], "m": ["w0"]}
    # w0 would score 0.8, w1 0.3: kept only if 0.8 <= 0.3 * (1 + h)
    moved = assign(demands, WORKERS, {}, previous, hysteresis=0.5)
    assert moved.workers["m"] == ("w1",) and moved.moved == 1 and moved.held_by_hysteresis == 0
    # a close call is held: m at 0.3 on w1 against 0.35 on w0 (big is small now)
    close = {"big": Demand(0.05, 0), "m": Demand(0.3, 0)}
    held = assign(close, WORKERS, {}, {"big": ["w0"], "m": ["w1"]}, hysteresis=0.2)
    assert held.workers["m"] == ("w1",) and held.held_by_hysteresis == 1 and held.moved == 0


def test_a_stable_load_keeps_a_stable_placement() -> None:
    demands = {f"m{i}": Demand(0.1 * (i % 4), 100 * i) for i in range(9)}
    budgets = {"w0": 3000, "w1": 3000, "w2": 3000}
    first = assign(demands, sorted(budgets), budgets, {})
    again = assign(demands, sorted(budgets), budgets, first.workers, hysteresis=0.1)
    assert again.workers == first.workers and again.moved == 0
    # a little noise in the measured load moves nothing under hysteresis
    noisy = {m: Demand(d.utilization * 1.04, d.weight_nbytes) for m, d in demands.items()}
    assert assign(noisy, sorted(budgets), budgets, first.workers, hysteresis=0.1).moved == 0


def test_ewma() -> None:
    assert ewma(None, 5.0, 1.0, 10.0) == 5.0  # the first sample is taken as is
    assert ewma(0.0, 1.0, 10.0, 10.0) == pytest.approx(0.5)  # one half-life: halfway
    assert ewma(0.0, 1.0, 0.0, 10.0) == 0.0  # no compute passed: nothing learned


def test_changed_workers_are_those_a_model_moved_on_to_or_off() -> None:
    before = {"a": ["w0"], "b": ["w1"], "c": ["w2"]}
    after = {"a": ["w1"], "b": ["w1"], "c": ["w2"]}
    assert changed_workers(before, after) == {"w0", "w1"}
    assert changed_workers(after, after) == set()
