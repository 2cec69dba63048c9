"""The JAX exporter writes the seeds' bundle format, and the shipped example repository is current."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import EXAMPLES
from safetensors import safe_open

from hloserve import _xla
from hloserve.bundle import load_bundle, read_weights
from hloserve.export import InputSpec, OutputSpec, export_bundle

sys.path.insert(0, str(EXAMPLES.parent))
import export_examples


def nested(params: dict, x: np.ndarray, t: np.ndarray) -> tuple:  # type: ignore[type-arg]
    h = x @ params["layers"][0]["w"] + params["layers"][1]["b"]
    return h * params["scale"], (t * 2).sum(axis=1)


PARAMS = {
    "layers": [{"w": np.ones((3, 2), np.float32)}, {"b": np.array([0.5, -0.5], np.float32)}],
    "scale": np.float32(3.0),
}


def test_export_writes_modules_weights_and_a_column_major_manifest(tmp_path: Path) -> None:
    directory = export_bundle(
        nested,
        PARAMS,
        [InputSpec("X", (3,), np.float32, letters="f"), InputSpec("T", (2, 5), np.int64)],
        tmp_path / "nested",
        batch_sizes=(4, 1),
        outputs=[OutputSpec("Y", letters="k"), OutputSpec("S", letters="a")],
    )
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.yaml",
        "model.b1.mlir",
        "model.b4.mlir",
        "weights.safetensors",
    ]
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert manifest["executable_inputs"][1] == {
        "name": "T",
        "dtype": "i64",
        "shape": "can",
        "dims": {"a": 2, "c": 5},
    }
    assert manifest["executable_outputs"] == [
        {"name": "Y", "dtype": "f32", "shape": "kn", "dims": {"k": 2}},
        {"name": "S", "dtype": "i64", "shape": "an", "dims": {"a": 5}},
    ]
    assert manifest["batching"] == {"compiled_batch_sizes": [1, 4]}
    assert oct((directory / "weights.safetensors").stat().st_mode & 0o777) == "0o644"
    header = (directory / "model.b4.mlir").read_text().split("func.func public @main(")[1].split(")")[0]
    assert header.count("%arg") == 5 and "tensor<4x3xf32>" in header.split(",")[0]  # inputs first
    assert "aliasing_output" not in header and "buffer_donor" not in header

    with safe_open(directory / "weights.safetensors", "numpy") as f:
        order = json.loads(f.metadata()["argument_order"])
    assert order == ["layers.0.w", "layers.1.b", "scale"]  # jax's flattening order of PARAMS
    assert manifest["name"] == "nested" and manifest["format_version"] == "2.0"
    bundle = load_bundle(directory)
    assert [w.name for w in bundle.weights] == order
    weights = [_xla.put(w) for w in read_weights(bundle)]
    x = np.random.default_rng(0).random((4, 3), dtype=np.float32)
    t = np.arange(40, dtype=np.int64).reshape(4, 2, 5)
    executable = _xla.compile_module(bundle.module_for(4).source)
    y, s = _xla.to_numpy(_xla.run(executable, [_xla.put(x), _xla.put(t), *weights]))
    want_y, want_s = nested(PARAMS, x, t)
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    np.testing.assert_array_equal(s, want_s)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"batch_sizes": (0, 2)}, "distinct positive integers"),
        ({"batch_sizes": (2, 2)}, "distinct positive integers"),
        ({"outputs": [OutputSpec("A")]}, "1 output names for 2 outputs"),
        ({"name": "other"}, "must equal its directory's name"),
    ],
)
def test_export_refuses_bad_arguments(tmp_path: Path, kwargs: dict, says: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=says):
        export_bundle(
            nested,
            PARAMS,
            [InputSpec("X", (3,)), InputSpec("T", (2, 5), np.int64)],
            tmp_path / "bad",
            **kwargs,
        )


def test_export_refuses_an_output_without_a_batch_axis(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a leading batch axis"):
        export_bundle(lambda p, x: x.sum(), {}, [InputSpec("X", (3,))], tmp_path / "scalar", batch_sizes=(2,))


def test_shipped_example_repository_is_what_the_script_exports(tmp_path: Path) -> None:
    export_examples.export_all(tmp_path)
    assert sorted(p.name for p in EXAMPLES.iterdir()) == sorted(export_examples.MODELS)
    for model in export_examples.MODELS:
        fresh, shipped = tmp_path / model, EXAMPLES / model
        assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in shipped.iterdir())
        for path in fresh.iterdir():
            assert path.read_bytes() == (shipped / path.name).read_bytes(), (
                f"run examples/export_examples.py: {model}/{path.name}"
            )
