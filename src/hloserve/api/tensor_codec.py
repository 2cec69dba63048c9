"""KServe V2 ModelInfer messages to numpy arrays and back, checking everything on the way in.

Works on the google.protobuf (upb) classes of the hot path: parsing them costs microseconds
where the dataclass messages cost a tenth of a millisecond. Tensor bytes become numpy arrays
over the message's own bytes (no further copy). Every check raises `InvalidInput` naming the
tensor and what was expected, before anything is queued.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hloserve import dtypes
from hloserve._proto.hot import hot_infer_pb2 as pb
from hloserve.api.shm_registry import Region, ShmRegistry
from hloserve.errors import InvalidInput, MixedContents, ShmDisabled, ShmRegionError, UnknownTensor, clip
from hloserve.models.manifest import TensorSpec

__all__ = [
    "TIMEOUT_NS_PARAM",
    "TRITON_TIMEOUT_PARAM",
    "DecodedRequest",
    "InferRequest",
    "InputTensor",
    "RequestedOutput",
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
_TIMEOUT_PARAMS = ((TRITON_TIMEOUT_PARAM, 1e-6), (TIMEOUT_NS_PARAM, 1e-9), ("reactant_timeout_ns", 1e-9))
"""Each timeout parameter and its unit in seconds; 0 (the default) means no timeout."""


InputTensor = pb.ModelInferRequest.InferInputTensor
RequestedOutput = pb.ModelInferRequest.InferRequestedOutputTensor
Parameters = Mapping[str, pb.InferParameter]


class InferRequest(Protocol):
    """A ModelInferRequest as the data plane reads it: the upb message gRPC parses, or a view of
    one whose tensor bytes stay where they arrived (`hloserve.api.viewed_request`, which
    both gRPC's large requests and REST's requests are)."""

    @property
    def model_name(self) -> str: ...
    @property
    def model_version(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def parameters(self) -> Parameters: ...
    @property
    def inputs(self) -> Sequence[InputTensor]: ...
    @property
    def outputs(self) -> Sequence[RequestedOutput]: ...
    @property
    def raw_input_contents(self) -> Sequence[bytes | memoryview]: ...
    def SerializeToString(self) -> bytes:
        """The whole request on the wire (a frontend forwards it to the engine)."""
        ...


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    inputs: list[np.ndarray]
    """One array per declared input, in the manifest's order."""
    rows: int
    """Extent of the batch axis shared by the batched inputs (1 when none is batched)."""
    outputs: list[int]
    """Indices of the declared outputs to return, in the order requested."""
    shm_outputs: dict[int, ShmTarget]
    """Outputs to write into shared memory instead of the response, by output index."""
    timeout_s: float | None
    """The soonest budget the request's timeout parameters set (None: they set none)."""
    class_counts: dict[int, int] = field(default_factory=dict)
    """Outputs answered as Triton's classification (top k "score:index"), k by output index."""


def _int_param(param: pb.InferParameter) -> int | None:
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(param, kind))
    return None


def _timeout_s(model: str, parameters: Parameters) -> float | None:
    """The soonest of Triton's `timeout` (us) and the ns budget parameters, each checked."""
    budgets = []
    for name, unit_s in _TIMEOUT_PARAMS:
        if name not in parameters:
            continue
        value = _int_param(parameters[name])
        if value is None or value < 0:
            got = parameters[name].WhichOneof("parameter_choice") or "no value"
            raise InvalidInput(
                model,
                f"request parameter {name!r} must be a non-negative integer (int64_param or "
                f"uint64_param), got {got if value is None else value}",
            )
        if value:
            budgets.append(value * unit_s)
    return min(budgets, default=None)


def request_deadline(timeout_s: float | None, grpc_remaining_s: float | None, now: float) -> float | None:
    """The soonest of the gRPC timeout and the request's timeout parameters, as a deadline."""
    budgets = [b for b in (timeout_s, grpc_remaining_s) if b is not None]
    return now + min(budgets) if budgets else None


def _wire_shape(model: str, tensor: InputTensor) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(model, f"shape {list(shape)} has a negative dimension", tensor.name)
    return shape


