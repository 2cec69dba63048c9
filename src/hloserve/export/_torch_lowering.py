"""A torch.export program as a JAX function: torchax's ATen lowerings, run by hloserve's own
interpreter.

torchax 0.0.13's `exported_program_to_jax` is replaced here, for three reasons:

- **Weights in the program's own order.** torchax binds parameters, then buffers, then lifted
  constants; torch 2.13 interleaves buffers and lifted constants (Swin-T: each attention
  block's constants sit between its buffers), so torchax fed `relative_position_index` where a
  scalar constant belonged (Swin-T's "Incompatible types for broadcasting: input
  type=int64[2401] and requested type=int64[49,49]" on `aten.copy`). Here every placeholder
  gets the value its `input_specs` entry names.
- **Compact programs.** `aten.linear` and `aten.matmul` are kept whole instead of decomposed:
  on a non-contiguous 3-D input (ViT's attention in-projection) torch's decomposition expands
  the weight to one copy per token and runs `bmm`, which XLA materializes (1.39 GB per layer
  in ViT-B/16 at batch 4). Their lowerings contract the weight as a 2-D operand. Bilinear
  upsampling is kept whole too: its decomposition gathers every output pixel's four corners.
- **Errors a user can act on.** An operation without a lowering, or whose lowering fails, is
  named with the model's source line and what to do (`lowerings=` below).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from hloserve.export import _channels_last as channels_last
from hloserve.export import _torch_constants, _torch_weights
from hloserve.models import _xla

__all__ = ["LoweringError", "Lowerings", "import_torchax", "lower_program", "quiet"]

jax, jnp = _xla.jax, _xla.jnp

Lowerings = Mapping[Any, Callable[..., Any]]
"""ATen operation (`torch.ops.aten.foo.default` or the packet `torch.ops.aten.foo`) → a JAX
function of the same arguments (JAX arrays where the op takes tensors)."""

_BATCH_NORM = torch.ops.aten._native_batch_norm_legit_no_training.default
_MAX_POOL = torch.ops.aten.max_pool2d_with_indices.default
_CAT = torch.ops.aten.cat.default
_AVG_POOL = torch.ops.aten.avg_pool2d.default
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)
_REMOVED_OVERLOAD = re.compile(r"(?:^|_)(?:dimname|Dimname|names)(?:_|$)")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)$')
_ISSUES = "https://github.com/google/torchax/issues"


class LoweringError(ValueError):
    """An operation of a torch.export program has no JAX lowering, or its lowering fails.

    Raised while the exporter traces the program, before anything is written; the message names
    the operation, the model's source line that called it and what to do.
    """

    def __init__(self, operation: str, node: torch.fx.Node, cause: str) -> None:
        self.operation = operation
        self.source = _source_line(node)
        super().__init__(
            f"cannot lower {operation} (graph node {node.name}) called at {self.source}: {cause}. "
            f"Rewrite that line with other torch operations, or pass export_torch_bundle "
            f"lowerings={{torch.ops.{operation}: fn}} with a JAX function of the same arguments "
            f"(a SPEC may return 'lowerings'); torchax's missing lowerings are tracked at {_ISSUES}"
        )


def _source_line(node: torch.fx.Node) -> str:
    """`file:line in function (`code`)` of the innermost frame torch.export recorded for `node`."""
    lines = str(node.meta.get("stack_trace") or "").splitlines()
    for k in range(len(lines) - 1, -1, -1):
        frame = _FRAME.match(lines[k])
        if frame:
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            where = f"{frame['file']}:{frame['line']} in {frame['function']}"
            return f"{where} (`{code}`)" if code else where
    return "an unknown line (torch.export recorded no stack trace)"


class _RemovedOverload:
    """Stands for a named-tensor overload that torch 2.13 removed. It is not an OpOverload, so
    torchax's decomposition table and AMP policy, the two places that name it, pass over it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


