"""Bundles on disk: modules, weights and signatures checked against the manifest."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.extend.mlir
import numpy as np
import pytest
from jaxlib.mlir.dialects import stablehlo
from safetensors.numpy import save_file
from support.bundles import PARAMS, edit_manifest, edit_weights_metadata, save_affine_weights, write_affine

from hloserve.errors import BundleError
from hloserve.export.jax import InputSpec, export_bundle
from hloserve.models.bundle import discover, load_bundle, read_weights


@pytest.fixture(name="affine")
def _affine(tmp_path: Path) -> Path:
    return write_affine(tmp_path / "affine")


def test_a_good_bundle_loads_with_its_modules_and_weights(affine: Path) -> None:
    bundle = load_bundle(affine)
    assert bundle.name == "affine"
    assert [m.batch_size for m in bundle.modules] == [1, 2]
    assert [w.name for w in bundle.weights] == ["b", "w"]  # jax flattens dict keys sorted
    assert bundle.weight_nbytes == 4 * 3 * 4 + 3 * 4
    signature = bundle.module_for(2).signature
    assert [str(t) for t in signature.inputs] == [
        "f32[2,4]",
        "f32[3]",
        "f32[4,3]",
    ]  # inputs first, weights last
    with pytest.raises(KeyError, match="no module for batch size 3"):
        bundle.module_for(3)


def test_read_weights_gives_aligned_arrays_in_argument_order(affine: Path) -> None:
    weights = read_weights(load_bundle(affine))
    np.testing.assert_array_equal(weights[0], PARAMS["b"])
    np.testing.assert_array_equal(weights[1], PARAMS["w"])
    assert all(w.ctypes.data % 64 == 0 and w.flags.c_contiguous and w.flags.writeable for w in weights)


def test_portable_artifact_bytecode_module_loads(affine: Path) -> None:
    path = affine / "model.b1.mlir"
    path.write_bytes(
        jax.extend.mlir.serialize_portable_artifact(path.read_text(), stablehlo.get_current_version())
    )
    bundle = load_bundle(affine)
    assert isinstance(bundle.module_for(1).source, bytes)
    assert isinstance(bundle.module_for(2).source, str)


def test_bf16_bool_and_int64_tensors(tmp_path: Path) -> None:
    import ml_dtypes

    def fn(params: dict[str, np.ndarray], ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        scaled = (ids * 2).astype(np.float32) * params["scale"].astype(np.float32)
        return scaled.astype(ml_dtypes.bfloat16), mask & (ids > 0)

    directory = export_bundle(
        fn,
        {"scale": np.full((3,), 0.5, ml_dtypes.bfloat16)},
        [InputSpec("IDS", (3,), np.int64), InputSpec("MASK", (3,), np.bool_)],
        tmp_path / "typed",
        batch_sizes=(2,),
        verify=False,
    )
    bundle = load_bundle(directory)
    inputs = bundle.module_for(2).signature.inputs
    assert [t.dtype.token for t in inputs] == ["i64", "bool", "bf16"]
    assert [s.dtype.wire for s in bundle.manifest.executable_outputs] == ["BF16", "BOOL"]
    assert read_weights(bundle)[0].dtype == ml_dtypes.bfloat16


def _expect(directory: Path, file: str, field: str | None, says: str) -> None:
    with pytest.raises(BundleError) as raised:
        load_bundle(directory)
    error = raised.value
    assert (error.bundle, error.file, error.field) == (directory.name, file, field), str(error)
    assert says in str(error)


def test_compiled_size_without_its_module(affine: Path) -> None:
    edit_manifest(affine, lambda m: m["batching"].update(compiled_batch_sizes=[1, 2, 4]))
    _expect(affine, "manifest.yaml", "batching.compiled_batch_sizes", "no module file for batch size(s) [4]")


def test_no_module_at_all(affine: Path) -> None:
    for path in affine.glob("*.mlir"):
        path.unlink()
    _expect(affine, "model.mlir", None, "expected model.mlir or model.b{N}.mlir")


def test_single_module_beside_per_size_modules(affine: Path) -> None:
    shutil.copy(affine / "model.b1.mlir", affine / "model.mlir")
    _expect(affine, "model.mlir", None, "use one layout or the other")


def test_module_that_does_not_parse(affine: Path) -> None:
    (affine / "model.b2.mlir").write_text("func.func @main(")
    _expect(affine, "model.b2.mlir", None, "not a StableHLO module")


def test_weights_without_argument_order(affine: Path) -> None:
    edit_weights_metadata(affine, None)
    _expect(affine, "weights.safetensors", "__metadata__.argument_order", "2 tensors need an order")


@pytest.mark.parametrize(
    ("order", "says"),
    [
        ('["w"]', "unlisted ['b']"),
        ('["w", "b", "c"]', "not in the file ['c']"),
        ('["w", "w", "b"]', "repeated ['w']"),
        ('"w"', "JSON list"),
    ],
)
def test_argument_order_must_list_every_tensor_once(affine: Path, order: str, says: str) -> None:
    edit_weights_metadata(affine, {"argument_order": order})
    _expect(affine, "weights.safetensors", "__metadata__.argument_order", says)


def test_missing_weights_file(affine: Path) -> None:
    (affine / "weights.safetensors").unlink()
    _expect(affine, "model.b1.mlir", "main", "takes 3 arguments, the manifest and weights need 1")


def test_weights_empty_file_gives_an_empty_order(tmp_path: Path) -> None:
    directory = export_bundle(
        lambda p, x: x * 2, {}, [InputSpec("X", (2,))], tmp_path / "double", verify=False
    )
    save_file({}, str(directory / "weights.safetensors"))
    assert load_bundle(directory).weights == ()


def test_weight_whose_shape_disagrees_with_the_module(affine: Path) -> None:
    save_affine_weights(affine, {"b": np.ones(3, np.float32), "w": np.ones((3, 4), np.float32)})
    _expect(affine, "model.b1.mlir", "main", "argument 2 ('w') is f32[4,3], expected f32[3,4]")


def test_weight_whose_dtype_disagrees_with_the_module(affine: Path) -> None:
    save_affine_weights(affine, {"b": np.ones(3, np.float64), "w": np.ones((4, 3), np.float32)})
    _expect(affine, "model.b1.mlir", "main", "argument 1 ('b') is f32[3], expected f64[3]")


def test_module_with_donation_is_refused(affine: Path) -> None:
    def donate(x: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w + b

    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in ((1, 4), (3,), (4, 3))]
    text = jax.jit(donate, donate_argnums=(1,), keep_unused=True).lower(*specs).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text
    (affine / "model.b1.mlir").write_text(text)
    _expect(affine, "model.b1.mlir", "main", "donation attribute on argument(s) [1]")


def test_manifest_input_shape_disagrees_with_the_module(affine: Path) -> None:
    edit_manifest(affine, lambda m: m["executable_inputs"][0]["dims"].update(f=5))
    _expect(affine, "model.b1.mlir", "main", "argument 0 ('INPUT') is f32[1,4], expected f32[1,5]")


def test_manifest_input_dtype_disagrees_with_the_module(affine: Path) -> None:
    edit_manifest(affine, lambda m: m["executable_inputs"][0].update(dtype="f64"))
    _expect(affine, "model.b1.mlir", "main", "argument 0 ('INPUT') is f32[1,4], expected f64[1,4]")


def test_manifest_declares_more_outputs_than_the_module_returns(affine: Path) -> None:
    edit_manifest(
        affine, lambda m: m["executable_outputs"].append({"name": "EXTRA", "dtype": "f32", "shape": "n"})
    )
    _expect(affine, "model.b1.mlir", "main", "returns 1 results, executable_outputs declares 2")


def test_manifest_output_shape_disagrees_with_the_module(affine: Path) -> None:
    edit_manifest(affine, lambda m: m["executable_outputs"][0]["dims"].update(k=7))
    _expect(affine, "model.b1.mlir", "main", "result 0 ('OUTPUT') is f32[1,3], expected f32[1,7]")


def test_manifest_declares_more_inputs_than_the_module_takes(affine: Path) -> None:
    edit_manifest(
        affine,
        lambda m: m["executable_inputs"].append(
            {"name": "MORE", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}
        ),
    )
    _expect(affine, "model.b1.mlir", "main", "takes 3 arguments, the manifest and weights need 4")


def test_discover_keeps_going_past_a_bad_bundle(tmp_path: Path) -> None:
    write_affine(tmp_path / "a_good")
    bad = write_affine(tmp_path / "b_bad")
    edit_manifest(bad, lambda m: m.update(format_version="9"))
    write_affine(tmp_path / "c_good")
    (tmp_path / "not_a_bundle").mkdir()
    found = discover(tmp_path)
    assert [name for name, _ in found] == ["a_good", "b_bad", "c_good"]
    assert isinstance(found[1][1], BundleError) and "format_version" in str(found[1][1])
    assert not isinstance(found[0][1], BundleError) and not isinstance(found[2][1], BundleError)


def test_unparseable_yaml(affine: Path) -> None:
    (affine / "manifest.yaml").write_text("format_version: [\n")
    _expect(affine, "manifest.yaml", None, "not valid YAML")
