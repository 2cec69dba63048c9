"""Regenerate the example repository: `python examples/export_examples.py [OUT]`.

Two small models with fixed weights, exported with hloserve's own JAX exporter:

* `mlp`: tabular, `INPUT0` FP32 [batch, 16] → 32 relu → `OUTPUT0` FP32 [batch, 4]; sizes 1, 4, 8, 16.
* `pool`: an almost free model for transfer costs, `IMAGE` FP32 [batch, 224, 224, 3] → per-channel
  mean `MEAN` FP32 [batch, 3]; sizes 1, 8 (8 images are a 4.8 MB request).
* `cnn`: vision, `IMAGE` FP32 [batch, 16, 16, 3] (NHWC) → 3x3 conv, 8 channels, relu → global
  average pool → dense → `LOGITS` FP32 [batch, 10]; sizes 1, 4.
* `severity_grader`: ReactantServer.jl's example. `INPUT__0` UINT8 [batch, 224, 224] → 8x8 mean pool →
  dense → CORAL ordinal logits `OUTPUT__0` FP32 [batch, 9]; its hand-written `model.py` turns
  them into `grade` INT64 [batch, 1] with an early-break loop; sizes 1, 3, 6.

The functions and parameters are importable, so tests compare the server with JAX in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

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

SEVERITY_PARAMS = {
    "kernel": np.random.RandomState(5).standard_normal((784, 9)).astype(np.float32),
    "bias": np.linspace(2.5, -2.5, 9, dtype=np.float32),
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


def severity(params: Any, image: Any) -> Any:
    x = image.astype(jnp.float32) / 255.0 - 0.5
    pooled = x.reshape(x.shape[0], 28, 8, 28, 8).mean(axis=(2, 4)).reshape(x.shape[0], 784)
    return pooled @ params["kernel"] + params["bias"]


def grades(logits: np.ndarray) -> np.ndarray:
    """The severity grade of each row: how many leading logits are above zero (int64 [B, 1])."""
    positive = np.asarray(logits) > 0
    return np.cumprod(positive, axis=1).sum(axis=1, dtype=np.int64)[:, None]


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
    "severity_grader": {
        "fn": severity,
        "params": SEVERITY_PARAMS,
        "inputs": [InputSpec("INPUT__0", (224, 224), np.uint8, letters="hw")],
        "outputs": [OutputSpec("OUTPUT__0", letters="z")],
        "batch_sizes": [1, 3, 6],
        "description": "ReactantServer.jl's severity grader: CORAL logits, graded by model.py",
        "client_outputs": [InputSpec("grade", (1,), np.int64, letters="y")],  # made by its model.py
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
            client_outputs=spec.get("client_outputs"),
            # the hand-written model.py kept in the shipped bundle
            model_py=REPOSITORY / name / "model.py" if "client_outputs" in spec else None,
            tune=False,  # shipped for any CPU: XLA's defaults, not options timed on this one
        )


if __name__ == "__main__":
    export_all(Path(sys.argv[1]) if len(sys.argv) > 1 else REPOSITORY)
