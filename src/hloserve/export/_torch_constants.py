"""Computations on weights alone, done once at export instead of in every execution.

A bundle's weights reach XLA as runtime parameters (the weight cache swaps them), so XLA cannot
fold what a program computes from them alone: a normalization-free net (NF-ResNet, NFNet)
standardizes every convolution weight in its forward pass (a mean and variance over each
filter, a gain), and each execution redid it, then transposed the result into the layout its
convolution reads (timm's nf_resnet26: 1.7x torch eager, 3.3x ONNX Runtime, which folds
constants at load). Here the graph's nodes that depend on weights alone are computed in torch
at export, and each one that the rest of the program reads becomes a weight of its own, read
where the node was; the weights it was computed from are stored only if something else reads
them. `hloserve.export._torch_weights` then prepares the new weights like any other (a
convolution's is stored in the layout it reads).

Folded: a node whose tensor operands are all weights or folded nodes, whose result is no larger
than its operands together (no weight is multiplied out, and nothing depends on the batch
size: `expand` and `repeat` are never folded), and, for a node the program reads, one whose
operands include a computation (a weight that is only viewed or reshaped stays as it is).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["fold"]

_aten = torch.ops.aten
_NEVER = frozenset({_aten.expand.default, _aten.repeat.default, _aten.expand_copy.default})
"""Operations that multiply a weight out (by the batch size, for one): left to the program."""
_VIEWS = frozenset(
    {
        operator.getitem,
        _aten.view.default,
        _aten.reshape.default,
        _aten._unsafe_view.default,
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.dims,
        _aten.clone.default,
        _aten.alias.default,
        _aten.slice.Tensor,
        _aten.select.int,
        _aten._to_copy.default,
    }
)
"""Operations that only move or relabel a weight's values: nothing to gain from folding them alone."""


def _numel(value: Any) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def fold(
    module: torch.fx.GraphModule,
    names: Sequence[str],
    weights: Sequence[torch.Tensor],
    order: Sequence[int | None],
) -> tuple[list[str], list[torch.Tensor], list[int | None], list[str]]:
    """Rewrite `module`'s graph (in place) so that each computation on weights alone reads a new
    placeholder, appended after the others; returns the weights' names, tensors and the
    placeholders' bindings (`order`, as `hloserve.export._torch_lowering` keeps them) with the new
    weights appended, and the new weights' names."""
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values: dict[torch.fx.Node, Any] = {
        p: weights[k] for p, k in zip(placeholders, order, strict=True) if k is not None
    }
    computes: dict[torch.fx.Node, bool] = dict.fromkeys(values, False)
    with torch.no_grad():
        for node in graph.nodes:
            if node.op != "call_function" or node.target in _NEVER or node.is_impure():
                continue
            operands = node.all_input_nodes
            if not operands or any(o not in values for o in operands):
                continue
            args, kwargs = pytree.tree_map_only(torch.fx.Node, values.__getitem__, (node.args, node.kwargs))
            result = node.target(*args, **kwargs)
            leaves = pytree.tree_leaves(result)
            if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
                continue
            if _numel(result) > sum(_numel(values[o]) for o in operands):
                continue
            values[node] = result
            computes[node] = node.target not in _VIEWS or any(computes[o] for o in operands)
    frontier = [
        n
        for n in values
        if n.op == "call_function"
        and computes[n]
        and isinstance(values[n], torch.Tensor)
        and any(user not in values for user in n.users)
    ]
    if not frontier:
        return list(names), list(weights), list(order), []
    names, weights, order = list(names), list(weights), list(order)
    taken = set(names)
    added = []
    last = placeholders[-1]
    bound = {p: names[k] for p, k in zip(placeholders, order, strict=True) if k is not None}
    for node in frontier:
        name = f"{_source_weight(node, bound)}.folded"
        name = name if name not in taken else f"{name}.{node.name}"
        taken.add(name)
        with graph.inserting_after(last):
            last = graph.placeholder(f"folded_{node.name}")
        last.meta = dict(node.meta)
        node.replace_all_uses_with(last)
        order.append(len(names))
        names.append(name)
        weights.append(values[node].contiguous())
        added.append(name)
    graph.eliminate_dead_code()
    module.recompile()
    return names, weights, order, added


def _source_weight(node: torch.fx.Node, bound: dict[torch.fx.Node, str]) -> str:
    """The name of the largest weight (of `bound`, placeholder → name) that `node` is computed
    from: what its new weight is named after."""
    seen, stack, found = set(), [node], []
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in bound:
            found.append(current)
        stack.extend(current.all_input_nodes)
    largest = max(found, key=lambda p: (p.meta["val"].numel() if "val" in p.meta else 0, p.name))
    return bound[largest]
