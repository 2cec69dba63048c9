"""Comparing computed tensors the way a client may rely on them.

XLA:CPU generates different code on different CPUs, and a request joined into another compiled
batch size runs another executable: the same input can differ in its last bits. So results of
different executables are compared with a tolerance from their dtype, scaled by the magnitude of
the values (an absolute part, since values near zero carry the rounding of the larger terms that
made them), never bit for bit. Integers and bytes that were copied, not computed, compare exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ULPS = 64
"""Rounding steps of the dtype allowed, relative to the largest value (a few hundred fused
multiply-adds of error, with room)."""


def tolerance(expected: Any, dtype: Any = None, ulps: int = ULPS) -> tuple[float, float]:
    """(rtol, atol) for comparing a computed tensor with `expected`; zero for integer dtypes."""
    want = np.asarray(expected)
    dtype = np.dtype(dtype or want.dtype)
    if not np.issubdtype(dtype, np.inexact):
        return 0.0, 0.0
    rtol = ulps * float(np.finfo(dtype).eps)
    scale = float(np.max(np.abs(want), initial=0.0)) if want.size else 0.0
    return rtol, rtol * max(scale, 1.0)


def coarser(actual: Any, expected: Any) -> np.dtype[Any]:
    """The less precise of the two dtypes: a float32 model's answer against a float64 reference,
    or a float64 parsed from a float32's text against the float32, is as good as float32."""
    dtypes = [np.asarray(a).dtype for a in (actual, expected)]
    inexact = [d for d in dtypes if np.issubdtype(d, np.inexact)]
    return max(inexact, key=lambda d: np.finfo(d).eps) if inexact else dtypes[0]


def assert_close(actual: Any, expected: Any, *, ulps: int = ULPS) -> None:
    """`actual` equals `expected` within `tolerance` of the coarser of their dtypes."""
    rtol, atol = tolerance(expected, coarser(actual, expected), ulps)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def close(actual: Any, expected: Any, *, ulps: int = ULPS) -> bool:
    """`assert_close` as a predicate, for waiting until an answer changes."""
    try:
        if np.broadcast_shapes(np.shape(actual), np.shape(expected)) != np.shape(actual):
            return False
    except ValueError:
        return False
    rtol, atol = tolerance(expected, coarser(actual, expected), ulps)
    return bool(np.allclose(actual, expected, rtol=rtol, atol=atol))


def assert_grades(grades: Any, logits: Any) -> None:
    """Each row's grade is the index of its first logit <= 0 (or the row's length), where a
    logit within `tolerance` of zero may fall on either side."""
    logits = np.asarray(logits)
    _, atol = tolerance(logits, np.float32)
    for grade, row in zip(np.asarray(grades).ravel(), logits, strict=True):
        assert 0 <= grade <= len(row), (grade, row)
        assert np.all(row[:grade] > -atol), f"grade {grade} passes a logit <= 0: {row}"
        assert grade == len(row) or row[grade] <= atol, f"grade {grade} stops at a positive logit: {row}"
