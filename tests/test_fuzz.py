"""Property-based fuzzing of what parses input: the ModelInfer decoder and the manifest parser.

The decoder, fed arbitrary ModelInferRequest messages (any names, datatypes, shapes including
huge and negative ones, raw contents of any length, typed contents, parameters of every kind,
shared-memory references), raises only hloserve's own request errors and never allocates more
than a small multiple of the request's own size. The manifest parser, fed arbitrary YAML-ish
mappings and files, raises only `BundleError`.

The settings, and how to run longer, are `support.fuzzing`'s.
"""

from __future__ import annotations

import copy
import math
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, example, given
from hypothesis import strategies as st
from support.fuzzing import FUZZ

from hloserve import dtypes
from hloserve._proto.hot import hot_infer_pb2 as pb
from hloserve.api.shm_registry import SHM_DIR, ShmRegistry
from hloserve.api.tensor_codec import SHM_BYTE_SIZE, SHM_OFFSET, SHM_REGION, decode_request
from hloserve.errors import BundleError, InvalidInput, ModelNotFound, ShmDisabled, ShmRegionError
from hloserve.models.manifest import Axis, TensorSpec, load_manifest, parse_manifest

# -- the ModelInfer decoder ----------------------------------------------------------------------

INPUTS = (
    TensorSpec("IMAGE", dtypes.by_token("f32"), (Axis("c", 3), Axis("w", 2), Axis("n", None))),
    TensorSpec("MASK", dtypes.by_token("bool"), (Axis("w", 2), Axis("n", None))),
    TensorSpec("CODES", dtypes.by_token("i8"), (Axis("k", 4), Axis("n", None))),
)
OUTPUTS = (
    TensorSpec("LOGITS", dtypes.by_token("f32"), (Axis("z", 5), Axis("n", None))),
    TensorSpec("LENGTHS", dtypes.by_token("u16"), (Axis("y", -1), Axis("n", None))),
    TensorSpec("SCALE", dtypes.by_token("f64"), (Axis("s", 1),)),
)
REQUEST_ERRORS = (InvalidInput, ShmDisabled, ShmRegionError, ModelNotFound)
REGION, REGION_BYTES = "fuzz-region", 4096

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
names = st.sampled_from([s.name for s in INPUTS + OUTPUTS] + [REGION, "timeout"]) | st.text(max_size=12)
dims = st.integers(0, 6) | st.sampled_from([-1, 2**31, 2**62, 2**63 - 1]) | INT64


def _parameter(draw: Any, parameter: Any) -> None:
    kind = draw(st.sampled_from(["bool", "int64", "uint64", "string", "double", "none"]))
    if kind == "bool":
        parameter.bool_param = draw(st.booleans())
    elif kind == "int64":
        parameter.int64_param = draw(st.integers(-8, REGION_BYTES + 8) | INT64)
    elif kind == "uint64":
        parameter.uint64_param = draw(st.integers(0, REGION_BYTES + 8) | UINT64)
    elif kind == "string":
        parameter.string_param = draw(names)
    elif kind == "double":
        parameter.double_param = draw(st.floats())


def _parameters(draw: Any, parameters: Any, keys: list[str]) -> None:
    for key in draw(st.lists(st.sampled_from(keys) | st.text(max_size=8), max_size=4)):
        _parameter(draw, parameters[key])


TYPED_CONTENTS = {
    "bool_contents": st.booleans(),
    "int_contents": INT32,
    "int64_contents": INT64,
    "uint_contents": UINT32,
    "uint64_contents": UINT64,
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=8),
}
IN_RANGE = {"bool": st.booleans(), "f32": st.floats(width=32), "i8": st.integers(-128, 127)}
SHM_KEYS = [SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE]


@st.composite
def infer_requests(draw: Any) -> Any:
    """A request that is right for INPUTS and OUTPUTS (inline, typed or in shared memory), then
    up to four random mutations of it: names, datatypes, shapes, contents, parameters, tensors
    added, repeated or dropped."""
    request = pb.ModelInferRequest(model_name="fuzz")
    rows = draw(st.integers(1, 9))
    raw = draw(st.booleans())
    offset = 0
    for spec in draw(st.permutations(INPUTS)):
        tensor = request.inputs.add(name=spec.name, datatype=spec.dtype.wire, shape=spec.wire_shape(rows))
        count = math.prod(tensor.shape)
        if draw(st.integers(0, 3)) == 0:  # in the shared-memory region
            size = count * spec.dtype.itemsize
            tensor.parameters[SHM_REGION].string_param = REGION
            tensor.parameters[SHM_OFFSET].int64_param = offset
            tensor.parameters[SHM_BYTE_SIZE].int64_param = size
            offset += size
        elif raw:
            request.raw_input_contents.append(
                draw(st.binary(min_size=count * spec.dtype.itemsize, max_size=count * spec.dtype.itemsize))
            )
        else:
            values = draw(st.lists(IN_RANGE[spec.dtype.token], min_size=count, max_size=count))
            getattr(tensor.contents, str(spec.dtype.contents_field)).extend(values)
    for name in draw(st.lists(st.sampled_from([s.name for s in OUTPUTS]), unique=True)):
        request.outputs.add(name=name)
    for mutate in draw(st.lists(st.sampled_from(MUTATIONS), max_size=4)):
        mutate(draw, request)
    return request


