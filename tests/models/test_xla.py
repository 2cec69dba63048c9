"""The JAX adapter: every call hloserve makes into JAX, on the CPU backend."""

from __future__ import annotations

import jax
import jax.extend.mlir
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir.dialects import stablehlo
from support.numerics import assert_close

from hloserve.models import _xla


def _text(fn: object, *specs: jax.ShapeDtypeStruct) -> str:
    return jax.jit(fn, keep_unused=True).lower(*specs).as_text()  # type: ignore[arg-type]


def test_x64_is_on_so_int64_is_not_narrowed() -> None:
    array = _xla.put(np.array([2**40], np.int64))
    assert array.dtype == np.int64
    assert _xla.to_numpy([array])[0][0] == 2**40


def test_compile_text_and_bytecode_then_run() -> None:
    specs = (jax.ShapeDtypeStruct((2, 3), np.float32), jax.ShapeDtypeStruct((3,), np.float32))
    text = _text(lambda x, w: jnp.tanh(x * w), *specs)
    bytecode = jax.extend.mlir.serialize_portable_artifact(text, stablehlo.get_current_version())
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = np.array([0.1, 0.2, 0.3], np.float32)
    for source in (text, bytecode):
        executable = _xla.compile_module(source)
        (out,) = _xla.to_numpy(_xla.run(executable, [_xla.put(x), _xla.put(w)]))
        assert_close(out, np.tanh(x * w))
        assert _xla.compiled_memory(executable)["argument_bytes"] == x.nbytes + w.nbytes


def test_main_signature_reads_types_and_donation() -> None:
    specs = (jax.ShapeDtypeStruct((4,), np.int64), jax.ShapeDtypeStruct((2, 2), np.bool_))
    signature = _xla.main_signature(_text(lambda a, b: (a * 2, ~b), *specs))
    assert [str(t) for t in signature.inputs] == ["i64[4]", "bool[2,2]"]
    assert [str(t) for t in signature.outputs] == ["i64[4]", "bool[2,2]"]
    assert signature.donated == ()
    donated = jax.jit(lambda a, b: (a + 1, b), donate_argnums=(0,)).lower(*specs).as_text()
    assert _xla.main_signature(donated).donated == (0,)


def test_a_module_without_main_or_not_a_module() -> None:
    with pytest.raises(ValueError, match="not a StableHLO module"):
        _xla.main_signature("this is not MLIR")
    with pytest.raises(ValueError, match="no function named 'main'"):
        _xla.main_signature("module {\n  func.func @other() {\n    return\n  }\n}\n")


def test_free_releases_device_buffers() -> None:
    arrays = [_xla.put(np.ones(1000, np.float32)) for _ in range(3)]
    _xla.free(arrays)
    assert all(a.is_deleted() for a in arrays)


def test_memory_stats_none_on_cpu_and_lapack_warm_up() -> None:
    assert _xla.device().platform == "cpu"
    assert _xla.memory_stats() is None
    _xla.warm_up()
    spec = jax.ShapeDtypeStruct((3, 3), np.float32)
    executable = _xla.compile_module(_text(jnp.linalg.inv, spec))
    a = np.eye(3, dtype=np.float32) * 2
    assert_close(_xla.to_numpy(_xla.run(executable, [_xla.put(a)]))[0], np.eye(3) / 2)


def test_every_semi_public_jax_name_resolves_on_the_installed_jax() -> None:
    _xla.check_jax()  # what importing _xla does at start-up, on whichever jax line runs the suite
    assert "jaxlib.xla_client.batched_device_put" in _xla.SEMI_PUBLIC


def test_a_missing_jax_name_is_named_with_the_versions() -> None:
    with pytest.raises(_xla.JaxMismatch) as raised:
        _xla.check_jax((*_xla.SEMI_PUBLIC, "jaxlib.xla_client.no_such_call", "jax.extend.nothing_here"))
    message = str(raised.value)
    assert f"jax {jax.__version__}" in message and "jaxlib " in message
    assert "jaxlib.xla_client.no_such_call, jax.extend.nothing_here" in message
    assert "batched_device_put" not in message  # only what is missing


def test_pinned_host_floor_copies_to_the_device() -> None:
    assert _xla.pinned_host_available()  # the CPU backend lists it too, so this path runs in CI
    host = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.int64)]
    pinned = _xla.pin(host)
    assert [a.sharding.memory_kind for a in pinned] == ["pinned_host", "pinned_host"]
    placed = _xla.put_all(pinned)
    assert [a.sharding.memory_kind for a in placed] == ["device", "device"]
    for original, back in zip(host, _xla.to_numpy(placed), strict=True):
        np.testing.assert_array_equal(original, back)
    assert [a.dtype for a in _xla.put_all(host)] == [np.float32, np.int64]  # pageable numpy too
