"""Write a server-loadable bundle from a JAX function and its parameters.

`export_bundle(fn, params, inputs, directory)` traces `fn(params, *inputs)` once per batch
size and writes the seeds' format: `model.b{N}.mlir` (StableHLO text) taking the inputs first
and the weights last, one `weights.safetensors` with `argument_order`, and `manifest.yaml` with
column-major letter shapes (batch letter `n` last). The traps measured in
research/spike_jax.md are handled here: x64 on so int64 stays int64, `keep_unused=True` so no
weight is pruned from the signature, no donation, and weights saved C-contiguous with mode 0644.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hloserve import _xla, dtypes

__all__ = ["InputSpec", "OutputSpec", "export_bundle"]

jax = _xla.jax
_LETTERS = [c for c in string.ascii_lowercase if c not in "nb"]


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input: its name, its shape without the batch axis (row-major), its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: Any = np.float32
    """A numpy dtype (or anything `np.dtype` takes; ml_dtypes for bf16 and fp8), not a token."""
    letters: str | None = None
    """Manifest letters for the non-batch axes in row-major order; generated when None."""


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output: its name and optional letters (row-major, no batch); shape and dtype are traced."""

    name: str
    letters: str | None = None


def _letters(given: str | None, rank: int, where: str) -> str:
    letters = given if given is not None else "".join(_LETTERS[:rank])
    if len(letters) != rank or len(set(letters)) != rank or set(letters) & set("nb"):
        raise ValueError(f"{where}: letters {letters!r} must be {rank} distinct letters other than n and b")
    return letters


def _tensor(name: str, dtype: Any, shape: tuple[int, ...], letters: str) -> dict[str, Any]:
    """A manifest tensor: letters reversed to column-major, batch axis `n` last."""
    return {
        "name": name,
        "dtype": dtypes.by_numpy(np.dtype(dtype)).token,
        "shape": letters[::-1] + "n",
        "dims": dict(zip(letters, shape, strict=True)),
    }


def _weight_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(part))
    return ".".join(parts)


def export_bundle(
    fn: Callable[..., Any],
    params: Any,
    inputs: Sequence[InputSpec],
    directory: Path,
    *,
    name: str | None = None,
    batch_sizes: Sequence[int] = (1,),
    outputs: Sequence[OutputSpec] | None = None,
    platform: str = "cpu",
    description: str = "",
) -> Path:
    """Export `fn(params, *inputs)` as the bundle `directory`; returns the directory.

    Every input and output gets a leading batch axis; `platform` is `cpu` or `cuda` (modules
    are lowered for it; no GPU is needed to lower for cuda, and a module lowered for one
    platform may not run on the other). `name` defaults to the directory's name and must equal
    it: the server names a bundle after its directory, so a different name could never load.
    """
    directory = Path(directory)
    if name is not None and name != directory.name:
        raise ValueError(f"bundle name {name!r} must equal its directory's name {directory.name!r}")
    sizes = sorted(batch_sizes)
    if not sizes or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct positive integers, got {list(batch_sizes)}")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    treedef = jax.tree_util.tree_structure(params)
    names = [_weight_name(path) for path, _ in leaves]
    weights = [np.require(np.asarray(leaf), requirements="C") for _, leaf in leaves]
    n_inputs = len(inputs)

    def flat(*args: Any) -> Any:
        tree = jax.tree_util.tree_unflatten(treedef, args[n_inputs:])
        result = fn(tree, *args[:n_inputs])
        return tuple(result) if isinstance(result, tuple | list) else (result,)

    weight_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    directory.mkdir(parents=True, exist_ok=True)
    jitted = jax.jit(flat, keep_unused=True)
    out_shapes: list[Any] = []
    for size in sizes:
        in_specs = [jax.ShapeDtypeStruct((size, *i.shape), np.dtype(i.dtype)) for i in inputs]
        out_shapes = list(jax.eval_shape(flat, *in_specs, *weight_specs))
        for k, out in enumerate(out_shapes):
            if not out.shape or out.shape[0] != size:
                raise ValueError(
                    f"output {k} has shape {out.shape}; hloserve needs a leading batch axis of {size}"
                )
        text = jitted.trace(*in_specs, *weight_specs).lower(lowering_platforms=(platform,)).as_text()
        (directory / f"model.b{size}.mlir").write_text(text)
    out_specs = (
        list(outputs) if outputs is not None else [OutputSpec(f"output_{k}") for k in range(len(out_shapes))]
    )
    if len(out_specs) != len(out_shapes):
        raise ValueError(f"{len(out_specs)} output names for {len(out_shapes)} outputs")
    manifest = {
        "format_version": "2.0",
        "name": directory.name,
        "description": description,
        "executable_inputs": [
            _tensor(i.name, i.dtype, i.shape, _letters(i.letters, len(i.shape), i.name)) for i in inputs
        ],
        "executable_outputs": [
            _tensor(o.name, s.dtype, s.shape[1:], _letters(o.letters, len(s.shape) - 1, o.name))
            for o, s in zip(out_specs, out_shapes, strict=True)
        ],
        "batching": {"compiled_batch_sizes": sizes},
        "provenance": {"exporter": "hloserve.export", "jax_version": jax.__version__, "platform": platform},
    }
    (directory / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    weights_path = directory / "weights.safetensors"
    if weights:
        from safetensors.numpy import save_file

        save_file(
            dict(zip(names, weights, strict=True)),
            str(weights_path),
            metadata={"argument_order": json.dumps(names)},
        )
        weights_path.chmod(0o644)
    return directory