@functools.cache
def import_torchax() -> Any:
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
def quiet() -> Iterator[None]:
    """torchax 0.0.13 still uses torch's deprecated `LeafSpec`; that warning is not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
        yield


# --- lowerings hloserve provides over torchax's ---------------------------------------------------


def _contract_last(x: Any, weight_t: Any) -> Any:
    """`x @ weight_t` for a 2-D `weight_t`, contracting x's last axis: one dot, no broadcast."""
    return jax.lax.dot_general(x, weight_t, (((x.ndim - 1,), (0,)), ((), ())))


def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    dtype = jnp.result_type(x, weight)
    y = _contract_last(x.astype(dtype), weight.astype(dtype).T) if x.ndim >= 1 else x * weight
    return y if bias is None else y + bias


def _matmul(x: Any, y: Any) -> Any:
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim >= 2 and y.ndim == 2:  # a weight: never broadcast over x's leading axes
        dtype = jnp.result_type(x, y)
        return _contract_last(x.astype(dtype), y.astype(dtype))
    return jnp.matmul(x, y)


def _gelu(x: Any, *, approximate: str = "none") -> Any:
    """GELU as torch's CPU kernel computes it, `x/2 (1 + erf(x/sqrt(2)))`: `jax.nn.gelu` goes
    through erfc, which XLA:CPU computed 5x slower than erf (ConvNeXt-T: 60 ms a batch of 4)."""
    x = jnp.asarray(x)
    if approximate == "tanh":
        return jax.nn.gelu(x, approximate=True)
    return x * 0.5 * (1 + jax.lax.erf(x * (2**-0.5)))


def _upsample_bilinear(
    x: Any, output_size: Sequence[int], align_corners: bool, scales_h: Any = None, scales_w: Any = None
) -> Any:
    return channels_last.upsample_bilinear(x, output_size, align_corners, (scales_h, scales_w))


def _upsample_bilinear_vec(x: Any, output_size: Any, align_corners: bool, scale_factors: Any) -> Any:
    return channels_last.upsample_bilinear(x, output_size, align_corners, scale_factors or (None, None))


_KEPT_WHOLE: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.linear.default: _linear,
    torch.ops.aten.matmul.default: _matmul,
    torch.ops.aten.upsample_bilinear2d.default: _upsample_bilinear,
    torch.ops.aten.upsample_bilinear2d.vec: _upsample_bilinear_vec,
}


def _convolution(
    x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: Any, *rest: Any
) -> Any:
    """torchax's convolution, but a 2-D one channels-last (`hloserve.export._channels_last`)."""
    kept = isinstance(x, channels_last.ChannelsLast) or getattr(x, "ndim", 0) == 4
    if kept and not transposed and getattr(weight, "ndim", 0) == 4:
        return channels_last.convolution(x, weight, bias, stride, padding, dilation, rest[-1])
    torchax = import_torchax()
    convolution = torchax.ops.ops_registry.all_aten_ops[torch.ops.aten.convolution].func
    return convolution(channels_last.logical(x), weight, bias, stride, padding, dilation, transposed, *rest)


_LAYOUT_AWARE = (_convolution, _upsample_bilinear, _upsample_bilinear_vec)
"""Lowerings given a `ChannelsLast` as it is; every other one is given its NCHW tensor."""


# --- the program ----------------------------------------------------------------------------------


def _decomposed(program: torch.export.ExportedProgram, torchax: Any) -> torch.export.ExportedProgram:
    """Core ATen with torchax's own decompositions (what its lowerings expect), linear and
    matmul excepted: one retrace (two, core ATen then torchax's, cost 60% more)."""
    table = torch.export.default_decompositions()
    for op in _KEPT_WHOLE:
        if op in table:
            table.pop(op)
    for op, decomposition in torchax.decompositions.DECOMPOSITIONS.items():
        if op not in _KEPT_WHOLE:
            table[op] = decomposition
    decomposed: torch.export.ExportedProgram = program.run_decompositions(table)
    return decomposed