def _tensor(draw: Any, request: Any) -> Any:
    """One of the request's input or output tensors (a new input when there is none)."""
    tensors = [*request.inputs, *request.outputs]
    return draw(st.sampled_from(tensors)) if tensors else request.inputs.add()


def _rename(draw: Any, request: Any) -> None:
    _tensor(draw, request).name = draw(names)


def _retype(draw: Any, request: Any) -> None:
    if request.inputs:
        wires = [d.wire for d in dtypes.DTYPES if d.wire]
        draw(st.sampled_from(request.inputs)).datatype = draw(st.sampled_from(wires) | st.text(max_size=6))


def _reshape(draw: Any, request: Any) -> None:
    if request.inputs:
        tensor = draw(st.sampled_from(request.inputs))
        del tensor.shape[:]
        tensor.shape.extend(draw(st.lists(dims, max_size=5)))


def _raw(draw: Any, request: Any) -> None:
    entries = request.raw_input_contents
    if entries and draw(st.booleans()):
        del entries[draw(st.integers(0, len(entries) - 1))]
    else:
        entries.append(draw(st.binary(max_size=512)))


def _typed(draw: Any, request: Any) -> None:
    if request.inputs:
        field = draw(st.sampled_from(sorted(TYPED_CONTENTS)))
        values = draw(st.lists(TYPED_CONTENTS[field], max_size=64))
        getattr(draw(st.sampled_from(request.inputs)).contents, field).extend(values)


def _request_parameters(draw: Any, request: Any) -> None:
    _parameters(draw, request.parameters, ["timeout", "hloserve_timeout_ns", "reactant_timeout_ns"])


def _tensor_parameters(draw: Any, request: Any) -> None:
    _parameters(draw, _tensor(draw, request).parameters, SHM_KEYS)


def _add(draw: Any, request: Any) -> None:
    tensors = draw(st.sampled_from([request.inputs, request.outputs]))
    source = draw(st.sampled_from(tensors)) if tensors else None
    added = tensors.add()
    if source is not None:
        added.CopyFrom(source)
    if source is None or draw(st.booleans()):
        added.name = draw(names)


def _drop(draw: Any, request: Any) -> None:
    tensors = draw(st.sampled_from([request.inputs, request.outputs]))
    if tensors:
        del tensors[draw(st.integers(0, len(tensors) - 1))]


MUTATIONS = [_rename, _retype, _reshape, _raw, _typed, _request_parameters, _tensor_parameters, _add, _drop]


@pytest.fixture(scope="module", name="registry")
def _registry() -> Iterator[ShmRegistry]:
    """A registry holding one real region in /dev/shm."""
    key = f"hloserve-fuzz-{uuid.uuid4().hex}"
    path = Path(SHM_DIR) / key
    path.write_bytes(bytes(REGION_BYTES))
    registry = ShmRegistry()
    registry.register(REGION, key, 0, REGION_BYTES)
    try:
        yield registry
    finally:
        registry.close()
        path.unlink()


@FUZZ
@given(request=infer_requests(), shm=st.booleans(), max_rows=st.none() | st.integers(1, 8))
def test_the_decoder_raises_only_request_errors(
    registry: ShmRegistry, request: Any, shm: bool, max_rows: int | None
) -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            decoded = decode_request(request, "fuzz", INPUTS, OUTPUTS, max_rows, registry if shm else None)
        except REQUEST_ERRORS as e:
            assert len(str(e)) < 4096
            event(type(e).__name__)  # --hypothesis-show-statistics tells how often each case comes
            decoded = None
        else:
            event("decoded")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # Whatever the shapes declare, the decoder holds no more than the request itself carries
    # (typed values become Python objects on the way: tens of bytes for each wire byte).
    assert peak <= 64 * request.ByteSize() + REGION_BYTES + (256 << 10)
    if decoded is not None:
        assert [a.shape for a in decoded.inputs] == [tuple(t.shape) for t in _in_order(request)]
        assert decoded.rows >= 1 and (max_rows is None or decoded.rows <= max_rows)
        assert len(set(decoded.outputs)) == len(decoded.outputs)
        assert decoded.timeout_s is None or decoded.timeout_s > 0


