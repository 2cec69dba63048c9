"""An ONNX graph made static at each compiled batch size, so that torch.export can trace it.

A model exported with a dynamic batch axis (as Triton needs) computes its reshapes from `Shape`
at run time, and onnx2torch's modules take shapes, slice bounds, pads, split sizes, squeeze axes
and single indices as tensors that `forward` turns into Python numbers: torch.export cannot
trace that (a data-dependent value). So, at each batch size, the graph's inputs get their static
shapes and ONNX Runtime's basic optimizations fold the shape arithmetic into constants; each
operator that then takes a constant for one of those inputs is rewritten with it as an
attribute, in the `hloserve` domain, whose converters build static modules. One module per batch
size sits behind a module that picks by the batch size; weights equal across sizes are shared
(the exporter then binds each once), so a bundle keeps one copy.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hloserve.importers.triton_config import NotConvertible, TensorPlan

__all__ = ["static_module"]

DOMAIN = "hloserve"
_CONSTANT_INPUTS = {
    "Reshape": ("shape",),
    "Squeeze": ("axes",),
    "Split": ("split",),
    "Slice": ("starts", "ends", "axes", "steps"),
    "Pad": ("pads", "constant_value"),
    "Gather": ("index",),  # one index: a 0-d tensor used as an index is a Python number
}
"""The operators rewritten, and the names their constant inputs take as attributes."""


def static_module(
    model: Any,
    inputs: Sequence[TensorPlan],
    sizes: Sequence[int] | None,
    convert: Callable[[Any], Any],
) -> Any:
    """A torch module running `model` at each of `sizes` (whole shapes if None): `convert` (the
    onnx2torch conversion) of the graph made static and folded at each size."""
    import torch

    _register_converters()
    modules = {size: convert(_static(model, inputs, size)) for size in sizes or (None,)}
    if len(modules) == 1:
        return next(iter(modules.values()))
    _share_equal_tensors(list(modules.values()))

    class BySize(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sizes = torch.nn.ModuleDict({f"batch_{size}": m for size, m in modules.items()})

        def forward(self, *args: Any) -> Any:
            return self.sizes[f"batch_{args[0].shape[0]}"](*args)

    return BySize().eval()


def _static(model: Any, inputs: Sequence[TensorPlan], size: int | None) -> Any:
    """`model` with its inputs' shapes fixed (`size` rows first, unless None), folded by ONNX
    Runtime's basic optimizations (constant folding, and fusions that keep to ONNX operators), its
    constant shape-like inputs made attributes."""
    import onnx
    import onnxruntime

    static = copy.deepcopy(model)
    dims = {t.name: ((size,) if size is not None else ()) + tuple(t.dims or ()) for t in inputs}
    for value in static.graph.input:
        if value.name in dims:
            shape = value.type.tensor_type.shape
            del shape.dim[:]
            for d in dims[value.name]:
                shape.dim.add().dim_value = d
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        source, folded = Path(tmp) / "static.onnx", Path(tmp) / "folded.onnx"
        onnx.save(static, str(source))
        options.optimized_model_filepath = str(folded)
        try:
            onnxruntime.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise NotConvertible(f"ONNX Runtime cannot fold the model at the shapes {dims}: {e}") from None
        # every value's static shape, known before the rewrite hides it from shape inference:
        # onnx2torch's converters read some (LayerNormalization's normalized shape)
        shaped = onnx.shape_inference.infer_shapes(onnx.load(str(folded)))
        return _constants_as_attributes(shaped)


def _constants_as_attributes(model: Any) -> Any:
    """Rewrite each operator of `_CONSTANT_INPUTS` whose inputs after the first are all
    initializers (or absent) into the `hloserve` domain, those inputs as attributes."""
    import onnx
    from onnx import numpy_helper

    constants = {i.name: i for i in model.graph.initializer}
    rewritten = False
    for node in model.graph.node:
        names = _CONSTANT_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        given = list(node.input[1:])
        if names is None or not given or len(given) > len(names):
            continue
        if not all(not name or name in constants for name in given):
            continue
        values = {
            n: numpy_helper.to_array(constants[v]).tolist() for n, v in zip(names, given, strict=False) if v
        }
        if node.op_type == "Slice" and any(step <= 0 for step in values.get("steps", ())):
            continue  # a reversed slice: left to onnx2torch
        if node.op_type == "Gather" and not isinstance(values["index"], int):
            continue  # a tensor of indices: onnx2torch's module traces
        del node.input[1:]
        node.domain = DOMAIN
        node.attribute.extend(onnx.helper.make_attribute(n, v) for n, v in values.items())
        rewritten = True
    if rewritten:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model


_registered = False


def _register_converters() -> None:
    """onnx2torch converters for the `hloserve` domain's operators, registered once."""
    global _registered
    if _registered:
        return
    import torch
    from onnx2torch.node_converters.pad import OnnxPadStatic
    from onnx2torch.node_converters.registry import add_converter
    from onnx2torch.node_converters.split import OnnxSplit
    from onnx2torch.node_converters.squeeze import OnnxSqueezeStaticAxes
    from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node

    class StaticReshape(torch.nn.Module):
        def __init__(self, shape: Sequence[int], allowzero: bool) -> None:
            super().__init__()
            self.shape, self.allowzero = tuple(shape), allowzero

        def forward(self, x: Any) -> Any:
            zero = not self.allowzero  # ONNX: 0 copies the input's size on that axis
            return torch.reshape(x, [x.shape[k] if d == 0 and zero else d for k, d in enumerate(self.shape)])

    class StaticSlice(torch.nn.Module):
        def __init__(self, starts: list[int], ends: list[int], axes: list[int], steps: list[int]) -> None:
            super().__init__()
            self.slices = list(zip(axes, starts, ends, steps, strict=True))

        def forward(self, x: Any) -> Any:
            index = [slice(None)] * x.ndim
            for axis, start, end, step in self.slices:  # Python's bounds are ONNX's, for steps > 0
                index[axis] = slice(start, end, step)
            return x[tuple(index)]

    class StaticGather(torch.nn.Module):
        def __init__(self, axis: int, index: int) -> None:
            super().__init__()
            self.axis, self.index = axis, index

        def forward(self, x: Any) -> Any:
            return x.select(self.axis, self.index)

    def result(module: Any, node: Any) -> Any:
        return OperationConverterResult(torch_module=module, onnx_mapping=onnx_mapping_from_node(node))

    @add_converter(operation_type="Reshape", version=1, domain=DOMAIN)
    def _reshape(node: Any, graph: Any) -> Any:
        return result(StaticReshape(node.attributes["shape"], node.attributes.get("allowzero", 0)), node)

    @add_converter(operation_type="Squeeze", version=1, domain=DOMAIN)
    def _squeeze(node: Any, graph: Any) -> Any:
        return result(OnnxSqueezeStaticAxes(axes=node.attributes.get("axes")), node)

    @add_converter(operation_type="Split", version=1, domain=DOMAIN)
    def _split(node: Any, graph: Any) -> Any:
        split = node.attributes.get("split")
        axis = node.attributes.get("axis", 0)
        return result(OnnxSplit(num_splits=len(node.output_values), axis=axis, split=split), node)

    @add_converter(operation_type="Slice", version=1, domain=DOMAIN)
    def _slice(node: Any, graph: Any) -> Any:
        starts, ends = node.attributes["starts"], node.attributes["ends"]
        axes = node.attributes.get("axes", list(range(len(starts))))
        steps = node.attributes.get("steps", [1] * len(starts))
        return result(StaticSlice(starts, ends, axes, steps), node)

    @add_converter(operation_type="Pad", version=1, domain=DOMAIN)
    def _pad(node: Any, graph: Any) -> Any:
        pad = OnnxPadStatic.create_from_onnx_params(
            onnx_pads=node.attributes["pads"],
            onnx_mode=node.attributes.get("mode", "constant"),
            constant_value=node.attributes.get("constant_value", 0.0),
        )
        return result(pad, node)

    @add_converter(operation_type="Gather", version=1, domain=DOMAIN)
    def _gather(node: Any, graph: Any) -> Any:
        return result(StaticGather(node.attributes.get("axis", 0), node.attributes["index"]), node)

    _registered = True


def _share_equal_tensors(modules: Sequence[Any]) -> None:
    """Point every parameter and buffer equal to one seen before (same dtype, shape and bytes) at
    that one: torch.export then names it once, by its first module's name."""
    import torch

    seen: dict[tuple[Any, ...], Any] = {}
    for module in modules:
        for owner in module.modules():
            for kind, table in enumerate((owner._parameters, owner._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    key = (kind, tensor.dtype, tuple(tensor.shape), hashlib.sha1(data.tobytes()).digest())
                    table[name] = seen.setdefault(key, tensor)
