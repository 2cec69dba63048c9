"""The exporter's check compares each output relative to its magnitude, per dtype, says how far
off a bundle is, where, and what tolerance would pass, and takes `--rtol` / `--atol`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hloserve.cli import main
from hloserve.export.verification import DEFAULT_TOLERANCES, Tolerance, compare, default_tolerance

F32 = DEFAULT_TOLERANCES["f32"]


def test_compare_scales_atol_by_the_outputs_largest_magnitude() -> None:
    """ResNet-50's case: logits as large as 112, off by 1.7e-4 (1.5e-6 of 112), pass at f32's
    defaults; the same absolute error on an output of magnitude 1 does not."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 1000)) * 30).astype(np.float32)
    logits[1, 7] = 112.0
    assert compare(logits + np.float32(1.68e-4), logits, F32).ok
    small = logits / 112
    assert not compare(small + 1.68e-4, small, F32).ok


def test_compare_says_where_and_what_tolerance_passes() -> None:
    want = np.array([[1.0, -2.0], [4.0, 0.5]], np.float32)
    got = want.copy()
    got[1, 1] += 0.01
    difference = compare(got, want, F32)
    assert not difference.ok
    assert (difference.index, difference.scale, difference.want) == ((1, 1), 4.0, 0.5)
    assert difference.got == np.float32(0.51)
    assert difference.describe() == (
        "differs from the model by up to 0.01 (0.0025 of its largest magnitude 4); "
        "at index [1, 1] the bundle gives 0.51, the model 0.5; "
        "the tolerance is rtol=0.0001 (of each element) plus atol=1e-05 (of 4); "
        "it would pass with atol=0.0025 or rtol=0.02"
    )
    assert compare(got, want, Tolerance(F32.rtol, 0.0025)).ok
    assert compare(got, want, Tolerance(0.02, F32.atol)).ok


def test_compare_refuses_a_nan_against_a_number_whatever_the_tolerance() -> None:
    want = np.array([1.0, np.nan, np.inf], np.float32)
    assert compare(want.copy(), want, Tolerance(0, 0)).ok  # NaN matches NaN, inf the same inf
    got = np.array([np.nan, np.nan, np.inf], np.float32)
    difference = compare(got, want, Tolerance(1.0, 1.0))
    assert not difference.ok and difference.index == (0,)
    assert difference.describe().endswith(
        "NaN or infinity where the model has another value, which no tolerance passes"
    )


def test_default_tolerance_is_per_dtype_and_exact_for_integers() -> None:
    assert default_tolerance(np.dtype(np.float32)) == F32
    assert default_tolerance(np.dtype(np.float16)).rtol > F32.rtol
    assert default_tolerance(np.dtype(np.int64)) == Tolerance(0.0, 0.0)
    assert not compare(np.array([3]), np.array([2]), default_tolerance(np.dtype(np.int64))).ok


SPEC = """
import jax
import numpy as np
from hloserve.export.jax import InputSpec

def _scaled(params, x):
    # traced into the bundle: off by 1e-3 of each element; called eagerly (the reference): exact
    return x * 1.001 if isinstance(x, jax.core.Tracer) else x

def make():
    return {"fn": _scaled, "params": {}, "inputs": [InputSpec("X", (8,))]}
"""


def test_cli_export_takes_rtol_and_atol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.py").write_text(SPEC)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder is put on it
    spec, out = f"{tmp_path / 'spec.py'}:make", str(tmp_path / "scaled")
    assert main(["export", spec, "--out", out]) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("hloserve export: bundle 'scaled', output 'output_0', batch size 1 (f32): ")
    assert "the tolerance is rtol=0.0001 (of each element) plus atol=1e-05" in error
    assert error.endswith("or rtol=0.001")
    assert main(["export", spec, "--out", out, "--rtol", "0.0011"]) == 0
    assert main(["export", spec, "--out", out, "--atol", "0.002"]) == 0
    with pytest.raises(SystemExit):
        main(["export", spec, "--out", out, "--rtol", "-1"])
    assert "expected a finite number >= 0, got '-1'" in capsys.readouterr().err
