"""The weight budget: the formula against ReactantServer.jl's published vectors, and sized at start.

One process: the budget is the engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from support.bundles import assert_affine_answers, write_affine
from support.servers import make_config, residency, start_worker

from hloserve.engine.budget import WeightBudget, scratch_of, weight_budget
from hloserve.models import _xla
from hloserve.models.bundle import load_bundle
from hloserve.models.compiled import compile_bundle


@pytest.mark.parametrize(
    ("fraction", "scratch", "pinned", "expected"),
    [
        (1.0, 0, 0, WeightBudget(900, 900, False)),
        (0.5, 0, 0, WeightBudget(500, 500, False)),
        (1.0, 300, 0, WeightBudget(600, 600, False)),
        (1.0, 300, 200, WeightBudget(600, 400, False)),
        (1.0, 0, 700, WeightBudget(900, 200, False)),
        (1.0, 300, 700, WeightBudget(600, 0, True)),
        (1.0, 950, 0, WeightBudget(0, 0, False)),
    ],
)
def test_upstream_vectors_with_an_arena_of_1000(
    fraction: float, scratch: int, pinned: int, expected: WeightBudget
) -> None:
    assert weight_budget(1000, fraction, 0.1, scratch, pinned) == expected


def test_an_empty_arena_has_no_budget() -> None:
    assert weight_budget(0, 1.0, 0.1, 0, 0) == WeightBudget(0, 0, False)


def test_scratch_is_each_peak_less_the_largest_weights_so_far() -> None:
    # peaks never fall: (100 B of weights, peak 500), (300, 600), (50, 650) -> 400, 300, 350
    assert scratch_of([(100, 500), (300, 600), (50, 650)]) == 400
    assert scratch_of([]) == 0


def _affine_repository(path: Path) -> int:
    """Three 60-byte models; returns the largest scratch their executables' memory analysis gives."""
    for name in "abc":
        write_affine(path / name)
    return max(compile_bundle(load_bundle(path / name), None).scratch_bytes for name in "abc")


def test_on_cpu_a_configured_arena_sizes_the_budget_and_the_cache_evicts(tmp_path: Path) -> None:
    scratch = _affine_repository(tmp_path)
    arena = int((scratch + 130) / 0.9) + 1  # room for two 60-byte models beside the scratch
    expected = weight_budget(arena, 1.0, 0.1, scratch, 0).on_demand
    assert 120 <= expected < 180
    with start_worker(make_config(tmp_path).replace("weights", arena_bytes=arena)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert server.worker.weight_budget == expected
        for name in "abcab":
            assert_affine_answers(client, name)
        resident = [name for name, (on_device, _, _) in residency(server).items() if on_device]
        assert resident == ["a", "b"]  # c was evicted least-recently used
        client.close()


def test_on_a_gpu_the_allocator_limit_and_peaks_size_the_budget(tmp_path: Path, monkeypatch: Any) -> None:
    _affine_repository(tmp_path)
    # A stand-in for a GPU allocator's statistics (none exist on this machine's CPU backend).
    stats = {"bytes_limit": 10_000, "peak_bytes_in_use": 2_000, "bytes_in_use": 0}
    monkeypatch.setattr(_xla, "memory_stats", lambda: dict(stats))
    with start_worker(make_config(tmp_path)) as server:  # scratch = 2000 peak - 60 bytes of weights;
        # pool = min(10000, 9000 - 1940)
        assert server.worker.weight_budget == weight_budget(10_000, 1.0, 0.1, 1_940, 0).on_demand == 7_060
    with start_worker(make_config(tmp_path).replace("weights", fraction=0.0)) as off:
        assert off.worker.weight_budget is None
