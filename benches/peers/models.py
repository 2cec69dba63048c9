"""The models every peer serves, written once so that all peers compute exactly the same thing.

A `PeerModel` is a numpy function body plus the safetensors file its weights come from: the
example bundles' weights and maths, not a look-alike. Each peer runs the body in its own venv
(Triton's Python backend, an MLServer runtime, a KServe `Model`) through `compile_model`, so this
module imports nothing but numpy and the standard library at the top; peers load it by file path.
`reference` runs the same body here, to check what a peer answers.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE_FLOATS = 2 << 20  # 8 MB of float32 per catalogue model, as benches/weight_cache.py


@dataclass(frozen=True)
class PeerModel:
    """One FP32 model: a single input and output, a leading batch axis up to `max_batch`.

    `body` is the body of `def run(x)`, returning `y`; it sees `np` and `WEIGHTS` (the tensors
    of `weights`, or an empty dict when that is None).
    """

    name: str
    input: str
    output: str
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    max_batch: int
    body: str
    weights: str | None = None


def load_weights(path: str | None) -> dict[str, np.ndarray]:
    if path is None:
        return {}
    from safetensors.numpy import load_file

    return load_file(path)


def compile_model(body: str, weights: str | None) -> Callable[[np.ndarray], np.ndarray]:
    """The body as a function of a batch `x`, its weights loaded once."""
    namespace = {"np": np, "WEIGHTS": load_weights(weights)}
    exec("def run(x):\n" + textwrap.indent(body, "    "), namespace)
    return namespace["run"]  # type: ignore[return-value]


def reference(model: PeerModel, x: np.ndarray) -> np.ndarray:
    """What a correct peer answers for `x`, computed in-process."""
    return compile_model(model.body, model.weights)(x)


def sample(model: PeerModel, batch: int = 1, seed: int = 0) -> np.ndarray:
    """A deterministic FP32 input batch for `model`."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, *model.in_dims)).astype(np.float32)


# the example mlp (examples/repository/mlp): 16 -> 32 relu -> 4
MLP = PeerModel(
    "mlp",
    "INPUT0",
    "OUTPUT0",
    (16,),
    (4,),
    16,
    "h = np.maximum(x @ WEIGHTS['hidden.kernel'] + WEIGHTS['hidden.bias'], 0)\n"
    "return (h @ WEIGHTS['out.kernel'] + WEIGHTS['out.bias']).astype(np.float32)",
    str(ROOT / "examples" / "repository" / "mlp" / "weights.safetensors"),
)

# the example pool: per-channel mean of 224x224x3 images (max batch 128 so that one request can
# carry the 104-107 images that benches send, which hloserve splits into executions)
POOL = PeerModel(
    "pool", "IMAGE", "MEAN", (224, 224, 3), (3,), 128, "return x.mean(axis=(1, 2)).astype(np.float32)"
)


def catalogue(directory: str | Path, n: int = 10) -> list[PeerModel]:
    """n models m0..m{n-1} with 8 MB of weights each: y = x @ eye(16, 4) + i.

    The maths and names of benches/weight_cache.py's bundles (input INPUT0, output output_0), so a
    peer holds as many weight bytes as hloserve does. Max batch 16 is our choice (hloserve's
    bundles are compiled for batch 1 only and split larger requests).
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    models = []
    for i in range(n):
        path = directory / f"m{i}.safetensors"
        if not path.exists():
            big = np.full(CATALOGUE_FLOATS, i, np.float32)
            partial = path.with_suffix(".partial")
            save_file({"big": big, "w": np.eye(16, 4, dtype=np.float32)}, str(partial))
            partial.replace(path)  # never a half-written file under the final name
        body = "return x @ WEIGHTS['w'] + WEIGHTS['big'][:4]"
        models.append(PeerModel(f"m{i}", "INPUT0", "output_0", (16,), (4,), 16, body, str(path)))
    return models
