"""The native CPU kernels (`hloserve.kernels`): built here, called in place of the composites that
name them where a bundle's options turn them on, the same numbers as XLA's own convolution, and
the portable decomposition wherever they are off or cannot be built; the exporter tries them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hloserve import kernels
from hloserve.export import _channels_last, tuning
from hloserve.export.jax import _portable_artifact
from hloserve.models import _xla
from hloserve.models.executable_cache import ExecutableCache

jax, jnp = _xla.jax, _xla.jnp
NATIVE = {_xla.NATIVE_KERNELS: True}

GEOMETRIES = [
    # batch, size, channels, kernel, stride, padding, dilation
    (1, 9, 1, 3, 1, 1, 1),
    (2, 10, 7, 3, 2, 1, 1),
    (3, 11, 17, 5, 2, 2, 1),
    (1, 12, 33, 3, 1, 2, 2),
    (2, 7, 16, 3, 1, 0, 1),
    (1, 8, 97, 3, 3, 1, 1),
    (1, 6, 5, 7, 1, 3, 1),
    (2, 14, 24, 3, 1, 4, 4),
]


def _module(
    shape: tuple[int, ...], weight_shape: tuple[int, ...], geometry: tuple[int, ...], dtype: object
) -> str:
    """StableHLO text of a depthwise convolution as the exporter lowers it."""
    *_, stride, padding, dilation = geometry
    lowered = jax.jit(
        lambda x, w: _channels_last._depthwise(
            x, w, (stride, stride), (padding, padding), (dilation, dilation)
        )
    ).lower(jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(weight_shape, dtype))
    return str(lowered.as_text())


def _reference(x: np.ndarray, weight: np.ndarray, geometry: tuple[int, ...]) -> np.ndarray:
    *_, stride, padding, dilation = geometry
    y = jax.lax.conv_general_dilated(
        jnp.asarray(x),
        jnp.transpose(jnp.asarray(weight), (2, 3, 1, 0)),
        (stride, stride),
        [(padding, padding)] * 2,
        rhs_dilation=(dilation, dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=x.shape[3],
        precision=jax.lax.Precision.HIGHEST,
    )
    return np.asarray(y)


def _run(source: str | bytes, arrays: list[np.ndarray], options: _xla.XlaOptions | None = None) -> np.ndarray:
    executable = _xla.compile_module(source, options)
    return _xla.to_numpy(_xla.run(executable, _xla.put_all(arrays)))[0]


def _close(got: np.ndarray, expected: np.ndarray, terms: int) -> None:
    """float32 sums of `terms` products: a few units in the last place of the largest term each."""
    scale = float(np.max(np.abs(expected))) or 1.0
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * terms * np.finfo(np.float32).eps * scale)


@pytest.fixture(scope="module", name="built")
def _built() -> kernels.Kernels:
    built = kernels.load()
    assert built is not None, "the native kernels did not build on this machine (see the log above)"
    return built


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "n{}-s{}-c{}-k{}-st{}-p{}-d{}".format(*g))
def test_a_depthwise_convolution_runs_as_the_kernel_and_matches_xlas_convolution(
    built: kernels.Kernels, geometry: tuple[int, ...]
) -> None:
    batch, size, channels, kernel, *_ = geometry
    rng = np.random.default_rng(sum(geometry))
    x = rng.standard_normal((batch, size, size, channels), np.float32)
    weight = rng.standard_normal((channels, 1, kernel, kernel), np.float32)
    text = _module(x.shape, weight.shape, geometry, jnp.float32)
    assert f'stablehlo.composite "{kernels.DEPTHWISE_CONV2D}"' in text
    native = _xla.with_native_kernels(text)
    assert isinstance(native, str)
    assert f"stablehlo.custom_call @{kernels.DEPTHWISE_CONV2D}" in native
    assert "stablehlo.composite" not in native
    executable = _xla.compile_module(text, NATIVE)
    assert f'custom_call_target="{kernels.DEPTHWISE_CONV2D}"' in executable.hlo_modules()[0].to_string()
    expected = _reference(x, weight, geometry)
    got = _xla.to_numpy(_xla.run(executable, _xla.put_all([x, weight])))[0]
    assert got.shape == expected.shape
    _close(got, expected, kernel * kernel)
    # the decomposition, by default and where a bundle turns the kernels off: the same numbers
    for options in ({}, {_xla.NATIVE_KERNELS: False}):
        portable = _xla.compile_module(text, options)
        assert kernels.DEPTHWISE_CONV2D not in portable.hlo_modules()[0].to_string()
        _close(_xla.to_numpy(_xla.run(portable, _xla.put_all([x, weight])))[0], expected, kernel * kernel)


def test_a_portable_artifact_is_rewritten_as_text_is(built: kernels.Kernels) -> None:
    geometry = GEOMETRIES[1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 10, 10, 7), np.float32)
    weight = rng.standard_normal((7, 1, 3, 3), np.float32)
    artifact = _portable_artifact(_module(x.shape, weight.shape, geometry, jnp.float32))
    assert f"stablehlo.custom_call @{kernels.DEPTHWISE_CONV2D}" in str(_xla.with_native_kernels(artifact))
    _close(_run(artifact, [x, weight], NATIVE), _reference(x, weight, geometry), 9)


def test_other_dtypes_lower_to_the_decomposition_alone() -> None:
    text = _module((1, 8, 8, 4), (4, 1, 3, 3), GEOMETRIES[0], jnp.bfloat16)
    assert "stablehlo.composite" not in text
    assert _xla.with_native_kernels(text) == text


def test_the_kernels_are_part_of_the_cache_key_of_an_executable_that_calls_them(
    built: kernels.Kernels, tmp_path: Path
) -> None:
    assert f"kernels {built.digest}" in _xla.runtime_identity(NATIVE)
    assert "kernels" not in _xla.runtime_identity() + _xla.runtime_identity({_xla.NATIVE_KERNELS: False})
    assert built.path.is_file() and built.path.parent == kernels.build_directory()
    cache = ExecutableCache(tmp_path)
    text = _module((1, 9, 9, 1), (1, 1, 3, 3), GEOMETRIES[0], jnp.float32)
    assert cache.key(text) != cache.key(text, NATIVE)


def test_the_exporter_tries_the_kernels_where_a_module_has_their_composites(built: kernels.Kernels) -> None:
    eigen = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    with_composite = _module((1, 9, 9, 4), (4, 1, 3, 3), GEOMETRIES[0], jnp.float32)
    assert tuning.candidates_with_native_kernels(with_composite, (eigen,)) == (
        eigen,
        NATIVE,
        {**eigen, **NATIVE},
    )
    without = _module((1, 9, 9, 4), (4, 1, 3, 3), GEOMETRIES[0], jnp.bfloat16)
    assert tuning.candidates_with_native_kernels(without, (eigen,)) == (eigen,)


def _python(script: str, cache: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh Python from the repository's root, its cache folder `cache` (so the
    kernels are built or not there, as on a new machine), `environment` added; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "XDG_CACHE_HOME": str(cache), **environment},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


_WITHOUT = """
import numpy as np, structlog
from hloserve import kernels
from hloserve.models import _xla
from tests.models.test_native_kernels import GEOMETRIES, _module, _reference, _run, _close
assert kernels.load() is None
x = np.random.default_rng(1).standard_normal((2, 10, 10, 7), np.float32)
w = np.random.default_rng(2).standard_normal((7, 1, 3, 3), np.float32)
text = _module(x.shape, w.shape, GEOMETRIES[1], np.float32)
native = {_xla.NATIVE_KERNELS: True}
assert _xla.with_native_kernels(text) == text and "kernels" not in _xla.runtime_identity(native)
_close(_run(text, [x, w], native), _reference(x, w, GEOMETRIES[1]), 9)
print("portable")
"""


@pytest.mark.parametrize(
    "environment",
    [{"CXX": "/nonexistent/c++"}, {"CXX": "false"}, {"HLOSERVE_NATIVE_KERNELS": "0"}],
    ids=["no-compiler", "compiler-fails", "turned-off"],
)
def test_without_the_kernels_a_module_runs_its_decomposition(
    environment: dict[str, str], tmp_path: Path
) -> None:
    """A bundle that asks for the kernels, on a machine that cannot build them (no compiler, or
    a failing one) or with them turned off, compiles the composites' decompositions, logs why,
    and answers the same."""
    done = _python(_WITHOUT, tmp_path, **environment)
    assert done.stdout.strip().endswith("portable")
    if "CXX" in environment:
        assert "native kernels off" in done.stdout + done.stderr


HOSTILE = """
func.func public @main(%x: tensor<1x4x4x2xf32>, %w: tensor<3x3x2xf32>) -> tensor<1x4x4x2xf32> {
  %0 = stablehlo.composite "hloserve.depthwise_conv2d" %x, %w {composite_attributes = {
    dilation_h = 1 : i64, dilation_w = 1 : i64, pad_h = 1 : i64, pad_w = 1 : i64,
    stride_h = STRIDE : i64, stride_w = 1 : i64}, decomposition = @plain}
    : (tensor<1x4x4x2xf32>, tensor<3x3x2xf32>) -> tensor<1x4x4x2xf32>
  return %0 : tensor<1x4x4x2xf32>
}
func.func private @plain(%x: tensor<1x4x4x2xf32>, %w: tensor<3x3x2xf32>) -> tensor<1x4x4x2xf32> {
  return %x : tensor<1x4x4x2xf32>
}
"""


@pytest.mark.parametrize(
    ("stride", "says"),
    [
        ("0", "strides and dilations 1 to 2"),
        ("-3", "strides and dilations 1 to 2"),
        ("1099511627776", "strides and dilations 1 to 2"),
        ("none", "Wrong number of attributes"),  # none at all: XLA says how many it expected
    ],
)
def test_a_bundles_composite_with_impossible_attributes_fails_its_execution_cleanly(
    built: kernels.Kernels, stride: str, says: str
) -> None:
    """A bundle is input: attributes that could overflow the kernel's indices, or none at all,
    fail that execution with an error that names them, and the process goes on."""
    module = HOSTILE.replace("STRIDE", stride)
    if stride == "none":
        module = re.sub(r"composite_attributes = \{[^}]*\}, ", "", module)
        assert "composite_attributes" not in module
    executable = _xla.compile_module(module, NATIVE)
    arrays = _xla.put_all([np.ones((1, 4, 4, 2), np.float32), np.ones((3, 3, 2), np.float32)])
    with pytest.raises(Exception, match=says):
        _xla.to_numpy(_xla.run(executable, arrays))
    geometry = (1, 4, 2, 3, 1, 1, 1)
    _close(
        _run(
            HOSTILE.replace("STRIDE", "1"),
            [np.ones((1, 4, 4, 2), np.float32), np.ones((3, 3, 2), np.float32)],
            NATIVE,
        ),
        _reference(np.ones((1, 4, 4, 2), np.float32), np.ones((2, 1, 3, 3), np.float32), geometry),
        9,
    )


def test_a_module_without_their_composites_never_builds_the_kernels(tmp_path: Path) -> None:
    """The exporter asks of every module whether the kernels apply, and a bundle may turn them on
    with nothing to replace: neither builds them (seconds of a compiler) nor loads them."""
    script = (
        "import numpy as np\n"
        "from hloserve.models import _xla\n"
        "from hloserve.export import tuning\n"
        "from tests.models.test_native_kernels import GEOMETRIES, NATIVE, _module\n"
        "text = _module((1, 8, 8, 4), (4, 1, 3, 3), GEOMETRIES[0], np.dtype('bfloat16'))\n"
        "assert tuning.candidates_with_native_kernels(text, ()) == ()\n"
        "_xla.compile_module(text, NATIVE)\n"
        "print('compiled')\n"
    )
    done = _python(script, tmp_path)
    assert done.stdout.strip().endswith("compiled")
    assert not (tmp_path / "hloserve" / "kernels").exists()
