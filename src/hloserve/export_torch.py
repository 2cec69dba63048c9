"""Export a PyTorch module as a bundle: torch.export, then torchax to JAX, then the JAX writer.

torch.export traces the module at each batch size (static shapes); torchax turns each exported
program into a JAX function of (weights, inputs), which `hloserve.export.export_bundle` re-traces
inputs first and weights last (the bundle's order), writes, and verifies against the torch
module itself. Pinned by the `torch` extra: torch 2.13.0 and torchax 0.0.13, which needs the
import shim below.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from hloserve.export import UNBATCHED, InputSpec, Traceable, _check_batch_sizes, export_bundle

__all__ = ["export_torch_bundle"]

_REMOVED_OVERLOAD = re.compile(r"(?:^|_)(?:dimname|Dimname|names)(?:_|$)")
_BITS = {  # torch dtypes numpy lacks: moved through an integer view of the same width
    torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


class _RemovedOverload:
    """Stands for a named-tensor overload that torch 2.13 removed. It is not an OpOverload, so
    torchax's decomposition table and AMP policy, the two places that name it, pass over it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


@functools.cache
def _import_torchax() -> Any:
    """Import torchax, tolerating the named-tensor overloads that torch 2.13 removed.

    torchax 0.0.13 names 22 of them (`aten.prod.dim_Dimname`, `aten.std.names_dim`...) at import
    time, so `import torchax` raises AttributeError under torch 2.13. While it imports, and only
    then, looking up such an overload gives a `_RemovedOverload` instead; no other lookup changes.
    A torchax that no longer names them imports as usual.
    """
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def lenient(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if _REMOVED_OVERLOAD.search(key):
                return _RemovedOverload(f"{self}.{key}")
            raise

    setattr(packet, "__getattr__", lenient)  # noqa: B010  # mypy refuses assigning to a method
    try:
        import torchax
        import torchax.export
    finally:
        setattr(packet, "__getattr__", original)  # noqa: B010
    return torchax


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchax 0.0.13 still uses torch's deprecated `LeafSpec`; that warning is not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
        yield


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype in _BITS:
        bits, dtype = _BITS[tensor.dtype]
        return tensor.view(bits).numpy().view(dtype)
    return tensor.numpy()


def _to_torch(array: np.ndarray) -> torch.Tensor:
    for torch_dtype, (_, dtype) in _BITS.items():
        if array.dtype == dtype:
            return torch.from_numpy(np.array(array).view(f"u{np.dtype(dtype).itemsize}")).view(torch_dtype)
    return torch.from_numpy(np.array(array))  # a writable copy: torch warns on read-only arrays


def _to_jax(
    module: torch.nn.Module, examples: Sequence[np.ndarray], size: int
) -> tuple[list[str], list[Any], Any]:
    """torch.export at one batch size, then torchax: weight names, their tensors, the JAX function."""
    torchax = _import_torchax()
    rows = tuple(_to_torch(a[np.arange(size) % len(a)] if size != UNBATCHED else a) for a in examples)
    try:
        with _quiet():
            program = torch.export.export(module, rows)
    except Exception as e:
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        raise ValueError(
            f"torch.export cannot trace {type(module).__name__} at batch size {size}: {cause}"
        ) from e
    torchax.default_env()  # export_raw skips creating it, and lowering needs it
    with _quiet():
        names, states, function = torchax.export.exported_program_to_jax(program, export_raw=True)
    # torchax appends the lifted tensor constants' values without their names.
    names = [*names, *program.graph_signature.lifted_tensor_constants]
    return names, list(states), function


def export_torch_bundle(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    directory: Path,
    *,
    inputs: Sequence[InputSpec] | None = None,
    batch_sizes: Sequence[int] | None = None,
    batch_axis: bool = True,
    **options: Any,
) -> Path:
    """Export `module(*example_inputs)` (in eval mode) as the bundle `directory`; returns it.

    `example_inputs` has one tensor per input, each with a leading batch axis of any size: they
    fix shapes and dtypes, their rows are repeated to fill each batch size for torch.export, and
    they are what verification runs unless `sample_inputs` is given (with `batch_axis=False`
    they are whole inputs, traced as they are, and the bundle has no batch axis). `inputs`
    names them and sets their letters (default `input_0`, `input_1`... with generated letters). Weights are
    named by the module's state (`conv.weight`, `bn.running_mean`) in torch.export's order:
    parameters, buffers, lifted constants; a 0-dim float64 one is demoted to float32, as x64
    would otherwise promote the f32 computation it meets. Other keyword options are
    `hloserve.export.export_bundle`'s (`outputs`, `platform`, `module_format`, `verify`, ...).

    Raises:
        ValueError: torch.export cannot trace the module (for one, it branches on input values)
            or torchax cannot lower one of its operations; or as `export_bundle`.
        hloserve.export.VerificationError: the bundle does not reproduce the torch module.
    """
    examples = [_to_numpy(t) for t in example_inputs]
    skip = 1 if batch_axis else 0  # the batch axis, not part of an input's shape
    specs = (
        list(inputs)
        if inputs is not None
        else [InputSpec(f"input_{k}", a.shape[skip:], a.dtype) for k, a in enumerate(examples)]
    )
    for k, (spec, array) in enumerate(zip(specs, examples, strict=True)):
        if tuple(spec.shape) != array.shape[skip:] or np.dtype(spec.dtype) != array.dtype:
            raise ValueError(
                f"input {k} ({spec.name!r}) is {np.dtype(spec.dtype)}{list(spec.shape)} but its example "
                f"is {array.dtype}{list(array.shape[skip:])}{' (after the batch axis)' if skip else ''}"
            )
    if not batch_axis and batch_sizes is not None:
        raise ValueError("batch_sizes need a batch axis; a bundle with batch_axis=False has one module")
    sizes = _check_batch_sizes(batch_sizes or (1,)) if batch_axis else [UNBATCHED]
    n_inputs = len(specs)
    was_training = module.training
    module.eval()
    try:
        names, states, first = _to_jax(module, examples, sizes[0])
        weights = [_to_numpy(s) for s in states]
        weights = [w.astype(np.float32) if w.ndim == 0 and w.dtype == np.float64 else w for w in weights]

        def function_for(size: int) -> Callable[..., Any]:
            function = first
            if size != sizes[0]:
                again, _, function = _to_jax(module, examples, size)
                if again != names:
                    raise ValueError(
                        f"torch.export names the weights {again} at batch size {size}, {names} before"
                    )

            def flat(*args: Any) -> Any:
                try:
                    with _quiet():
                        return function(list(args[n_inputs:]), tuple(args[:n_inputs]))
                except AssertionError as e:  # torchax's way of saying it has no lowering for an op
                    raise ValueError(
                        f"torchax cannot lower {type(module).__name__}: no JAX lowering for {e}"
                    ) from e

            return flat

        def reference(*arrays: np.ndarray) -> list[np.ndarray]:
            with torch.no_grad():
                result = module(*(_to_torch(a) for a in arrays))
            return [_to_numpy(t) for t in (result if isinstance(result, tuple | list) else (result,))]

        torchax = _import_torchax()
        versions = {"torch_version": str(torch.__version__), "torchax_version": str(torchax.__version__)}
        traceable = Traceable("torch", names, weights, function_for, reference, versions)
        options.setdefault("sample_inputs", examples)
        return export_bundle(
            traceable,
            None,
            specs,
            directory,
            batch_sizes=sizes if batch_axis else None,
            batch_axis=batch_axis,
            **options,
        )
    finally:
        module.train(was_training)
