"""Property-based fuzzing of the REST codec (`hloserve.api.rest.json_codec`): JSON and binary-extension
request bodies, the `Inference-Header-Content-Length` parser, and answers.

Whatever a client sends, every step from the body to the service's decoder either decodes it or
raises the request errors that the REST port answers 400 (never another exception, which would
be a 500); a well-formed request decodes to exactly the values sent; and an answer encoded by
the server decodes, in hloserve and in Triton's own HTTP client, to exactly the tensor it held,
for every datatype. Settings (and how to run longer): `support.fuzzing`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy as np
import tritonclient.http as httpclient
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.fuzzing import FUZZ, LONG_RUN
from support.numerics import assert_close

from hloserve import dtypes
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.rest import json_codec as rest_codec
from hloserve.api.rest import messages as rest_messages
from hloserve.api.rest.json_codec import RestInfer, decode_infer, encode_infer, header_length, parse_json
from hloserve.api.rest.messages import _base64
from hloserve.api.rest.routes import HTTP_STATUS, _error
from hloserve.api.tensor_codec import bytes_contents, decode_request
from hloserve.errors import InvalidInput, ModelNotFound, ShmDisabled, ShmRegionError
from hloserve.models.manifest import Axis, TensorSpec

MODEL = "fuzz"
INPUTS = (
    TensorSpec("IMAGE", dtypes.by_token("f32"), (Axis("c", 3), Axis("w", 2), Axis("n", None))),
    TensorSpec("MASK", dtypes.by_token("bool"), (Axis("w", 2), Axis("n", None))),
    TensorSpec("CODES", dtypes.by_token("i8"), (Axis("k", 4), Axis("n", None))),
    TensorSpec("WORDS", dtypes.BYTES, (Axis("n", None),)),
)
OUTPUTS = (
    TensorSpec("LOGITS", dtypes.by_token("f32"), (Axis("z", 5), Axis("n", None))),
    TensorSpec("SCALE", dtypes.by_token("f64"), (Axis("s", 1),)),
)
REQUEST_ERRORS = (InvalidInput, ShmDisabled, ShmRegionError, ModelNotFound)
"""What the codec and the service's decoder may raise for a client's mistake."""
WIRE = [d for d in dtypes.DTYPES if d.wire]
FUZZ_BODIES = settings(FUZZ, max_examples=LONG_RUN or 150)
"""Whole requests take ten times a header's examples to draw: fewer of them in CI."""


def _answered(error: Exception) -> None:
    """`error` is a client's mistake that the REST port answers with a 4xx and a short message."""
    assert isinstance(error, REQUEST_ERRORS), repr(error)
    status, http, message, _ = _error(error, "ModelInfer")
    assert 400 <= http < 500 or (error.__class__ is ModelNotFound and http == HTTP_STATUS[status]), http
    assert 0 < len(message) < 4096
    json.dumps({"error": message}, allow_nan=False).encode()  # the answer's body can be written
    event(type(error).__name__)


# -- values and bodies ---------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | INT64
    | st.integers()  # past 64 bits
    | st.floats()  # NaN and the infinities included: dumped as tokens that are not JSON
    | st.text(max_size=8)
    | st.sampled_from(
        ["FP32", "BOOL", "INT8", "BYTES", "BF16", "IMAGE", "binary_data_size", "shared_memory_region"]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.sampled_from(
        ["inputs", "outputs", "name", "shape", "datatype", "data", "parameters", "id", "binary_data_size",
         "binary_data", "binary_data_output", "timeout", "shared_memory_region"]
    ), inner, max_size=4),
    max_leaves=16,
)  # fmt: skip


def _strings(draw: Any, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)
    return np.array(
        draw(st.lists(st.text(max_size=6), min_size=count, max_size=count)), dtype=object
    ).reshape(shape)


