"""One ONNX model to a bundle: onnx2torch, then the torch.export exporter, then ONNX Runtime's word.

The ONNX graph is first checked against onnx2torch's converters, node by node, so that an operator
without one is named with its node before anything runs; constant Identity nodes over an
initializer (which torch's ONNX exporter writes for a shared weight, and which onnx2torch's Conv
and Gemm converters do not follow) become initializers. At each batch size the graph is made
static and folded, then converted by onnx2torch (`hloserve.importers._static_shapes`), and
exported by `hloserve.export.torch.export_torch_bundle`: an axis the ONNX model leaves dynamic
takes its size from the Triton config (or the caller), and one that neither fixes is refused; an
export that fails names the node it stopped at. The bundle is then run by the server's loader
in a fresh process (`hloserve.export.verification.verify_bundle`) on seeded random inputs at every
batch size and compared with ONNX Runtime on the original file
(`hloserve.importers.onnx_reference`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hloserve.importers._staging import write_staged
from hloserve.importers._static_shapes import static_module
from hloserve.importers.onnx_reference import OutputCheck, verify_against_onnxruntime
from hloserve.importers.triton_config import VARIABLE, NotConvertible, TensorPlan

__all__ = ["ImportedBundle", "import_onnx", "import_onnx_file", "onnx_signature", "random_array"]


@dataclass(frozen=True, slots=True)
class ImportedBundle:
    """A written bundle and how it compared with ONNX Runtime (empty when not verified)."""

    directory: Path
    batch_sizes: tuple[int, ...] | None
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    checks: tuple[OutputCheck, ...] = ()


def _onnx() -> Any:
    try:
        import onnx
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{e}: importing ONNX models needs the `onnx` extra (pip install 'hloserve[onnx]')", name=e.name
        ) from None
    return onnx


def onnx_signature(model: Any) -> tuple[list[TensorPlan], list[TensorPlan]]:
    """The graph's inputs (less initializers) and outputs, with -1 for every dynamic axis."""
    onnx = _onnx()
    initializers = {i.name for i in model.graph.initializer}

    def plan(value: Any) -> TensorPlan:
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise NotConvertible(f"ONNX value {value.name!r} is not a tensor (a sequence or map)")
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        except KeyError:
            raise NotConvertible(f"ONNX value {value.name!r} has element type {tensor.elem_type}") from None
        if dtype == np.dtype(object):
            raise NotConvertible(f"ONNX value {value.name!r} is a string tensor: an executable takes numbers")
        dims = tuple(d.dim_value if d.HasField("dim_value") else VARIABLE for d in tensor.shape.dim)
        return TensorPlan(value.name, dtype, dims if tensor.HasField("shape") else None)

    inputs = [plan(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [plan(v) for v in model.graph.output]


def import_onnx(
    onnx_file: Path,
    directory: Path,
    *,
    inputs: Sequence[TensorPlan] = (),
    outputs: Sequence[TensorPlan] = (),
    batch_sizes: Sequence[int] | None = (1,),
    platform: str = "cpu",
    verify: bool = True,
) -> ImportedBundle:
    """Convert `onnx_file` into the bundle `directory` (named after it) and verify it.

    `inputs`/`outputs` are the tensors clients see (a Triton config's): names and dtypes must be
    the ONNX model's, dims fill in its dynamic axes; empty means every tensor of the model, as it
    declares them. `outputs` may name a subset, in any order. `batch_sizes` are the compiled
    sizes (the ONNX model's first axis is the batch axis); None exports whole shapes with no
    batch axis (Triton's `max_batch_size: 0`).

    Raises:
        NotConvertible: an operator onnx2torch cannot convert (named with its node), a shape that
            cannot be made static, tensors unlike the model's, an export or verification failure.
    """
    onnx = _onnx()
    try:
        model = onnx.load(str(onnx_file))
    except Exception as e:
        raise NotConvertible(f"{onnx_file} is not a readable ONNX model: {e}") from None
    model = _fold_constant_identities(model)
    onnx_inputs, onnx_outputs = onnx_signature(model)
    batched = batch_sizes is not None
    resolved_inputs = _match(onnx_inputs, inputs, "input", batch_sizes, require_all=True)
    resolved_outputs = _match(onnx_outputs, outputs, "output", batch_sizes, require_all=False)
    _check_operators(model)
    sizes = tuple(sorted(batch_sizes)) if batch_sizes is not None else None
    selected = [onnx_outputs.index(_by_name(onnx_outputs, o.name)) for o in resolved_outputs]
    module = static_module(model, resolved_inputs, sizes, lambda static: _to_torch(static, selected))

    import torch

    from hloserve.export.jax import InputSpec, OutputSpec, VerificationError
    from hloserve.export.torch import export_torch_bundle

    rng = np.random.default_rng(0)
    rows = max(sizes) if sizes else None
    samples = [
        random_array(rng, t.dtype, ((rows,) if rows else ()) + tuple(t.dims or ())) for t in resolved_inputs
    ]
    try:
        export_torch_bundle(
            module,
            [torch.from_numpy(s[: sizes[0]] if sizes else s) for s in samples],
            directory,
            inputs=[
                InputSpec(t.name, tuple(t.dims or ()), t.dtype, format=t.format) for t in resolved_inputs
            ],
            outputs=[OutputSpec(t.name) for t in resolved_outputs],
            batch_sizes=sizes,
            batch_axis=batched,
            platform=platform,
            verify=False,  # compared with ONNX Runtime below, not with onnx2torch's module
        )
    except (ValueError, VerificationError) as e:
        raise NotConvertible(f"export failed{_at_node(e, module)}: {e}") from None
    except Exception as e:  # torchax or JAX failing on a converted operation, in its own words
        raise NotConvertible(f"export failed{_at_node(e, module)}: {type(e).__name__}: {e}") from e
    checks: tuple[OutputCheck, ...] = ()
    if verify:
        checks = verify_against_onnxruntime(
            onnx_file, directory, resolved_inputs, resolved_outputs, samples, sizes, platform
        )
    return ImportedBundle(directory, sizes, tuple(resolved_inputs), tuple(resolved_outputs), checks)


def import_onnx_file(
    onnx_file: Path,
    directory: Path,
    *,
    dims: Mapping[str, Sequence[int]] | None = None,
    batch_sizes: Sequence[int] | None = (1,),
    platform: str = "cpu",
    verify: bool = True,
) -> ImportedBundle:
    """`import_onnx` for one file as `hloserve import onnx` runs it: every tensor of the model,
    `dims` giving the sizes of inputs' dynamic axes (after the batch axis), written into a staging
    directory and moved to `directory` only once verified.

    Raises:
        NotConvertible: as `import_onnx`, or `dims` names no input of the model.
        FileExistsError: `directory` already exists.
        FileNotFoundError: `onnx_file` does not exist.
    """
    if not Path(onnx_file).is_file():
        raise FileNotFoundError(f"no file {str(onnx_file)!r}")
    onnx = _onnx()
    try:
        signature = onnx_signature(onnx.load(str(onnx_file), load_external_data=False))[0]
    except NotConvertible:
        raise
    except Exception as e:
        raise NotConvertible(f"not a readable ONNX model: {e}") from None
    dims = dict(dims or {})
    unknown = sorted(set(dims) - {t.name for t in signature})
    if unknown:
        raise NotConvertible(f"--dims names {unknown}, not inputs of the model {[t.name for t in signature]}")
    inputs = [TensorPlan(t.name, t.dtype, tuple(dims[t.name]) if t.name in dims else None) for t in signature]
    if Path(directory).exists():
        raise FileExistsError(f"{directory} already exists; remove it or choose another --out")
    return write_staged(
        Path(directory),
        lambda staged: dataclasses.replace(
            import_onnx(
                onnx_file, staged, inputs=inputs, batch_sizes=batch_sizes, platform=platform, verify=verify
            ),
            directory=Path(directory),
        ),
    )


def random_array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded test data: normal floats, 0 or 1 for integers (ids and indices stay in range)."""
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 2, shape).astype(dtype)
    return np.require(rng.standard_normal(shape).astype(dtype), requirements="C")


# --- matching the caller's tensors with the model's --------------------------------------------------


def _by_name(tensors: Sequence[TensorPlan], name: str) -> TensorPlan:
    return next(t for t in tensors if t.name == name)


def _match(
    model: Sequence[TensorPlan],
    given: Sequence[TensorPlan],
    kind: str,
    batch_sizes: Sequence[int] | None,
    *,
    require_all: bool,
) -> list[TensorPlan]:
    """The tensors as exported: the caller's names, dtypes and dims resolved against the model's."""
    names = [t.name for t in model]
    unknown = [t.name for t in given if t.name not in names]
    if unknown:
        raise NotConvertible(
            f"config {kind}(s) {unknown} are not in the ONNX model, whose {kind}s are {names}"
        )
    if require_all and given:
        missing = [n for n in names if n not in {t.name for t in given}]
        if missing:
            raise NotConvertible(f"the ONNX model's {kind}(s) {missing} are missing from the config")
    chosen = given or [TensorPlan(t.name, t.dtype, None) for t in model]  # the model's dims
    # inputs in the model's order (its torch module takes them so); outputs in the caller's
    ordered = [
        next(g for g in chosen if g.name == t.name) for t in model if t.name in {g.name for g in chosen}
    ]
    return [
        _resolve(_by_name(model, t.name), t, kind, batch_sizes) for t in (ordered if require_all else chosen)
    ]


def _resolve(
    model: TensorPlan, given: TensorPlan, kind: str, batch_sizes: Sequence[int] | None
) -> TensorPlan:
    where = f"{kind} {model.name!r}"
    if np.dtype(given.dtype) != np.dtype(model.dtype):
        raise NotConvertible(
            f"{where} is {model.dtype} in the ONNX model, {np.dtype(given.dtype)} in the config"
        )
    if kind == "output":
        # An output's shape is what the model computes: the ONNX file's declaration may be stale,
        # so the config's dims are checked against ONNX Runtime's results (onnx_reference).
        return TensorPlan(model.name, model.dtype, given.dims, None, given.labels)
    onnx_dims = model.dims
    if onnx_dims is None:
        if given.dims is None or VARIABLE in given.dims:
            raise NotConvertible(f"{where} has no shape in the ONNX model; give every size in the config")
        return given
    if batch_sizes is not None:
        if not onnx_dims:
            raise NotConvertible(
                f"{where} is a scalar in the ONNX model: it has no batch axis (max_batch_size 0)"
            )
        first, onnx_dims = onnx_dims[0], onnx_dims[1:]
        if first != VARIABLE and any(size != first for size in batch_sizes):
            raise NotConvertible(
                f"{where} has a fixed first axis of {first} in the ONNX model, so it cannot run the batch "
                f"sizes {sorted(batch_sizes)}; re-export it with a dynamic batch axis, or max_batch_size 0"
            )
    dims = given.dims if given.dims is not None else onnx_dims
    if len(dims) != len(onnx_dims):
        raise NotConvertible(
            f"{where} has {len(onnx_dims)} axes{' after the batch axis' if batch_sizes is not None else ''} "
            f"in the ONNX model {list(onnx_dims)}, the config gives dims {list(dims)}"
        )
    static = []
    for axis, (size, onnx_size) in enumerate(zip(dims, onnx_dims, strict=True)):
        if size != VARIABLE and onnx_size != VARIABLE and size != onnx_size:
            raise NotConvertible(
                f"{where} axis {axis} is {onnx_size} in the ONNX model, {size} in the config"
            )
        if size == VARIABLE and onnx_size == VARIABLE:
            raise NotConvertible(
                f"{where} axis {axis} is dynamic in both the ONNX model and the config (dims "
                f"{list(dims)}): hloserve compiles static shapes; give its size in config.pbtxt's dims"
            )
        static.append(onnx_size if size == VARIABLE else size)
    return TensorPlan(model.name, model.dtype, tuple(static), given.format, given.labels)


# --- ONNX to torch -------------------------------------------------------------------------------------


def _fold_constant_identities(model: Any) -> Any:
    """Identity nodes over an initializer become initializers of their own (torch's exporter writes
    them for a weight shared by two layers; onnx2torch's Conv wants its bias as an initializer)."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    keep = []
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in initializers and node.output[0] not in outputs:
            folded = copy.deepcopy(initializers[node.input[0]])
            folded.name = node.output[0]
            graph.initializer.append(folded)
            initializers[folded.name] = folded
        else:
            keep.append(node)
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)
    return model


def _node_name(node: Any) -> str:
    if node.name:
        return str(node.name)
    return f"(unnamed, output {node.output[0]})" if node.output else "(unnamed)"


def _check_operators(model: Any) -> None:
    """Every node has an onnx2torch converter; else name the first few that do not."""
    _import_onnx2torch()
    from onnx2torch.node_converters.registry import get_converter

    opsets = {o.domain or "": o.version for o in model.opset_import}
    missing: list[str] = []
    for node in model.graph.node:
        domain = node.domain or ""
        try:
            get_converter(operation_type=node.op_type, version=opsets.get(domain, 1), domain=domain)
        except NotImplementedError:
            op = f"{domain}::{node.op_type}" if domain else node.op_type
            missing.append(f"{op} (opset {opsets.get(domain, '?')}) at node {_node_name(node)!r}")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise NotConvertible(
            f"unsupported operator: {'; '.join(missing[:3])}{more} (onnx2torch has no converter)"
        )


def _import_onnx2torch() -> Any:
    from hloserve.export._torchvision import prepare_torchvision_import

    prepare_torchvision_import()  # onnx2torch imports torchvision; beside a CPU torch it needs this
    import onnx2torch

    return onnx2torch


def _to_torch(model: Any, selected: Sequence[int]) -> Any:
    """onnx2torch's module, returning the `selected` ONNX outputs as a tuple."""
    import torch

    onnx2torch = _import_onnx2torch()
    try:
        converted = onnx2torch.convert(model)
    except Exception as e:
        node = _failing_node(sys.exc_info()[2])
        at = f" at node {node}" if node else ""
        raise NotConvertible(f"onnx2torch cannot convert the model{at}: {type(e).__name__}: {e}") from None

    class Selected(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = converted

        def forward(self, *args: Any) -> tuple[Any, ...]:
            result = self.model(*args)
            result = tuple(result) if isinstance(result, tuple | list) else (result,)
            return tuple(result[k] for k in selected)

    return Selected().eval()


def _failing_node(traceback: Any) -> str | None:
    """The ONNX node onnx2torch's `convert` was converting when it raised (its frame's locals)."""
    name = None
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == "convert" and "onnx_node" in frame.f_locals:
            node = frame.f_locals["onnx_node"]
            name = f"{getattr(node, 'name', None)!r} ({getattr(node, 'operation_type', '?')})"
        traceback = traceback.tb_next
    return name


def _at_node(error: BaseException, module: Any) -> str:
    """` at node 'NAME' (OP)`: the converted ONNX node whose forward `error` (or its cause) was
    raised in (the innermost); onnx2torch names each module after its node. Empty if none."""
    owners = {id(m): name for name, m in module.named_modules() if name}
    found = None
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback = error.__traceback__
        while traceback is not None:
            owner = traceback.tb_frame.f_locals.get("self")
            if id(owner) in owners:
                found = (owners[id(owner)], type(owner).__name__.removeprefix("Onnx"))
            traceback = traceback.tb_next
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    if found is None:
        return ""
    name, op = found
    return f" at node {name.rsplit('.', 1)[-1]!r} ({op})"
