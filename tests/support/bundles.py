"""Small bundles for tests, exported by hloserve's own exporter into temporary folders."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from safetensors.numpy import save_file

from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

from .clients import infer
from .numerics import assert_close

PARAMS: dict[str, np.ndarray] = {
    "w": np.arange(12, dtype=np.float32).reshape(4, 3) / 10,
    "b": np.ones(3, np.float32),
}


X = np.arange(4, dtype=np.float32).reshape(1, 4)
"""One row for an affine bundle."""
WEIGHT_BYTES = PARAMS["w"].nbytes + PARAMS["b"].nbytes  # 60 bytes per affine model


def affine(params: Any, x: Any) -> Any:
    return x @ params["w"] + params["b"]


def affine_output(client: Any, model: str, x: np.ndarray = X) -> np.ndarray:
    """What an affine bundle named `model` answers for `x` (through a tritonclient `client`)."""
    output: np.ndarray = infer(client, model, {"INPUT": x}).as_numpy("OUTPUT")
    return output


def assert_affine_answers(client: Any, model: str) -> None:
    """An affine bundle named `model` answers one row right."""
    assert_close(affine_output(client, model), affine(PARAMS, X))


def write_affine(directory: Path, batch_sizes: tuple[int, ...] = (1, 2)) -> Path:
    """A bundle `y = x @ w + b`: INPUT [n, 4] f32 → OUTPUT [n, 3] f32."""
    return export_bundle(
        affine,
        PARAMS,
        [InputSpec("INPUT", (4,), np.float32, letters="f")],
        directory,
        batch_sizes=batch_sizes,
        outputs=[OutputSpec("OUTPUT", letters="k")],
        verify=False,  # a fixture; the exporter's own tests verify (and tune)
        tune=False,
    )


def save_affine_weights(directory: Path, params: dict[str, np.ndarray]) -> None:
    """Replace an affine bundle's weights file with `params` (`b` and `w`, in argument order)."""
    save_file(dict(params), str(directory / "weights.safetensors"), metadata={"argument_order": '["b", "w"]'})


def write_total(directory: Path) -> Path:
    """A bundle whose output has no batch axis, `TOTAL = X.sum(axis=0)`: X [n, 4] → TOTAL [4],
    compiled for 1 and 2 rows; its outputs cannot be joined, so 2 rows is the most it runs."""
    import jax

    directory.mkdir(parents=True)
    for size in (1, 2):
        spec = jax.ShapeDtypeStruct((size, 4), np.float32)
        (directory / f"model.b{size}.mlir").write_text(jax.jit(lambda x: x.sum(axis=0)).lower(spec).as_text())
    manifest = {
        "format_version": "2.0",
        "executable_inputs": [{"name": "X", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
        "executable_outputs": [{"name": "TOTAL", "dtype": "f32", "shape": "f", "dims": {"f": 4}}],
        "batching": {"compiled_batch_sizes": [1, 2]},
    }
    (directory / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    return directory


def edit_manifest(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "manifest.yaml"
    manifest = yaml.safe_load(path.read_text())
    change(manifest)
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))


def edit_weights_metadata(directory: Path, metadata: dict[str, str] | None) -> None:
    """Rewrite the safetensors header's __metadata__ (None removes it), keeping the data."""
    path = directory / "weights.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    if metadata is not None:
        header["__metadata__"] = metadata
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def write_heavy(directory: Path, products: int) -> Path:
    """A model of `products` 256x256 matrix products per row (about 0.15 ms each here): work on
    purpose, in a loop so that compiling it stays quick."""

    def heavy(params: Any, x: Any) -> Any:
        m = x.reshape(-1)[:, None] * params["w"]
        m = jax.lax.fori_loop(0, products, lambda _, m: jnp.tanh(m @ params["w"]), m)
        return m.sum(axis=1)[None, :]

    w = (np.random.default_rng(0).standard_normal((256, 256)) / 16).astype(np.float32)
    return export_bundle(
        heavy, {"w": w}, [InputSpec("INPUT0", (256,))], directory, batch_sizes=(1,), verify=False, tune=False
    )


def _scaled(params: Any, x: Any) -> tuple[Any]:
    return (x * params["k"],)


def write_wide(directory: Path, width: int) -> Path:
    """A model whose one row is `width` floats in and out (`X` -> `Y`, twice `X`): a large answer
    at batch size 1, for the REST bounds on what a connection receives and sends."""
    return export_bundle(
        _scaled,
        {"k": np.float32(2)},
        [InputSpec("X", (width,), np.float32, letters="f")],
        directory,
        batch_sizes=(1,),
        outputs=[OutputSpec("Y", letters="f")],
        verify=False,
        tune=False,
    )


def _convolutions(params: Any, x: Any) -> Any:
    for w in params["w"]:
        x = jax.nn.relu(
            jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        )
    return x.mean(axis=(1, 2))


def write_convolutions(directory: Path, *, tune: bool = False, verify: bool = False) -> Path:
    """Four dense 3x3 convolutions of 64 channels over a 32x32 image (IMAGE [n, 32, 32, 16] →
    output_0 [n, 64]) at batch sizes 1 and 4: the kind of layer XLA's options change."""
    rng = np.random.default_rng(0)
    w = [(rng.standard_normal((3, 3, c, 64)) * 0.1).astype(np.float32) for c in (16, 64, 64, 64)]
    return export_bundle(
        _convolutions,
        {"w": w},
        [InputSpec("IMAGE", (32, 32, 16), np.float32)],
        directory,
        batch_sizes=(1, 4),
        verify=verify,
        tune=tune,
    )
