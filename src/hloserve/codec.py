"""KServe V2 ModelInfer messages to numpy arrays and back, checking everything on the way in.

Works on the google.protobuf (upb) classes of the hot path: parsing them costs microseconds
where the dataclass messages cost a tenth of a millisecond. Tensor bytes become numpy arrays
over the message's own bytes (no further copy). Every check raises `InvalidInput` naming the
tensor and what was expected, before anything is queued.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hloserve import dtypes
from hloserve._proto.hot import hot_infer_pb2 as pb
from hloserve.errors import InvalidInput
from hloserve.manifest import TensorSpec

__all__ = [
    "TIMEOUT_NS_PARAM",
    "TRITON_TIMEOUT_PARAM",
    "DecodedRequest",
    "decode_request",
    "encode_response",
    "request_deadline",
]

TIMEOUT_NS_PARAM = "hloserve_timeout_ns"
"""Request parameter (int64): the caller's remaining budget in nanoseconds, relative to arrival.

Relative so each hop turns it into its own deadline without comparing clocks across machines.
`reactant_timeout_ns`, the name upstream ReactantServer clients send, is accepted too.
"""
TRITON_TIMEOUT_PARAM = "timeout"
"""Triton's request parameter: timeout in microseconds."""
_TIMEOUT_NS_ALIASES = (TIMEOUT_NS_PARAM, "reactant_timeout_ns")


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    inputs: list[np.ndarray]
    """One array per declared input, in the manifest's order."""
    rows: int
    """Extent of the batch axis shared by the batched inputs (1 when none is batched)."""
    outputs: list[int]
    """Indices of the declared outputs to return, in the order requested."""


def _int_param(param: Any) -> int | None:
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(param, kind))
    return None


def request_deadline(parameters: Any, grpc_remaining_s: float | None, now: float) -> float | None:
    """The soonest of the gRPC timeout, Triton's `timeout` (us) and the ns budget parameter."""
    budgets = [] if grpc_remaining_s is None else [grpc_remaining_s]
    if TRITON_TIMEOUT_PARAM in parameters:
        us = _int_param(parameters[TRITON_TIMEOUT_PARAM])
        if us:
            budgets.append(us / 1e6)
    for name in _TIMEOUT_NS_ALIASES:
        if name in parameters:
            ns = _int_param(parameters[name])
            if ns:
                budgets.append(ns / 1e9)
    return now + min(budgets) if budgets else None


def _wire_shape(model: str, tensor: Any) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(model, f"shape {list(shape)} has a negative dimension", tensor.name)
    return shape


def _array_from_contents(model: str, tensor: Any, dtype: dtypes.DType, shape: tuple[int, ...]) -> np.ndarray:
    if dtype.contents_field is None:
        raise InvalidInput(
            model,
            f"datatype {dtype.wire} has no typed contents field; send it in raw_input_contents",
            tensor.name,
        )
    values = getattr(tensor.contents, dtype.contents_field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(
            model,
            f"contents.{dtype.contents_field} holds {len(values)} values, shape {list(shape)} needs {count}",
            tensor.name,
        )
    return np.asarray(values, dtype=dtype.numpy).reshape(shape)


def _array_from_raw(
    model: str, name: str, raw: bytes, dtype: dtypes.DType, shape: tuple[int, ...]
) -> np.ndarray:
    needed = math.prod(shape) * dtype.itemsize
    if len(raw) != needed:
        raise InvalidInput(
            model,
            f"raw contents hold {len(raw)} bytes, shape {list(shape)} of {dtype.wire} needs {needed}",
            name,
        )
    return np.frombuffer(raw, dtype=dtype.numpy).reshape(shape)


def decode_request(
    request: Any,
    model: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    max_rows: int | None,
) -> DecodedRequest:
    """Check a ModelInferRequest against the model's client-facing tensors and decode it.

    `max_rows` is the largest batch the model can run (None: no limit, or no batch axis).
    """
    by_name = {spec.name: i for i, spec in enumerate(inputs)}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            model,
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "expected one per input",
        )
    arrays: list[np.ndarray | None] = [None] * len(inputs)
    rows: int | None = None
    for position, tensor in enumerate(request.inputs):
        index = by_name.get(tensor.name)
        if index is None:
            raise InvalidInput(model, f"unknown input; expected one of {sorted(by_name)}", tensor.name)
        if arrays[index] is not None:
            raise InvalidInput(model, "input given more than once", tensor.name)
        spec = inputs[index]
        if tensor.datatype != spec.dtype.wire:
            raise InvalidInput(
                model, f"datatype {tensor.datatype!r}, expected {spec.dtype.wire!r}", tensor.name
            )
        shape = _wire_shape(model, tensor)
        problem = spec.shape_problem(shape)
        if problem is not None:
            raise InvalidInput(model, problem, tensor.name)
        if raw:
            array = _array_from_raw(model, tensor.name, raw[position], spec.dtype, shape)
        else:
            array = _array_from_contents(model, tensor, spec.dtype, shape)
        if spec.batch_axis is not None:
            extent = shape[spec.batch_axis]
            if rows is not None and extent != rows:
                raise InvalidInput(
                    model,
                    f"batch of {extent} rows, but other inputs have {rows}; batch axes must agree",
                    tensor.name,
                )
            rows = extent
        arrays[index] = array
    missing = [spec.name for spec, a in zip(inputs, arrays, strict=True) if a is None]
    if missing:
        raise InvalidInput(model, f"missing input(s) {missing}; the model takes {[s.name for s in inputs]}")
    if rows == 0:
        raise InvalidInput(model, "batch of 0 rows; send at least one")
    rows = 1 if rows is None else rows
    if max_rows is not None:
        if rows > max_rows:
            raise InvalidInput(
                model, f"batch of {rows} rows exceeds the largest compiled batch size {max_rows}"
            )
    out_names = {spec.name: i for i, spec in enumerate(outputs)}
    if request.outputs:
        selected = []
        for requested in request.outputs:
            if requested.name not in out_names:
                raise InvalidInput(
                    model,
                    f"requested output does not exist; expected one of {sorted(out_names)}",
                    requested.name,
                )
            selected.append(out_names[requested.name])
    else:
        selected = list(range(len(outputs)))
    return DecodedRequest([a for a in arrays if a is not None], rows, selected)


def encode_response(
    request: Any,
    model: str,
    specs: Sequence[TensorSpec],
    selected: Sequence[int],
    arrays: Sequence[np.ndarray],
) -> Any:
    """A ModelInferResponse with every output in raw_output_contents (what tritonclient decodes)."""
    response = pb.ModelInferResponse(model_name=model, id=request.id)
    for index, array in zip(selected, arrays, strict=True):
        spec = specs[index]
        tensor = response.outputs.add()
        tensor.name = spec.name
        tensor.datatype = spec.dtype.wire
        tensor.shape.extend(array.shape)
        response.raw_output_contents.append(array.tobytes())
    return response
