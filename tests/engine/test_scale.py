"""Per-decision costs that stay flat in the number of models (issue 36): the dispatcher's fair
share, the weight cache's LRU. Counted in operations at 100 and at 10,000 models, not timed."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.bundles import write_affine

from hloserve.actors.weight_cache import WeightCache, _Model
from hloserve.engine import policy
from hloserve.engine.policy import Candidate, ModelPolicy, Policies, PolicyParams, select
from hloserve.engine.statistics import Statistics
from hloserve.models.bundle import load_bundle

PARAMS = PolicyParams()


def _policies(models: int) -> dict[str, ModelPolicy]:
    return {
        f"m{i}": ModelPolicy(weight=1.0 + i % 3, ema=0.01 * (i % 7), ema_at=float(i % 5))
        for i in range(models)
    }


def _decays_per_decision(monkeypatch: pytest.MonkeyPatch, models: int) -> int:
    table = Policies(_policies(models), PARAMS.ema_halflife_s)
    calls = 0
    real = policy.decay

    def counted(ema: float, elapsed_s: float, halflife_s: float) -> float:
        nonlocal calls
        calls += 1
        value: float = real(ema, elapsed_s, halflife_s)
        return value

    monkeypatch.setattr(policy, "decay", counted)
    candidates = [Candidate("m1", 1, 1.0, None), Candidate("m2", 1, 2.0, None)]
    assert select("fair", candidates, table, 10.0, PARAMS) in {"m1", "m2"}
    return calls


def test_a_fair_decision_costs_the_same_at_100_and_10000_models(monkeypatch: pytest.MonkeyPatch) -> None:
    few, many = _decays_per_decision(monkeypatch, 100), _decays_per_decision(monkeypatch, 10_000)
    assert few == many <= 4  # per candidate, none per idle model


def test_the_kept_sums_pick_as_the_full_sums_do() -> None:
    plain = _policies(300)
    table = Policies(plain, PARAMS.ema_halflife_s)
    for i, now in ((5, 12.0), (17, 13.5), (5, 20.0)):
        policy.record_execution(plain[f"m{i}"], 1, 0.25, now, PARAMS)
        table.record(0.25, now)
    del plain["m9"], table["m9"]
    table["new"] = plain["new"] = ModelPolicy(weight=2.0, ema=0.5, ema_at=21.0)
    plain["m3"].weight = 4.0
    table.reweigh()
    now = 25.0
    full = sum(policy.decay(p.ema, now - p.ema_at, PARAMS.ema_halflife_s) for p in plain.values())
    assert math.isclose(table.recent(now), full, rel_tol=1e-9)
    assert table.total_weight == sum(p.weight for p in plain.values())
    for pair in (("m5", "m17"), ("m3", "new"), ("m0", "m1"), ("m17", "m3")):
        candidates = [Candidate(m, 1, 1.0, None) for m in pair]
        kept = select("fair", candidates, table, now, PARAMS)
        assert kept == select("fair", candidates, plain, now, PARAMS)


class _CountingLru(OrderedDict[str, None]):
    """An LRU order that counts the entries a walk over it visits."""

    visited = 0

    def __iter__(self) -> Iterator[str]:
        for name in super().__iter__():
            self.visited += 1
            yield name


def _visited_to_make_room(tmp_path: Path, models: int) -> int:
    """Entries of the LRU visited to make room for one model when a tenth are resident."""
    bundle = load_bundle(write_affine(tmp_path / "a"))
    nbytes = bundle.weight_nbytes
    resident = models // 10
    cache = WeightCache(Statistics(), budget_bytes=resident * nbytes, externally_managed=False)
    cache._models = {f"m{i}": _Model(bundle, "system", nbytes, None) for i in range(models)}
    cache._lru = _CountingLru()
    for i in range(resident):
        model = cache._models[f"m{i}"]
        cache._reserve(f"m{i}", model)
        model.device = []
    cache._lru.visited = 0
    assert cache._make_room(cache._models[f"m{models - 1}"], keep=frozenset({"m0"}))
    assert cache._models["m0"].device is not None and cache._models["m1"].device is None  # LRU, m0 kept
    visited: int = cache._lru.visited
    return visited


def test_making_room_in_the_weight_cache_visits_what_it_evicts(tmp_path: Path) -> None:
    few = _visited_to_make_room(tmp_path / "few", 100)
    assert few == _visited_to_make_room(tmp_path / "many", 10_000) <= 3