class _Interpreter(torch.fx.Interpreter):
    """Runs a program's graph on JAX values, one ATen lowering per node."""

    def __init__(
        self,
        module: torch.fx.GraphModule,
        lowerings: Mapping[Any, Callable[..., Any]],
        prepared: _torch_weights.Prepared,
        states: Sequence[Any],
    ) -> None:
        super().__init__(module)
        self.extra_traceback = False  # LoweringError says where; fx would append the graph's text
        self.lowerings = lowerings
        self.prepared = prepared
        self.states = states
        self.registry = import_torchax().ops.ops_registry.all_aten_ops

    def _lowering(self, target: Any) -> Callable[..., Any] | None:
        packet = getattr(target, "overloadpacket", None)
        for key in (target, packet):
            if key is not None and key in self.lowerings:
                return self.lowerings[key]
        for key in (target, packet):
            op = self.registry.get(key) if key is not None else None
            if op is not None and op.is_jax_function:
                func: Callable[..., Any] = op.func
                return func
        return None

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not isinstance(target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
            return super().call_function(target, args, kwargs)  # operator.getitem and the like
        lowering = self._lowering(target)
        if lowering is None:
            raise _Unlowered()
        if any(lowering is aware for aware in _LAYOUT_AWARE):
            return lowering(*args, **kwargs)
        kept = self._channels_last(target, lowering, args, kwargs)
        if kept is not None:
            return kept
        args, kwargs = pytree.tree_map(channels_last.logical, (args, kwargs))
        return lowering(*args, **kwargs)

    def _channels_last(self, target: Any, lowering: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The operation computed on `ChannelsLast` operands' arrays, where
        `hloserve.export._channels_last` can; else None."""
        first: Any = args[0] if args else None
        kept = isinstance(first, channels_last.ChannelsLast)
        grouped = isinstance(first, channels_last.ChannelGroups)
        if target is torch.ops.aten.clone.default and (kept or grouped):
            return first  # arrays are values: a copy is the same array, in any memory format
        if target is torch.ops.aten.view.default and (kept or grouped):
            return channels_last.view(first, args[1])
        if target in _SPLITS and kept:
            return channels_last.split(first, *args[1:], **kwargs)
        if target in channels_last.ELEMENTWISE and channels_last.applies([*args, *kwargs.values()]):
            if any(hasattr(v, "ndim") for v in kwargs.values()):
                return None
            return channels_last.ChannelsLast(lowering(*map(channels_last.physical, args), **kwargs))
        if target is torch.ops.aten.mean.dim and kept:
            return channels_last.mean(lowering, *args, **kwargs)
        if target is torch.ops.aten.permute.default and (kept or grouped or getattr(first, "ndim", 0) == 4):
            return channels_last.permute(first, args[1])
        if target is _CAT:
            return channels_last.concatenate(*args, **kwargs)
        if target is _MAX_POOL and (kept or getattr(first, "ndim", 0) == 4):
            # the indices as torchax computes them, on the NCHW tensor: XLA drops them unless read
            nchw_args, nchw_kwargs = pytree.tree_map(channels_last.logical, (args, kwargs))
            indices = lowering(*nchw_args, **nchw_kwargs)[1]
            nhwc = channels_last.ChannelsLast(channels_last.physical(first))
            return channels_last.max_pool(nhwc, *args[1:], **kwargs), indices
        if target is _AVG_POOL and kept:
            return channels_last.avg_pool(first, *args[1:], **kwargs)
        if target is _BATCH_NORM and kept and not kwargs:
            weight, bias, mean, var = args[1:5]
            y = channels_last.batch_norm(first, weight, bias, mean, var, args[6])
            return y, jnp.zeros((0,), y.array.dtype), jnp.zeros((0,), y.array.dtype)
        return None

    def output(self, target: Any, args: Any, kwargs: Any) -> Any:
        return pytree.tree_map(channels_last.logical, super().output(target, args, kwargs))

    def _prepared_node(self, n: torch.fx.Node) -> Any:
        """The rewrites of `hloserve.export._torch_weights` where they apply to `n`, else `run_node`'s."""
        if n.name in self.prepared.folded:  # a folded batch norm: its convolution plus the shift
            y = self.env[n.args[0]]  # type: ignore[index]  # a node: _torch_weights checked it
            shift = self.states[self.prepared.folded[n.name]]
            if isinstance(y, channels_last.ChannelsLast):
                return (channels_last.ChannelsLast(y.array + shift),)  # its output is item 0
            return (y + shift.reshape(-1, *[1] * (y.ndim - 2)),)
        if n.name in self.prepared.unbiased:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return self.call_function(n.target, (*args[:2], None, *args[3:]), kwargs)
        return super().run_node(n)

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return self._prepared_node(n)
        except LoweringError:
            raise
        except _Unlowered:
            raise LoweringError(_op_name(n.target), n, "torchax has no JAX lowering for it") from None
        except Exception as e:
            cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            raise LoweringError(_op_name(n.target), n, cause) from e


class _Unlowered(Exception):
    """No lowering for the node being run (the interpreter adds the node)."""


def _op_name(target: Any) -> str:
    return str(target)  # `aten.copy.default`, as `torch.ops.` + it names the op in Python


def lower_program(
    program: torch.export.ExportedProgram,
    lowerings: Lowerings | None = None,
    prepare: bool = True,
    keep: Collection[str] = (),
) -> tuple[
    list[str], list[torch.Tensor], Callable[[Sequence[Any], Sequence[Any]], list[Any]], dict[str, Any]
]:
    """The program's weights (names, tensors, in its own argument order, as
    `hloserve.export._torch_weights` prepares them, storing those named in `keep` even unread), a
    JAX function `(weights, inputs) -> outputs` that computes it, and the provenance entries that
    say how the weights were prepared.

    Raises:
        ValueError: the program takes an argument that is neither a weight nor an input
            (a custom object, an effect token).
    """
    torchax = import_torchax()
    torchax.default_env()  # lowerings look it up
    with quiet():
        program = _decomposed(program, torchax)
    values = {**program.state_dict, **program.constants}
    names: list[str] = []
    weights: list[torch.Tensor] = []
    order: list[int | None] = []  # per placeholder: its weight's index, or None for the next input
    indices: dict[int, int] = {}  # a tensor reached by two names (tied weights) is one weight
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            order.append(None)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            assert spec.target is not None  # torch.export names every weight
            value = values[spec.target]
            if id(value) not in indices:
                indices[id(value)] = len(names)
                names.append(spec.target)
                weights.append(value)
            order.append(indices[id(value)])
        else:
            raise ValueError(
                f"the program takes a {spec.kind.name} argument ({spec.arg}); "
                "a bundle binds only weights and inputs"
            )
    table: dict[Any, Callable[..., Any]] = {
        **_KEPT_WHOLE,
        torch.ops.aten.convolution.default: _convolution,
        torch.ops.aten.gelu.default: _gelu,
        **(lowerings or {}),
    }
    mutated = len(program.graph_signature.buffers_to_mutate)
    module = program.graph_module
    if prepare:
        names, weights, order, computed = _torch_constants.fold(module, names, weights, order)
        prepared = _torch_weights.prepare(module, names, weights, order, keep)
        if computed:
            prepared.provenance["weights_computed_at_export"] = computed
    else:
        prepared = _torch_weights.Prepared(names, weights, order)

    def function(states: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        given = iter(inputs)
        laid_out = [
            jnp.transpose(s, prepared.restore[k]) if k in prepared.restore else s
            for k, s in enumerate(states)
        ]
        arguments = [
            next(given) if k is None else None if k == _torch_weights.DROPPED else laid_out[k]
            for k in prepared.order
        ]
        with quiet():
            interpreter = _Interpreter(module, table, prepared, states)
            results = interpreter.run(*arguments, enable_io_processing=False)
        return list(results[mutated:])

    return prepared.names, prepared.weights, function, prepared.provenance
