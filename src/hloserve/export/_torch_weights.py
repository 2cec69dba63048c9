"""Convolution and linear weights prepared at export for how XLA:CPU computes them.

A bundle's weights reach XLA as runtime parameters (the weight cache swaps them), so XLA cannot
fold anything into them: each execution re-lays out torch's OIHW convolution weights into the
HWIO its convolution kernels read (ResNet-50: 54 transposes, 94 MB), transposes each linear
weight, and recomputes every eval batch norm's scale from its running variance. Here, once at
export:

- an eval batch norm that is the only user of a convolution is folded into it: the weight is
  scaled per output channel and the batch norm's shift becomes the convolution's bias, stored
  under the batch norm's `bias` name (its other tensors are no longer stored);
- a convolution weight used by nothing else is stored spatial axes first, then in, then out
  (HWIO for 2-D), a linear weight (in, out), and the program transposes each back to torch's
  layout, a transpose that XLA cancels against the one it would have inserted;
- a weight the program never reads (`num_batches_tracked`) is not stored.

The exporter verifies the result against the torch module as before; the manifest's provenance
lists what was folded and which weights are stored transposed.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DROPPED", "Prepared", "prepare"]

DROPPED = -1
"""A placeholder's entry in `Prepared.order` when the program no longer reads it."""

_CONVOLUTION = torch.ops.aten.convolution.default
_BATCH_NORM = torch.ops.aten._native_batch_norm_legit_no_training.default
_LINEAR = torch.ops.aten.linear.default  # kept whole by hloserve.export._torch_lowering


@dataclass
class Prepared:
    names: list[str]
    weights: list[torch.Tensor]
    order: list[int | None]
    """Per placeholder: its weight's index, None for the next input, or `DROPPED`."""
    restore: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Weight index → the permutation that gives torch's layout back (applied in the program)."""
    unbiased: set[str] = field(default_factory=set)
    """Convolution nodes whose own bias is folded into a batch norm's (the program drops it)."""
    folded: dict[str, int] = field(default_factory=dict)
    """Folded batch norm node → the weight index of its shift (the convolution's new bias)."""
    provenance: dict[str, Any] = field(default_factory=dict)


def _placeholder(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "placeholder"


def _folding(conv: torch.fx.Node, movable: Callable[[Any], bool]) -> torch.fx.Node | None:
    """The eval batch norm that is `conv`'s only use, over weights it alone reads, whose only
    use is its normalized output; else None."""
    if len(conv.users) != 1:
        return None
    (norm,) = conv.users
    if norm.target is not _BATCH_NORM or norm.args[0] is not conv:
        return None
    operands: Any = norm.args[1:5]
    if not all(a is None or movable(a) for a in operands) or operands[2] is None or operands[3] is None:
        return None
    if len(norm.users) != 1:
        return None
    (out,) = norm.users
    return norm if out.target is operator.getitem and out.args[1] == 0 else None


def prepare(
    module: torch.fx.GraphModule,
    names: Sequence[str],
    weights: Sequence[torch.Tensor],
    order: Sequence[int | None],
    keep: Collection[str] = (),
) -> Prepared:
    """The weights and placeholder bindings of `module`'s graph after the rewrites above.

    A weight is moved (folded, stored transposed) where this graph reads it once, whichever other
    names it has that the graph does not read: an ONNX import's modules, one per batch size, share
    their weights, and each size's graph reads only its own module's names. A weight named in
    `keep` is stored even where this graph does not read it (what another batch size reads), so
    that every size binds the same weights file."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    index = {p.name: k for p, k in zip(placeholders, order, strict=True) if k is not None}
    counts = Counter(index[p.name] for p in placeholders if p.name in index and p.users)

    def movable(node: Any) -> bool:
        """A weight that this one use alone reads (a tied weight stays as it is)."""
        return _placeholder(node) and len(node.users) == 1 and counts[index.get(node.name, -1)] == 1

    values: list[torch.Tensor | None] = list(weights)
    restore: dict[int, tuple[int, ...]] = {}
    unbiased: set[str] = set()
    folded: dict[str, int] = {}
    extra: list[tuple[str, torch.Tensor]] = []  # folded batch norms' shifts, after the weights
    layouts: list[str] = []
    norms: list[str] = []

    def value(node: Any) -> torch.Tensor:
        found = values[index[node.name]]
        assert found is not None  # each weight is moved once: `movable` allows one use
        return found

    for node in module.graph.nodes:
        args: Any = node.args
        if node.target is _LINEAR and movable(args[1]) and value(args[1]).ndim == 2:
            permutation: tuple[int, ...] = (1, 0)  # (out, in) → (in, out), as the dot reads it
        elif node.target is _CONVOLUTION and not args[6] and movable(args[1]) and value(args[1]).ndim >= 3:
            permutation = (*range(2, value(args[1]).ndim), 1, 0)  # OIHW → HWIO
        else:
            continue
        k = index[args[1].name]
        w = value(args[1])
        if not w.is_floating_point():
            continue
        norm = _folding(node, movable) if node.target is _CONVOLUTION else None
        if norm is not None and (args[2] is None or movable(args[2])):
            gamma, beta, mean, var = (None if a is None else value(a) for a in norm.args[1:5])
            assert mean is not None and var is not None
            scale = torch.rsqrt(var.double() + float(norm.args[6]))  # type: ignore[arg-type]
            scale = scale if gamma is None else scale * gamma.double()
            shift = -mean.double() * scale + (0 if beta is None else beta.double())
            if args[2] is not None:
                shift = shift + value(args[2]).double() * scale
                values[index[args[2].name]] = None
                unbiased.add(node.name)
            w = (w.double() * scale.reshape(-1, *[1] * (w.ndim - 1))).to(w.dtype)
            for a in norm.args[1:5]:
                if a is not None:
                    values[index[a.name]] = None  # type: ignore[union-attr]
            named: Any = norm.args[2] if norm.args[2] is not None else norm.args[3]
            prefix = names[index[named.name]].rsplit(".", 1)[0]
            extra.append((f"{prefix}.bias", shift.to(w.dtype)))
            folded[norm.name] = len(names) + len(extra) - 1
            norms.append(prefix)
        values[k] = w.permute(permutation).contiguous()
        restore[k] = tuple(permutation.index(axis) for axis in range(w.ndim))
        layouts.append(names[k])
    read = {index[p.name] for p in placeholders if p.name in index and p.users}
    everything = [*values, *(t for _, t in extra)]
    everyone = [*names, *(n for n, _ in extra)]
    kept = [
        k
        for k, v in enumerate(everything)
        if v is not None and (k in read or k >= len(names) or everyone[k] in keep)
    ]
    renumber = {old: new for new, old in enumerate(kept)}
    return Prepared(
        names=[everyone[k] for k in kept],
        weights=[everything[k] for k in kept],  # type: ignore[misc]  # `kept` has no None
        order=[None if k is None else renumber.get(k, DROPPED) for k in order],
        restore={renumber[k]: p for k, p in restore.items()},
        unbiased=unbiased,
        folded={node: renumber[k] for node, k in folded.items()},
        provenance={
            **({"folded_batch_norms": norms} if norms else {}),
            **({"weights_stored_transposed": layouts} if layouts else {}),
        },
    )