def _values(draw: Any, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    if spec.dtype is dtypes.BYTES:
        return _strings(draw, shape)
    elements = (
        st.floats(width=32, allow_nan=False, allow_infinity=False) if spec.dtype.numpy.kind == "f" else None
    )
    return draw(hnp.arrays(spec.dtype.numpy, shape, elements=elements))


@st.composite
def rest_requests(draw: Any) -> tuple[dict[str, Any], list[bytes], list[np.ndarray]]:
    """A request right for INPUTS and OUTPUTS: its JSON header, its binary tensors (in order) and
    the arrays it sends (in INPUTS' order). Each input is sent as flat or nested JSON, or binary."""
    rows = draw(st.integers(1, 4))
    header: dict[str, Any] = {"inputs": []}
    blobs: list[bytes] = []
    arrays = {}
    for spec in draw(st.permutations(INPUTS)):
        shape = spec.wire_shape(rows)
        array = arrays[spec.name] = _values(draw, spec, shape)
        tensor: dict[str, Any] = {"name": spec.name, "datatype": spec.dtype.wire, "shape": list(shape)}
        how = draw(st.sampled_from(["flat", "nested", "binary"]))
        if how == "binary":
            blob = bytes_contents(array) if spec.dtype is dtypes.BYTES else array.tobytes()
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = (array.ravel() if how == "flat" else array).tolist()
        header["inputs"].append(tensor)
    outputs = draw(st.lists(st.sampled_from([s.name for s in OUTPUTS]), unique=True))
    if outputs:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": draw(st.booleans())}} for n in outputs]
    if draw(st.booleans()):
        header["id"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        header["parameters"] = {
            "binary_data_output": draw(st.booleans()),
            "timeout": draw(st.integers(1, 10**9)),
        }
    return header, blobs, [arrays[s.name] for s in INPUTS]


def _containers(node: Any) -> list[Any]:
    found, pending = [], [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict | list):
            found.append(item)
            pending.extend(item.values() if isinstance(item, dict) else item)
    return found


def _mutate(draw: Any, header: dict[str, Any]) -> None:
    """One edit anywhere in the JSON: a key or item replaced by any JSON value, removed or added."""
    node = draw(st.sampled_from(_containers(header)))
    value = draw(json_values)
    if isinstance(node, dict):
        key = draw(st.sampled_from(sorted(node)) | st.text(max_size=6)) if node else draw(st.text(max_size=6))
        if key in node and draw(st.booleans()):
            del node[key]
        else:
            node[key] = value
    elif node and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        node[index] = value
    else:
        node.append(value)


def _body(header: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int | None]:
    text = json.dumps(header).encode()
    return text + b"".join(blobs), len(text) if blobs else None


@st.composite
def hostile_bodies(draw: Any) -> tuple[bytes, int | None]:
    """A request body and its header length: a right one edited (its JSON, its binary part or its
    bytes, its header length), any JSON, or any bytes."""
    kind = draw(st.sampled_from(["edited", "edited", "json", "bytes"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=256))
        return body, draw(st.none() | st.integers(0, len(body) + 2) | INT64)
    if kind == "json":
        text = json.dumps(draw(json_values)).encode()
        return text, draw(st.none() | st.just(len(text)))
    header, blobs, _ = draw(rest_requests())
    for _ in range(draw(st.integers(1, 4))):
        _mutate(draw, header)
    body, length = _body(header, blobs)
    edit = draw(st.sampled_from(["none", "truncate", "extend", "flip", "length"]))
    if edit == "truncate":
        body = body[: draw(st.integers(0, len(body)))]
    elif edit == "extend":
        body += draw(st.binary(min_size=1, max_size=16))
    elif edit == "flip" and body:
        at = draw(st.integers(0, len(body) - 1))
        body = body[:at] + bytes([body[at] ^ draw(st.integers(1, 255))]) + body[at + 1 :]
    elif edit == "length":
        length = draw(st.none() | st.integers(0, len(body) + 2))
    return body, length


# -- properties ----------------------------------------------------------------------------------


def _decode(body: bytes, length: int | None) -> Any:
    """The body through the REST codec and then the service's decoder, as the REST port does."""
    rest = decode_infer(memoryview(body), length, MODEL, "")
    return decode_request(rest.request, MODEL, INPUTS, OUTPUTS, 8, None)


@FUZZ_BODIES
@given(request=rest_requests())
def test_a_right_request_decodes_to_the_values_sent(request: Any) -> None:
    header, blobs, arrays = request
    decoded = _decode(*_body(header, blobs))
    for got, sent in zip(decoded.inputs, arrays, strict=True):
        assert got.shape == sent.shape
        if sent.dtype == object:
            assert [str(b, "utf-8") if isinstance(b, bytes) else b for b in got.ravel()] == list(sent.ravel())
        else:
            assert got.dtype == sent.dtype and got.tobytes() == sent.tobytes()


@FUZZ_BODIES
@given(body=hostile_bodies())
@example(body=(b'{"inputs":[]}', 2**63 - 1))
@example(body=(b"[" * 100_000, None))  # deeper than the recursion limit
@example(body=(b'{"inputs":[{"name":"\\ud800","shape":[1],"datatype":"FP32","data":[1]}]}', None))
@example(
    body=(b'{"inputs":[{"name":"IMAGE","shape":[3,2,1],"datatype":"FP32","data":[1e400,0,0,0,0,0]}]}', None)
)
@example(body=(b'{"inputs":[{"name":"CODES","shape":[4,1],"datatype":"INT8","data":[NaN,1,2,3]}]}', None))
def test_any_body_decodes_or_is_a_client_error(body: tuple[bytes, int | None]) -> None:
    try:
        decoded = _decode(*body)
    except Exception as e:  # the property: only request errors
        _answered(e)
        return
    event("decoded")
    assert decoded.rows >= 1 and len(decoded.inputs) == len(INPUTS)


@FUZZ
@given(
    value=st.text(max_size=24) | st.integers(-(2**70), 2**70).map(str) | st.from_regex(r"\s*[0-9]{0,25}\s*")
)
@example(value="\u00b2")  # str.isdigit says yes, int() says no
@example(value="\u0661\u0662")  # Arabic-Indic digits: int() takes them
@example(value="1_000")  # int() takes underscores
@example(value="+5")
@example(value="9" * 20)  # past int64
@example(value=" 12\t")
def test_the_header_length_is_a_byte_count_or_a_client_error(value: str) -> None:
    """Only optional spaces or tabs around 1 to 19 ASCII digits (so it fits an int64)."""
    digits = value.strip(" \t")
    count = 0 < len(digits) <= 19 and all(c in "0123456789" for c in digits)
    try:
        length = header_length(value, MODEL)
    except InvalidInput as e:
        _answered(e)
        assert not count, value
        return
    assert count and length == int(digits)


@contextmanager
def _steps(string: int, base: int = 4) -> Iterator[None]:
    """Strings scanned, and base64 decoded, a few characters at a time: every cut is exercised."""
    saved = rest_codec._STRING_STEP, rest_messages._BASE64_STEP
    rest_codec._STRING_STEP, rest_messages._BASE64_STEP = string, base
    try:
        yield
    finally:
        rest_codec._STRING_STEP, rest_messages._BASE64_STEP = saved


escaped_strings = st.builds(
    lambda text, ascii_only: json.dumps(text, ensure_ascii=ascii_only).encode(),
    st.text(st.characters(codec="utf-8") | st.sampled_from('\\"\n/\U0001f600\u00e9'), max_size=64),
    st.booleans(),
)
"""JSON strings full of escapes: quotes, backslashes, control characters, and (ASCII only)
`\\uXXXX`, astral characters as surrogate pairs."""


@FUZZ
@given(
    text=st.binary(max_size=128) | json_values.map(lambda v: json.dumps(v).encode()) | escaped_strings,
    limit=st.none() | st.integers(0, 8),
    step=st.integers(13, 20),
)
@example(text=b'"\\udc00"', limit=None, step=13)
@example(text=b'"abcdefgh\\ud83d\\ude00xyz"', limit=None, step=13)  # the cut falls inside the pair
@example(text=b'"abcdefghijkl\\\\\\\\\\"x"', limit=None, step=13)  # a run of escaped backslashes
@example(text=b"\xff\xfe[\x001\x00]\x00", limit=None, step=13)  # UTF-16 with a byte-order mark
@example(text=b'{"a": Infinity}', limit=None, step=13)
def test_both_json_parsers_take_rfc_8259_alone(text: bytes, limit: int | None, step: int) -> None:
    """The C parser (on the loop) and the fair one (in a thread, strings scanned `step` characters
    at a time) agree, and what either accepts is JSON that can be written back: no NaN, no lone
    surrogate."""
    outcomes = []
    for fair in (False, True):
        try:
            with _steps(step):
                value = parse_json(text, limit, fair)
        except ValueError as e:
            assert 0 < len(str(e)) <= 200 or "arrays and objects" in str(e)
            outcomes.append(("refused", None))
        else:
            json.dumps(value, allow_nan=False).encode()
            outcomes.append(("parsed", value))
    assert outcomes[0] == outcomes[1]
    event(outcomes[0][0])


@FUZZ
@given(
    value=st.binary(max_size=48).map(lambda b: base64.b64encode(b).decode())
    | st.text(st.sampled_from("AQZaz09+/=\n é"), max_size=24),
    step=st.sampled_from([4, 8, 12]),
)
@example(value="AA==AAAA", step=4)  # padding before the end
@example(value="QUI=", step=4)
@example(value="0000=", step=4)  # padding past a whole group: b64decode ignores it
@example(value="AAAAAAAA" * 3 + "AA==", step=8)
def test_a_load_file_s_base64_decodes_as_b64decode_in_steps(value: str, step: int) -> None:
    """A load's `file:` contents decoded a step at a time: the same bytes, or the same refusal,
    as one strict `base64.b64decode`."""
    try:
        expected: bytes | None = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        expected = None
    with _steps(20, step):
        try:
            got: bytes | None = _base64(value)
        except (binascii.Error, ValueError):
            got = None
    assert got == expected


# -- round trips ---------------------------------------------------------------------------------


@st.composite
def answers(draw: Any) -> tuple[Any, dtypes.DType, np.ndarray, bool]:
    """A ModelInferResponse with one output of any wire datatype (floats finite: JSON has no
    number for the others, and a request refuses them), and whether it goes back in binary."""
    dtype = draw(st.sampled_from(WIRE))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    if dtype is dtypes.BYTES:
        array = _strings(draw, shape)
        raw = bytes_contents(array)
    else:
        bits = draw(hnp.arrays(np.dtype(f"u{dtype.itemsize}"), shape))
        array = bits.view(dtype.numpy)
        if dtype.numpy.kind in "fV":  # finite values only
            array = np.where(np.isfinite(array.astype(np.float64)), array, np.zeros((), dtype.numpy))
        elif dtype.numpy.kind == "b":
            array = bits.astype(bool)
        raw = array.tobytes()
    response = hot.ModelInferResponse(model_name=MODEL, id=draw(st.text(max_size=8)))
    response.outputs.add(name="OUT", datatype=dtype.wire, shape=shape)
    response.raw_output_contents.append(raw)
    return response, dtype, array, draw(st.booleans())


def _encoded(response: Any, binary: bool) -> tuple[bytes, int | None]:
    pieces, length = encode_infer(response, RestInfer(None, {}, binary))  # type: ignore[arg-type]
    return b"".join(pieces), length


@FUZZ
@given(answer=answers())
@example(answer=(None, dtypes.by_token("f16"), np.array([65504, -0.0, 6e-8], np.float16), False))
@example(answer=(None, dtypes.by_token("bf16"), np.array([3.0e38, -1e-40], ml_dtypes.bfloat16), False))
@example(answer=(None, dtypes.by_token("u64"), np.array([2**64 - 1, 0], np.uint64), False))
@example(answer=(None, dtypes.by_token("i64"), np.array([-(2**63), 2**63 - 1], np.int64), False))
@example(
    answer=(None, dtypes.by_token("f32"), np.arange(-5000, 5000, dtype=np.float32) / 3, False)
)  # 3 slices
def test_an_answer_sent_back_as_a_request_is_the_same_tensor(answer: Any) -> None:
    """encode (an answer) then decode (as a request's input) is the identity, in JSON and in
    binary, for every datatype: the JSON writes every value so that it reads back the same."""
    response, dtype, array, binary = _response(answer)
    body, length = _encoded(response, binary)
    header = json.loads(body if length is None else body[:length])
    (out,) = header["outputs"]
    request = {"id": header.get("id", ""), "inputs": [{**out, "name": "IN"}]}
    blobs = [body[length:]] if length is not None else []
    request_body, request_length = _body(request, blobs)
    decoded = decode_infer(memoryview(request_body), request_length, MODEL, "")
    assert decoded.request.id == response.id
    (sent,) = decoded.request.inputs
    assert (sent.datatype, list(sent.shape)) == (dtype.wire, list(array.shape))
    assert bytes(decoded.request.raw_input_contents[0]) == response.raw_output_contents[0]


@FUZZ
@given(answer=answers())
@example(answer=(None, dtypes.by_token("f64"), np.arange(-5000, 5000, dtype=np.float64) / 3, False))
def test_triton_s_client_reads_an_answer_as_the_tensor_sent(answer: Any) -> None:
    response, dtype, array, binary = _response(answer)
    body, length = _encoded(response, binary)
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    got = result.as_numpy("OUT")
    assert got is not None and got.shape == array.shape
    if dtype is dtypes.BYTES:
        assert [b.decode() if isinstance(b, bytes) else b for b in got.ravel()] == list(array.ravel())
    elif dtype.numpy.kind == "V" or dtype.numpy == np.float16:
        assert_close(got.astype(np.float32), array.astype(np.float32), ulps=0)
    else:
        np.testing.assert_array_equal(got, array)


def _response(answer: Any) -> tuple[Any, dtypes.DType, np.ndarray, bool]:
    """An `answers()` value; an @example's is given by its array alone."""
    response, dtype, array, binary = answer
    if response is None:
        response = hot.ModelInferResponse(model_name=MODEL)
        response.outputs.add(name="OUT", datatype=dtype.wire, shape=array.shape)
        response.raw_output_contents.append(array.tobytes())
    return response, dtype, array, binary
