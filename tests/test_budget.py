"""The weight budget formula, against upstream's test vectors (upstream.md §3.3)."""

from __future__ import annotations

import pytest

from hloserve.budget import WeightBudget, weight_budget


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
