"""Export a PyTorch module as a bundle: torch.export, then torchax to JAX, then the JAX writer.

torch.export traces the module at each batch size (static shapes); `hloserve.export._torch_lowering`
turns each exported program into a JAX function of (weights, inputs) with torchax's lowerings,
which `hloserve.export.jax.export_bundle` re-traces inputs first and weights last (the bundle's
order), writes, and verifies against the torch module itself. Pinned by the `torch` extra:
torch 2.13.0 and torchax 0.0.13.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.utils._pytree as pytree

from hloserve.export._torch_lowering import LoweringError, Lowerings, import_torchax, lower_program, quiet
from hloserve.export._torchvision import prepare_torchvision_import
from hloserve.export.jax import UNBATCHED, InputSpec, OutputSpec, Traceable, _check_batch_sizes, export_bundle

__all__ = ["LoweringError", "export_torch_bundle", "prepare_torchvision_import"]

_BITS = {  # torch dtypes numpy lacks: moved through an integer view of the same width
    torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


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


def _output_names(program: torch.export.ExportedProgram) -> list[str] | None:
    """The outputs' names where the module returns a dict (its keys; nested keys joined with
    '.', sequence positions by their index), else None (the default `output_0`, ...)."""
    spec = program.call_spec.out_spec
    if spec is None:
        return None
    structure = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths = [path for path, _ in pytree.tree_flatten_with_path(structure)[0]]
    if not any(isinstance(key, pytree.MappingKey) for path in paths for key in path):
        return None

    def part(key: Any) -> str:
        return str(key.key if isinstance(key, pytree.MappingKey) else getattr(key, "idx", key))

    return [".".join(part(key) for key in path) for path in paths]


def _to_jax(
    module: torch.nn.Module,
    examples: Sequence[np.ndarray],
    size: int,
    lowerings: Lowerings | None,
    prepare: bool = True,
    keep: Collection[str] = (),
) -> tuple[list[str], list[Any], Any, list[str] | None, dict[str, Any]]:
    """torch.export at one batch size, then lowered: weight names, their tensors, the JAX
    function, the outputs' names if the module returns a dict, and how the weights were
    prepared (provenance entries)."""
    rows = tuple(_to_torch(a[np.arange(size) % len(a)] if size != UNBATCHED else a) for a in examples)
    try:
        with quiet():
            program = torch.export.export(module, rows)
    except Exception as e:
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        raise ValueError(
            f"torch.export cannot trace {type(module).__name__} at batch size {size}: {cause}"
        ) from e
    names, states, function, prepared = lower_program(program, lowerings, prepare, keep)
    return names, list(states), function, _output_names(program), prepared


def _weights_key(lowered: tuple[list[str], list[Any], Any, Any, dict[str, Any]]) -> str:
    """What must agree between batch sizes for one weights file to serve them all."""
    names, states, _, _, prepared = lowered
    return repr((names, [tuple(s.shape) for s in states], sorted(prepared.items())))


def export_torch_bundle(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    directory: Path,
    *,
    inputs: Sequence[InputSpec] | None = None,
    batch_sizes: Sequence[int] | None = None,
    batch_axis: bool = True,
    lowerings: Lowerings | None = None,
    **options: Any,
) -> Path:
    """Export `module(*example_inputs)` (in eval mode) as the bundle `directory`; returns it.

    `example_inputs` has one tensor per input, each with a leading batch axis of any size: they
    fix shapes and dtypes, their rows are repeated to fill each batch size for torch.export, and
    they are what verification runs unless `sample_inputs` is given (with `batch_axis=False`
    they are whole inputs, traced as they are, and the bundle has no batch axis). `inputs`
    names them and sets their letters (default `input_0`, `input_1`... with generated letters). Weights are
    named by the module's state (`conv.weight`, `head.bias`) in torch.export's argument
    order (parameters, then buffers and lifted constants), then the shifts of the batch norms
    folded into their convolutions (`bn.bias`); convolution and linear weights are stored
    transposed (`hloserve.export._torch_weights`); a 0-dim float64 one is demoted to
    float32, as x64 would otherwise promote the f32 computation it meets. Outputs are named by
    `outputs` if given, else by the keys of a dict the module returns (nested keys joined with
    '.'), else `output_0`, `output_1`... in torch.export's order. `lowerings` maps an
    ATen operation torchax cannot lower (`torch.ops.aten.foo.default`) to a JAX function of
    its arguments, used instead of torchax's. Other keyword options are
    `hloserve.export.jax.export_bundle`'s (`outputs`, `platform`, `module_format`, `verify`, ...).

    Raises:
        ValueError: torch.export cannot trace the module (for one, it branches on input values);
            or as `export_bundle`.
        LoweringError: (a ValueError) an operation has no JAX lowering or its lowering fails;
            it names the operation and the model's source line.
        hloserve.export.jax.VerificationError: the bundle does not reproduce the torch module.
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
        lowered = {size: _to_jax(module, examples, size, lowerings) for size in sizes}
        if len({_weights_key(found) for found in lowered.values()}) > 1:
            # a module whose batch sizes read different weights (an ONNX import's one model per
            # size, sharing what is equal): each size stores what any size reads
            read = {name for found in lowered.values() for name in found[0]}
            lowered = {size: _to_jax(module, examples, size, lowerings, keep=read) for size in sizes}
        if len({_weights_key(found) for found in lowered.values()}) > 1:
            # weights prepared for one size would not be the others' (a weight one size transposes
            # and another reads as it is): none are
            lowered = {size: _to_jax(module, examples, size, lowerings, prepare=False) for size in sizes}
        names, states, _, output_names, prepared = lowered[sizes[0]]
        if output_names is not None and options.get("outputs") is None:
            options["outputs"] = [OutputSpec(name) for name in output_names]
        weights = [_to_numpy(s) for s in states]
        weights = [w.astype(np.float32) if w.ndim == 0 and w.dtype == np.float64 else w for w in weights]

        def function_for(size: int) -> Callable[..., Any]:
            again, _, function, _, _ = lowered[size]
            if again != names:
                raise ValueError(
                    f"torch.export names the weights {again} at batch size {size}, {names} before"
                )

            def flat(*args: Any) -> Any:
                return function(list(args[n_inputs:]), tuple(args[:n_inputs]))

            return flat

        def reference(*arrays: np.ndarray) -> list[np.ndarray]:
            with torch.no_grad():
                result = module(*(_to_torch(a) for a in arrays))
            return [_to_numpy(t) for t in pytree.tree_leaves(result)]  # a dict's values, in order

        torchax = import_torchax()
        versions = {
            "torch_version": str(torch.__version__),
            "torchax_version": str(torchax.__version__),
            **prepared,
        }
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
