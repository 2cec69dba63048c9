"""The maths of least outstanding compute (`hloserve.fleet.balance`): costs and rates learned from
ModelControlStatus counters, each worker's load, and the endpoint weights Envoy balances with."""

from __future__ import annotations

import pytest

from hloserve.fleet.balance import (
    MAX_WEIGHT,
    Counters,
    Traffic,
    WorkerLoads,
    endpoint_weights,
    learn,
    worker_loads,
)


def test_cost_per_request_and_rates_come_from_the_counters_deltas() -> None:
    before = {
        ("w0", "big"): Counters(1.0, 10),
        ("w1", "big"): Counters(0.0, 0),
        ("w0", "tiny"): Counters(0.0, 0),
    }
    now = {
        ("w0", "big"): Counters(1.4, 14),
        ("w1", "big"): Counters(0.4, 4),
        ("w0", "tiny"): Counters(0.01, 10),
    }
    learned = learn({}, before, now, wall_s=2.0, halflife_s=10.0)
    assert learned["big"].cost_s == pytest.approx(0.1)  # 0.8 s over 8 requests, both workers
    assert learned["big"].rates == pytest.approx({"w0": 2.0, "w1": 2.0})
    assert learned["tiny"].cost_s == pytest.approx(0.001)
    assert learned["tiny"].rates == pytest.approx({"w0": 5.0})
    loads = worker_loads(learned)
    assert loads.by_model["w0"] == pytest.approx({"big": 0.2, "tiny": 0.005})
    assert loads.by_model["w1"] == pytest.approx({"big": 0.2})


def test_the_average_moves_by_fleet_compute_and_a_restart_only_rebaselines() -> None:
    old = {"m": Traffic(cost_s=1.0, rates={"w0": 4.0})}
    before = {("w0", "m"): Counters(10.0, 10)}
    # one half-life of fleet compute: halfway from the old values to the new sample
    now = {("w0", "m"): Counters(12.0, 14)}  # 2 s of compute over 4 requests, 4 s of wall time
    learned = learn(old, before, now, wall_s=4.0, halflife_s=2.0)
    assert learned["m"].cost_s == pytest.approx((1.0 + 0.5) / 2)
    assert learned["m"].rates["w0"] == pytest.approx((4.0 + 1.0) / 2)
    # no compute at all: nothing moves (the clock is fleet compute)
    assert learn(learned, now, now, 1.0, 2.0)["m"].rates["w0"] == pytest.approx(2.5)
    # the worker restarted: its counters went back; the old values stay until the next delta
    restarted = {("w0", "m"): Counters(0.5, 1)}
    assert learn(learned, now, restarted, 1.0, 2.0)["m"] == learned["m"]
    # a worker that no longer reports the model is forgotten
    assert "m" not in learn(learned, now, {}, 1.0, 2.0)


def test_a_worker_busy_with_other_models_weighs_less_in_a_models_cluster() -> None:
    loads = WorkerLoads({"w0": {"heavy": 0.5, "mlp": 0.3}, "w1": {"mlp": 0.3}, "w2": {"heavy": 2.0}})
    weights = endpoint_weights("mlp", ["w0", "w1", "w2"], loads)
    # mlp's own traffic is Envoy's to count; what the others leave of each worker is the weight
    assert weights == {"w0": MAX_WEIGHT // 2, "w1": MAX_WEIGHT, "w2": 1}
    # in the heavy model's own cluster the heavy model does not count against w0
    assert endpoint_weights("heavy", ["w0", "w2"], loads) == {"w0": 70, "w2": MAX_WEIGHT}
    # small differences round to the same step, so Envoy's clusters are not rewritten for noise
    assert endpoint_weights("x", ["a", "b"], WorkerLoads({"a": {"y": 0.101}, "b": {"y": 0.099}})) == {
        "a": 90,
        "b": 90,
    }
    assert endpoint_weights("x", ["a"], WorkerLoads({})) == {"a": MAX_WEIGHT}  # nothing learned yet: even


def test_a_models_weight_costs_the_same_however_many_models_its_worker_has() -> None:
    """The others' load is the worker's sum less the model's own, not a walk over its models:
    at 10,000 models a walk per model was 10^8 additions each round of the controller."""
    many = {f"m{i}": 0.00001 for i in range(10_000)}
    loads = WorkerLoads({"w0": {**many, "hot": 0.5}})
    assert loads.others("w0", "hot") == pytest.approx(0.1)
    assert loads.others("w0", "m7") == pytest.approx(0.59999)
    assert endpoint_weights("hot", ["w0"], loads) == {"w0": 90}
    assert endpoint_weights("m7", ["w0"], loads) == {"w0": 40}
    assert loads.others("w9", "m7") == 0.0  # a worker nothing is known of is free