def _array_from_contents(
    model: str, tensor: InputTensor, dtype: dtypes.DType, shape: tuple[int, ...]
) -> np.ndarray:
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
    try:
        return np.asarray(values, dtype=dtype.numpy).reshape(shape)
    except OverflowError:  # e.g. 300 in int_contents for INT8: the field is wider than the type
        raise InvalidInput(
            model, f"contents.{dtype.contents_field} holds a value out of range for {dtype.wire}", tensor.name
        ) from None


def _array_from_raw(
    model: str, name: str, raw: bytes | memoryview, dtype: dtypes.DType, shape: tuple[int, ...]
) -> np.ndarray:
    if dtype is dtypes.BYTES:
        return _strings_from_raw(model, name, raw, shape)
    needed = math.prod(shape) * dtype.itemsize
    if len(raw) != needed:
        raise InvalidInput(
            model,
            f"raw contents hold {len(raw)} bytes, shape {list(shape)} of {dtype.wire} needs {needed}",
            name,
        )
    return np.frombuffer(raw, dtype=dtype.numpy).reshape(shape)


def _strings_from_raw(model: str, name: str, raw: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    """A BYTES tensor from raw contents: each element a 4-byte little-endian length, then it."""
    count = math.prod(shape)
    if count * 4 > len(raw):  # before anything of `count` is allocated
        raise InvalidInput(
            model, f"raw contents hold {len(raw)} bytes, too few for {count} BYTES elements", name
        )
    items = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise InvalidInput(model, f"raw contents end inside BYTES element {i} of {count}", name)
        length = int.from_bytes(raw[offset : offset + 4], "little")
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(model, f"raw contents end inside BYTES element {i} of {count}", name)
        items[i] = raw[offset : offset + length]
        offset += length
    if offset != len(raw):
        raise InvalidInput(
            model, f"raw contents hold {len(raw) - offset} bytes past the {count} BYTES elements", name
        )
    return items.reshape(shape)


SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_BYTE_SIZE = "shared_memory_byte_size"


@dataclass(frozen=True, slots=True)
class ShmTarget:
    """Where a tensor lives in shared memory: a registered region, an offset, a byte size."""

    region: Region
    offset: int
    byte_size: int


def _shm_target(
    model: str, tensor: InputTensor | RequestedOutput, registry: ShmRegistry | None
) -> ShmTarget | None:
    """The tensor's shared-memory parameters, checked; None when it has none."""
    parameters = tensor.parameters
    if SHM_REGION not in parameters:
        return None
    if registry is None:
        raise ShmDisabled()
    region = registry.get(parameters[SHM_REGION].string_param)
    offset = _int_param(parameters[SHM_OFFSET]) if SHM_OFFSET in parameters else 0
    if SHM_BYTE_SIZE not in parameters:
        raise InvalidInput(model, f"{SHM_REGION} needs {SHM_BYTE_SIZE}", tensor.name)
    size = _int_param(parameters[SHM_BYTE_SIZE])
    if offset is None or size is None:
        raise InvalidInput(model, f"{SHM_OFFSET} and {SHM_BYTE_SIZE} must be integers", tensor.name)
    if offset < 0 or size < 0 or offset + size > region.byte_size:
        raise ShmRegionError(
            region.name, f"offset {offset} + byte_size {size} exceeds the region's {region.byte_size} bytes"
        )
    return ShmTarget(region, offset, size)


def decode_request(
    request: InferRequest,
    model: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    max_rows: int | None,
    registry: ShmRegistry | None = None,
) -> DecodedRequest:
    """Check a ModelInferRequest against the model's client-facing tensors and decode it.

    `max_rows` is the largest batch the model can run (None: no limit, or no batch axis);
    `registry` holds the shared-memory regions (None: shared memory is disabled). Inputs come
    from shared memory when they name a region, else from `raw_input_contents` (one entry per
    input not in shared memory, in order), else from typed `contents`.
    """
    timeout_s = _timeout_s(model, request.parameters)
    by_name = {spec.name: i for i, spec in enumerate(inputs)}
    in_shm = [_shm_target(model, t, registry) for t in request.inputs]
    raw = list(request.raw_input_contents)
    inline = sum(target is None for target in in_shm)
    if raw:  # as Triton, before counting the entries: a typed input has none
        for tensor, target in zip(request.inputs, in_shm, strict=True):
            if target is None and tensor.HasField("contents"):
                raise MixedContents(model, tensor.name)
    if raw and len(raw) != inline:
        raise InvalidInput(
            model,
            f"raw_input_contents has {len(raw)} entries for {inline} inputs not in shared memory; "
            "expected one per input",
        )
    raw_entries = iter(raw)
    arrays: list[np.ndarray | None] = [None] * len(inputs)
    rows: int | None = None
    for tensor, target in zip(request.inputs, in_shm, strict=True):
        index = by_name.get(tensor.name)
        if index is None:
            raise UnknownTensor(model, "input", tensor.name, sorted(by_name))
        if arrays[index] is not None:
            raise InvalidInput(model, "input given more than once", tensor.name)
        spec = inputs[index]
        if tensor.datatype != spec.dtype.wire:
            raise InvalidInput(
                model, f"datatype {clip(tensor.datatype)}, expected {spec.dtype.wire!r}", tensor.name
            )
        shape = _wire_shape(model, tensor)
        problem = spec.shape_problem(shape)
        if problem is not None:
            raise InvalidInput(model, problem, tensor.name)
        if target is not None and spec.dtype is dtypes.BYTES:
            raise InvalidInput(
                model, "BYTES tensors cannot come from shared memory; send them inline", tensor.name
            )
        if target is not None:
            needed = math.prod(shape) * spec.dtype.itemsize
            if target.byte_size != needed:
                raise InvalidInput(
                    model,
                    f"{SHM_BYTE_SIZE} is {target.byte_size}, "
                    f"shape {list(shape)} of {spec.dtype.wire} needs {needed}",
                    tensor.name,
                )
            array = target.region.read(target.offset, needed).view(spec.dtype.numpy).reshape(shape)
        elif raw:
            array = _array_from_raw(model, tensor.name, next(raw_entries), spec.dtype, shape)
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
    if max_rows is not None and rows > max_rows:
        raise InvalidInput(model, f"batch of {rows} rows exceeds the largest compiled batch size {max_rows}")
    out_names = {spec.name: i for i, spec in enumerate(outputs)}
    selected: list[int] = []
    targets: dict[int, ShmTarget] = {}
    class_counts: dict[int, int] = {}
    for requested in request.outputs:
        if requested.name not in out_names:
            raise UnknownTensor(model, "output", requested.name, sorted(out_names))
        index = out_names[requested.name]
        if index in selected:
            raise InvalidInput(model, "output requested more than once", requested.name)
        selected.append(index)
        target = _shm_target(model, requested, registry)
        if target is not None and outputs[index].dtype is dtypes.BYTES:
            raise InvalidInput(model, "BYTES outputs cannot go to shared memory", requested.name)
        k = _class_count(model, requested, outputs[index], target)
        if k is not None:
            class_counts[index] = k
        if target is not None:
            spec = outputs[index]
            if not any(a.is_variable for a in spec.axes):
                needed = math.prod(spec.wire_shape(rows)) * spec.dtype.itemsize
                if target.byte_size < needed:
                    raise InvalidInput(
                        model,
                        f"{SHM_BYTE_SIZE} is {target.byte_size}, the output needs {needed} bytes",
                        requested.name,
                    )
            targets[index] = target
    if not selected:
        selected = list(range(len(outputs)))
    return DecodedRequest(
        [a for a in arrays if a is not None], rows, selected, targets, timeout_s, class_counts
    )


CLASSIFICATION_PARAM = "classification"
"""Triton's requested-output parameter (tritonclient's `class_count`): answer the top k classes."""


def _class_count(
    model: str, requested: RequestedOutput, spec: TensorSpec, target: ShmTarget | None
) -> int | None:
    """The k of a requested output's classification parameter, checked; None when absent."""
    if CLASSIFICATION_PARAM not in requested.parameters:
        return None
    k = _int_param(requested.parameters[CLASSIFICATION_PARAM])
    if k is None or k < 0:
        raise InvalidInput(
            model, f"{CLASSIFICATION_PARAM} (class_count) must be an integer >= 0", requested.name
        )
    if k == 0:
        return None  # as Triton: 0 is the default, no classification
    if spec.dtype.wire in (None, "BOOL", "BYTES"):
        raise InvalidInput(
            model,
            f"{CLASSIFICATION_PARAM} (class_count) needs a numeric output, this one is {spec.dtype.wire}",
            requested.name,
        )
    if target is not None:
        raise InvalidInput(
            model,
            f"{CLASSIFICATION_PARAM} (class_count) answers BYTES strings, which cannot go to shared memory",
            requested.name,
        )
    return k


def classify(array: np.ndarray, batch_axis: int | None, k: int, labels: Sequence[str] = ()) -> np.ndarray:
    """Triton's classification of an output: per batch row (or for the whole tensor when it has
    no batch axis), the top `k` values over the other axes flattened, as "score:index[:label]"
    strings, highest first; `k` is capped at the number of classes."""
    rows = np.moveaxis(array, batch_axis, 0) if batch_axis is not None else array[np.newaxis]
    flat = rows.reshape(rows.shape[0], -1)
    k = min(k, flat.shape[1])
    top = np.argsort(-flat.astype(np.float64), axis=1, kind="stable")[:, :k]
    strings = [
        [f"{float(row[i]):f}:{i}" + (f":{labels[i]}" if i < len(labels) else "") for i in indices]
        for row, indices in zip(flat, top, strict=True)
    ]
    result = np.array(strings, dtype=object).reshape(flat.shape[0], k)
    return result if batch_axis is not None else result[0]


def bytes_contents(strings: np.ndarray) -> bytes:
    """A BYTES tensor's raw contents: each element's UTF-8 length (4 bytes, little-endian), then it."""
    parts = []
    for item in strings.flat:
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts += [len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def encode_response(
    request: InferRequest,
    model: str,
    specs: Sequence[TensorSpec],
    decoded: DecodedRequest,
    arrays: Sequence[np.ndarray],
    labels: Mapping[str, Sequence[str]] | None = None,
) -> pb.ModelInferResponse:
    """A ModelInferResponse: outputs written to their shared-memory targets, the rest inline.

    Clients index `raw_output_contents` by output position (perf_analyzer crashes otherwise), so
    an output in shared memory keeps its place there with an empty entry, as Triton does.
    """
    labels = labels or {}
    response = pb.ModelInferResponse(model_name=model, model_version="1", id=request.id)
    contents: list[bytes] = []
    for index, array in zip(decoded.outputs, arrays, strict=True):
        spec = specs[index]
        tensor = response.outputs.add()
        tensor.name = spec.name
        k = decoded.class_counts.get(index)
        if k is not None:
            classes = classify(array, spec.batch_axis, k, labels.get(spec.name, ()))
            tensor.datatype = "BYTES"
            tensor.shape.extend(classes.shape)
            contents.append(bytes_contents(classes))
            continue
        assert spec.dtype.wire is not None  # a client-facing tensor's (the manifest checks)
        tensor.datatype = spec.dtype.wire
        tensor.shape.extend(array.shape)
        if spec.dtype is dtypes.BYTES:
            contents.append(bytes_contents(array))
            continue
        target = decoded.shm_outputs.get(index)
        if target is None:
            contents.append(array.tobytes())
            continue
        data = np.ascontiguousarray(array)
        if data.nbytes > target.byte_size:
            raise InvalidInput(
                model, f"{SHM_BYTE_SIZE} is {target.byte_size}, the output has {data.nbytes} bytes", spec.name
            )
        target.region.write(target.offset, data)
        tensor.parameters[SHM_REGION].string_param = target.region.name
        tensor.parameters[SHM_OFFSET].int64_param = target.offset
        tensor.parameters[SHM_BYTE_SIZE].int64_param = data.nbytes
        contents.append(b"")
    response.raw_output_contents.extend(contents)
    return response