def _in_order(request: Any) -> list[Any]:
    by_name = {t.name: t for t in request.inputs}
    return [by_name[s.name] for s in INPUTS]


# -- the manifest parser -------------------------------------------------------------------------

KEYS = [
    "format_version", "name", "description", "kind", "executable_inputs", "executable_outputs",
    "client_inputs", "client_outputs", "batching", "provenance", "input_shapes", "meta",
    "compiled_batch_sizes", "calls", "dtype", "shape", "dims",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 20)
    | INT64
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["2.0", "fuzz", "model", "meta", "f32", "u8", "f8_e4m3", "fn", "nb", "cwhn", "-1"])
)
yamlish = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4) | st.integers(-2, 2), inner, max_size=4)
    ),
    max_leaves=12,
)
_A = {"name": "A", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}
_B = {"name": "B", "dtype": "u8", "shape": "kn", "dims": {"k": 2}}
_V = {"name": "V", "dtype": "i64", "shape": "yb", "dims": {"y": -1}}
VALID = [
    {"format_version": "2.0", "name": "fuzz", "executable_inputs": [_A], "executable_outputs": [_B],
     "batching": {"compiled_batch_sizes": [1, 4]}, "provenance": {"exporter": "fuzz"}},
    {"format_version": "2.0", "name": "fuzz", "executable_inputs": [_A], "executable_outputs": [_B],
     "client_inputs": [_V], "client_outputs": [_A, _V]},
    {"format_version": "2", "name": "fuzz", "kind": "meta", "client_inputs": [_A], "client_outputs": [_V],
     "meta": {"calls": ["a", "b"]}},
]  # fmt: skip
"""Manifests that parse (the second and third with a model.py); the fuzzer mutates them."""


@st.composite
def manifests(draw: Any) -> Any:
    """A valid manifest with up to four random edits anywhere in it (a key or item replaced by
    anything YAML can hold, removed or added), or anything YAML can hold."""
    if draw(st.integers(0, 9)) == 0:
        return draw(yamlish)
    data = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 4))):
        node = draw(st.sampled_from(list(_containers(data))))
        value = draw(yamlish)
        if isinstance(node, dict):
            key = (
                draw(st.sampled_from(sorted(node, key=str)) | st.sampled_from(KEYS) | scalars)
                if node
                else draw(scalars)
            )
            if key in node and draw(st.booleans()):
                del node[key]
            else:
                node[key] = value
        elif node and draw(st.booleans()):
            index = draw(st.integers(0, len(node) - 1))
            if draw(st.booleans()):
                del node[index]
            else:
                node[index] = value
        else:
            node.append(value)
    return data


def _containers(node: Any) -> Iterator[Any]:
    if isinstance(node, dict | list):
        yield node
        for child in node.values() if isinstance(node, dict) else node:
            yield from _containers(child)


def test_the_valid_manifests_parse() -> None:
    """The fuzzer's starting points are valid, so its edits probe past the first check."""
    for data, has_model_py in zip(VALID, (False, True, True), strict=True):
        parse_manifest(data, "fuzz", has_model_py=has_model_py)


@FUZZ
@given(data=manifests(), has_model_py=st.booleans())
def test_the_manifest_parser_raises_only_bundle_errors(data: Any, has_model_py: bool) -> None:
    try:
        manifest = parse_manifest(data, "fuzz", has_model_py=has_model_py)
    except BundleError:
        event("BundleError")
        return
    event("parsed")
    assert manifest.name == "fuzz" and (manifest.inputs and manifest.outputs)


@FUZZ
@given(data=manifests(), text=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
@example(data={}, text=b"[" * 5000)  # deeper than the recursion limit
def test_a_manifest_file_raises_only_bundle_errors(tmp_path_factory: Any, data: Any, text: bytes) -> None:
    """Whatever the file holds: YAML that is no manifest, text that is no YAML, bytes that are
    no UTF-8."""
    path = tmp_path_factory.mktemp("manifest") / "manifest.yaml"
    for content in (yaml.safe_dump(data, allow_unicode=True).encode(), text):
        path.write_bytes(content)
        try:
            load_manifest(path, "fuzz", has_model_py=True)
        except BundleError:
            pass
