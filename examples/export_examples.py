"""Regenerate the example repository: `python examples/export_examples.py [OUT]`.

Two small models with fixed weights, exported with hloserve's own JAX exporter:

* `mlp`: tabular, `INPUT0` FP32 [batch, 16] → 32 relu → `OUTPUT0` FP32 [batch, 4]; sizes 1, 4, 8, 16.
* `pool`: an almost free model for transfer costs, `IMAGE` FP32 [batch, 224, 224, 3] → per-channel
  mean `MEAN` FP32 [batch, 3]; sizes 1, 8 (8 images are a 4.8 MB request).
* `cnn`: vision, `IMAGE` FP32 [batch, 16, 16, 3] (NHWC) → 3x3 conv, 8 channels, relu → global
  average pool → dense → `LOGITS` FP32 [batch, 10]; sizes 1, 4.

The functions and parameters are importable, so tests compare the server with JAX in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from hloserve.export import InputSpec, OutputSpec, export_bundle

jnp = __import__("jax.numpy", fromlist=["numpy"])
lax = __import__("jax.lax", fromlist=["lax"])

REPOSITORY = Path(__file__).resolve().parent / "repository"


def _params(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    return {
        k: (rng.standard_normal(s) / np.sqrt(max(1, np.prod(s[:-1])))).astype(np.float32)
        for k, s in shapes.items()
    }


MLP_PARAMS = {
    "hidden": _params(1, {"kernel": (16, 32), "bias": (32,)}),
    "out": _params(2, {"kernel": (32, 4), "bias": (4,)}),
}
CNN_PARAMS = {
    "conv": _params(3, {"kernel": (3, 3, 3, 8), "bias": (8,)}),
    "dense": _params(4, {"kernel": (8, 10), "bias": (10,)}),
}


def mlp(params: Any, x: Any) -> Any:
    h = jnp.maximum(x @ params["hidden"]["kernel"] + params["hidden"]["bias"], 0)
    return h @ params["out"]["kernel"] + params["out"]["bias"]


def pool(params: Any, image: Any) -> Any:
    return image.mean(axis=(1, 2))


def cnn(params: Any, image: Any) -> Any:
    y = lax.conv_general_dilated(
        image, params["conv"]["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = jnp.maximum(y + params["conv"]["bias"], 0).mean(axis=(1, 2))
    return y @ params["dense"]["kernel"] + params["dense"]["bias"]


MODELS: dict[str, dict[str, Any]] = {
    "mlp": {
        "fn": mlp,
        "params": MLP_PARAMS,
        "inputs": [InputSpec("INPUT0", (16,), np.float32, letters="f")],
        "outputs": [OutputSpec("OUTPUT0", letters="k")],
        "batch_sizes": [1, 4, 8, 16],
        "description": "tabular MLP 16-32-4",
    },
    "cnn": {
        "fn": cnn,
        "params": CNN_PARAMS,
        "inputs": [InputSpec("IMAGE", (16, 16, 3), np.float32, letters="hwc")],
        "outputs": [OutputSpec("LOGITS", letters="k")],
        "batch_sizes": [1, 4],
        "description": "small CNN on 16x16 RGB images",
    },
    "pool": {
        "fn": pool,
        "params": {},
        "inputs": [InputSpec("IMAGE", (224, 224, 3), np.float32, letters="hwc")],
        "outputs": [OutputSpec("MEAN", letters="c")],
        "batch_sizes": [1, 8],
        "description": "per-channel mean of 224x224 RGB images: measures moving tensors, not compute",
    },
}


def reference(name: str, *inputs: np.ndarray) -> np.ndarray:
    """The model's JAX function run in-process on `inputs` (with the batch axis)."""
    spec = MODELS[name]
    return np.asarray(spec["fn"](spec["params"], *inputs))


def export_all(repository: Path = REPOSITORY) -> None:
    for name, spec in MODELS.items():
        export_bundle(
            spec["fn"],
            spec["params"],
            spec["inputs"],
            repository / name,
            batch_sizes=spec["batch_sizes"],
            outputs=spec["outputs"],
            description=spec["description"],
        )


if __name__ == "__main__":
    export_all(Path(sys.argv[1]) if len(sys.argv) > 1 else REPOSITORY)
