"""KServe V2 REST inference bodies to the hot-path ModelInferRequest and back.

A REST body is a JSON header, optionally followed by the binary tensors of Triton's binary
extension (`Inference-Header-Content-Length` says where the JSON ends, each input's
`binary_data_size` parameter how many bytes it takes). Every inline input, JSON or binary, is
turned into one `raw_input_contents` entry, so the gRPC decoder checks the request exactly as it
checks a gRPC one. Only what JSON adds is checked here: the shape of the JSON itself, the types
of its numbers, and the binary sizes. Every problem raises `InvalidInput`.
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import json
import json.scanner
import math
import re
import sys
import threading
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from hloserve import dtypes
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.tensor_codec import SHM_REGION, bytes_contents
from hloserve.api.viewed_request import ViewedRequest
from hloserve.errors import InvalidInput

__all__ = [
    "BINARY_DATA_SIZE",
    "RestInfer",
    "decode_infer",
    "dismantle",
    "encode_infer",
    "header_length",
    "json_output_bytes",
    "parse_json",
]

BINARY_DATA_SIZE = "binary_data_size"
"""Input and output parameter: the tensor's bytes follow the JSON header, this many."""
_BINARY_DATA = "binary_data"  # output parameter: send this output in binary
_BINARY_DATA_OUTPUT = "binary_data_output"  # request parameter: every output in binary
_REST_ONLY = (BINARY_DATA_SIZE, _BINARY_DATA, _BINARY_DATA_OUTPUT)  # not passed on to the service

_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}  # JSON kinds each dtype takes
"""numpy kinds of the JSON values a tensor of each kind accepts (V: bfloat16)."""
_KIND_NAMES = {"b": "booleans", "iu": "integers", "iuf": "numbers"}


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A `\\uD800`..`\\uDFFF` escape in JSON text: a string may hold a lone surrogate."""
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_DIMENSIONS = 64  # numpy's
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit takes '²', int() does not


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number (RFC 8259)")


def _lone_surrogate(value: object) -> bool:
    """Whether a string anywhere in `value` (a key or a value) holds a UTF-16 surrogate, which
    no UTF-8 text can (json.loads keeps an unpaired `\\ud800` as one)."""
    pending = [value]
    while pending:  # iterative: a client's nesting depth costs no stack
        item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
    return False


_collections = threading.Lock()
_collections_off = [0, False]
"""How many `no_collections` blocks are open (on the loop and in worker threads), and whether
collections were on before the first."""
_switching = threading.Lock()
_fair_parses = [0, 0.005]
"""How many fair parses run now, and the switch interval before the first."""
_FAIR_SWITCH_S = 0.0005
"""The interpreter's switch interval while a fair parse runs: the loop waits this long, not 5 ms,
each time it takes the interpreter back from the parsing thread (several times per request)."""


@contextlib.contextmanager
def _fair_switching() -> Iterator[None]:
    with _switching:
        if not _fair_parses[0]:
            _fair_parses[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_FAIR_SWITCH_S, _fair_parses[1]))
        _fair_parses[0] += 1
    try:
        yield
    finally:
        with _switching:
            _fair_parses[0] -= 1
            if not _fair_parses[0]:
                sys.setswitchinterval(_fair_parses[1])


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """No garbage collection inside: parsing a client's JSON makes no cycles, but its lists and
    dicts count towards collections, and those amid a parse, through the worker's heap of jax
    objects, cost 15 times the parse (512 KiB of `[[],[],...]`: 160 ms against 10), holding the
    interpreter. Blocks may overlap (worker threads): collections resume when the last ends."""
    with _collections:
        if not _collections_off[0]:
            _collections_off[1] = gc.isenabled()
            gc.disable()
        _collections_off[0] += 1
    try:
        yield
    finally:
        with _collections:
            _collections_off[0] -= 1
            if not _collections_off[0] and _collections_off[1]:
                gc.enable()


CONTAINER_BYTES = 64
"""An inference request's JSON parsed on the loop may hold one array or object per this many bytes
of `INLINE_JSON` (4096): arrays in `data` cost 5 times what numbers do to parse and convert
(`[[],[],...]`), and so bounded, the costliest such JSON costs what numbers would."""


INLINE_JSON = 256 << 10
"""JSON up to this is parsed by Python's C parser where it is (on the event loop: 30 to 45 ms at
worst on a busy 2-core machine); larger JSON is parsed by `parse_json(fair=True)` in a worker
thread."""


def _fair_loads(text: bytes) -> Any:
    """`json.loads` by Python's own pure-Python scanner (strings and numbers still scanned in C):
    5 times slower than the C parser, but it runs bytecode throughout, so a worker thread parsing
    with it gives the interpreter back to the event loop every switch interval (5 ms); the C
    parser would hold it for the whole parse (a 64 MB body: 5.9 s). Meanwhile the switch interval
    is `_FAIR_SWITCH_S`."""
    decoder = json.JSONDecoder(parse_constant=_not_json)
    decoder.parse_string = _fair_scanstring  # type: ignore[attr-defined]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    with _fair_switching():
        return decoder.decode(_decode_text(text))


_STRING_STEP = 1 << 20
"""Characters of one JSON string scanned at once by `_fair_scanstring` (about 5 ms)."""
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _fair_scanstring(text: str, end: int, strict: bool = True) -> tuple[str, int]:
    """`json.decoder.scanstring` (the C one), a `_STRING_STEP` of the string at a time: one call
    over a whole string holds the interpreter throughout (a load's 64 MiB base64 file: 0.6 s).
    A string that ends within a step (most) is one call; a longer one is cut before an escape,
    never between the halves of a surrogate pair."""
    pieces, start = [], end
    scan = json.decoder.c_scanstring  # type: ignore[attr-defined]
    while True:
        stop = start + _STRING_STEP
        quote = text.find('"', start, stop)  # the first that no backslash escapes:
        while quote >= 0 and text[quote - 1] == "\\" and not _starts_escape(text, start, quote):
            quote = text.find('"', quote + 1, stop)
        if quote >= 0:  # it ends in this step
            value, index = scan(text, start, strict)
            pieces.append(value)
            return "".join(pieces), index
        if stop >= len(text):
            raise json.JSONDecodeError("Unterminated string starting at", text, end - 1)
        cut = _safe_cut(text, start, stop)
        try:
            value, _ = scan(text[start:cut] + '"', 0, strict)
        except json.JSONDecodeError as e:
            raise json.JSONDecodeError(e.msg, text, start + e.pos) from None
        pieces.append(value)
        start = cut


def _safe_cut(text: str, start: int, stop: int) -> int:
    """Where to end a step of a string that starts at `start` (never inside an escape): `stop`
    when no escape reaches it, else the start of the last escape before it, or of the high half
    of a pair before a low one (just after the pair when that is where the step starts).
    `stop - start` is at least 13."""
    last = text.rfind("\\", start, stop)
    if last < stop - 12:  # none (-1), or none reaching `stop`: an escape is 12 characters at most
        return stop
    run = last
    while run > start and text[run - 1] == "\\":
        run -= 1
    if (last + 1 - run) % 2 == 0:  # escaped backslashes, all ending before `stop`
        return last + 1
    cut = last  # an escape starts here
    if _HIGH_SURROGATE.fullmatch(text, cut - 6, cut) and _starts_escape(text, start, cut - 6):
        return cut - 6 if cut - 6 > start else cut + (6 if text[cut + 1 : cut + 2] == "u" else 2)
    return cut


def _starts_escape(text: str, start: int, at: int) -> bool:
    """Whether the character at `at` is itself, not escaped (an even run of backslashes, from
    `start`, precedes it): a backslash there begins an escape, a quote there ends the string."""
    run = at
    while run > start and text[run - 1] == "\\":
        run -= 1
    return (at - run) % 2 == 0


def _decode_text(text: bytes) -> str:
    """`text` as `json.loads` decodes it, a MiB at a time (4 MiB at once took 10 ms)."""
    decoder = codecs.getincrementaldecoder(json.detect_encoding(text))("surrogatepass")
    step = 1 << 20
    pieces = [decoder.decode(text[i : i + step]) for i in range(0, len(text), step)]
    return "".join(pieces) + decoder.decode(b"", final=True)


def parse_json(text: bytes, max_containers: int | None = None, fair: bool = False) -> Any:
    """`text` as JSON, as RFC 8259 has it; ValueError naming the problem when it is not JSON
    (NaN and Infinity included), nests too deep to parse, holds a lone UTF-16 surrogate, or more
    than `max_containers` arrays and objects (`[` and `{`, strings' included). `fair`: parsed as
    `_fair_loads` does, for a worker thread."""
    if max_containers is not None:
        containers = text.count(b"[") + text.count(b"{")
        if containers > max_containers:
            raise ValueError(
                f"the request's JSON holds {containers} arrays and objects, past the server's limit of "
                f"{max_containers} for JSON parsed on its event loop (up to {INLINE_JSON} bytes); send "
                "tensors' data flat, or in binary"
            )
    try:
        with no_collections():
            value = _fair_loads(text) if fair else json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("the request is not accepted: its JSON nests arrays or objects too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the request is not valid JSON: {e}"[:200]) from None
    if _SURROGATE_ESCAPE.search(text) and _lone_surrogate(value):
        raise ValueError(
            "the request holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape that is not "
            "half of a pair); strings must be valid Unicode"
        )
    return value


def header_length(value: str | None, model: str) -> int | None:
    """The JSON header's length from an `Inference-Header-Content-Length` value (None: the whole
    body is JSON). Optional whitespace around at most 19 ASCII digits, so it fits in an int64."""
    if value is None:
        return None
    if not _DIGITS.fullmatch(value.strip(" \t")):
        raise _fail(model, f"Inference-Header-Content-Length must be a byte count, got {value[:60]!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class RestInfer:
    """A decoded REST inference request."""

    request: ViewedRequest
    """The request handed to the service."""
    binary: dict[str, bool]
    """Per requested output, whether it goes back in binary."""
    binary_default: bool
    """For outputs not requested by name: the request's `binary_data_output`."""


def _fail(model: str, problem: str, tensor: str | None = None) -> InvalidInput:
    return InvalidInput(model, problem, tensor)


def _out_of_range(model: str, name: str, value: object, wire: str, numpy: np.dtype[Any]) -> InvalidInput:
    """A JSON number the datatype cannot hold, named with the range it holds ("INT8 holds
    -128..127"); a value of many digits is shown by its head and length."""
    if numpy.kind in "iu":
        info = np.iinfo(numpy)
        holds = f"{info.min}..{info.max}"
    else:
        largest = float(ml_dtypes.finfo(numpy).max)  # type: ignore[no-untyped-call]  # bf16 too
        holds = f"{-largest:g}..{largest:g}"
    shown = str(value)
    if len(shown) > 32:
        shown = f"{shown[:16]}... ({len(shown)} digits)"
    return _fail(model, f"'data' value {shown} is out of range: {wire} holds {holds}", name)


_TYPE_NAMES: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}


def _get(obj: dict[str, Any], key: str, kind: type, model: str, where: str) -> Any:
    """`obj[key]` if present (None if not), checked to be a `kind`."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise _fail(model, f"{where}'{key}' must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:60]}")
    return value


def _set_parameters(
    target: MutableMapping[str, hot.InferParameter], parameters: dict[str, Any], model: str, where: str
) -> None:
    """Copy JSON parameters into a protobuf parameter map (bool, int, float or string each)."""
    for key, value in parameters.items():
        if key in _REST_ONLY:
            continue
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if not -(1 << 63) <= value < 1 << 63:
                raise _fail(model, f"{where}parameter {key!r} = {value} does not fit in int64")
            param.int64_param = value
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(model, f"{where}parameter {key!r} is not a finite number")
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise _fail(model, f"{where}parameter {key!r} must be a boolean, number or string")


def _shape(tensor: dict[str, Any], model: str, name: str) -> list[int]:
    shape: list[int] | None = _get(tensor, "shape", list, model, "")
    if shape is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise _fail(model, "'shape' must be an array of integers", name)
    if not all(0 <= d < 1 << 62 for d in shape):
        raise _fail(model, f"shape {shape} has a negative or impossibly large dimension", name)
    return shape


def _json_strings(model: str, name: str, data: object, shape: list[int]) -> bytes:
    """The raw contents of a BYTES tensor given as JSON strings (flat or nested)."""
    flat: list[Any] = []
    pending = [data]
    while pending:  # iterative: a client's nesting depth costs no stack
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(reversed(item))
        elif isinstance(item, str):
            flat.append(item.encode())
        else:
            raise _fail(model, "'data' must hold JSON strings for BYTES", name)
    count = math.prod(shape)
    if len(flat) != count:
        raise _fail(model, f"'data' holds {len(flat)} values, shape {shape} needs {count}", name)
    return bytes_contents(np.array(flat, dtype=object))


def dismantle(value: object) -> None:
    """Empty every list in `value` longer than `_SLICE` slice by slice: freeing a list of a million
    lists is one C call that holds the interpreter for 50 ms or more; in slices a worker thread
    gives it back between them."""
    pending = [value]
    while pending:  # iterative: a client's nesting depth costs no stack
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(v for v in item.values() if isinstance(v, (list, dict)))
        elif isinstance(item, list):
            if len(item) > _SLICE:
                while item:
                    del item[-_SLICE:]
            else:
                pending.extend(v for v in item if isinstance(v, (list, dict)))


_SLICE = 1 << 12
"""Values converted by numpy, or freed, at once from a long JSON list: 2 ms at most (4096 empty
lists; 65536 took 33 ms)."""


def _asarray(data: object) -> np.ndarray:
    """`np.asarray(data)`; a list longer than `_SLICE` converted slice by slice along its first
    axis (the interpreter may pass to another thread between slices) when every slice comes out
    the same kind and shape, which makes the same array."""
    if not isinstance(data, list) or len(data) <= _SLICE:
        return np.asarray(data)
    slices = [np.asarray(data[i : i + _SLICE]) for i in range(0, len(data), _SLICE)]
    if len({(s.dtype, s.shape[1:]) for s in slices}) == 1 and slices[0].dtype.kind in "biuf":
        return np.concatenate(slices)
    del slices
    return np.asarray(data)


def _wide_integers(
    model: str, name: str, data: object, wire: str, numpy: np.dtype[Any], not_numbers: InvalidInput
) -> np.ndarray:
    """JSON integers that numpy reads as floats or objects: one past int64 (a UINT64 in its upper
    half) beside any other, which numpy promotes to float64 and loses. Read as `numpy` itself
    when every value is an integer in its range."""
    objects = np.asarray(data, dtype=object)
    if not all(type(value) is int for value in objects.flat):
        raise not_numbers
    try:
        return np.asarray(objects, dtype=numpy)
    except OverflowError:
        bad = next(v for v in objects.flat if not np.iinfo(numpy).min <= v <= np.iinfo(numpy).max)
        raise _out_of_range(model, name, bad, wire, numpy) from None


def _json_tensor(model: str, name: str, data: object, wire: str, shape: list[int]) -> bytes:
    """The raw bytes of JSON `data` (flat or nested, row-major) as a `wire` tensor of `shape`."""
    try:
        dtype = dtypes.by_wire(wire)
    except KeyError as e:
        raise _fail(model, str(e.args[0]), name) from None
    if dtype is dtypes.BYTES:
        return _json_strings(model, name, data, shape)
    accepted = _KINDS[dtype.numpy.kind]
    not_numbers = _fail(model, f"'data' must hold JSON {_KIND_NAMES[accepted]} for {wire}", name)
    try:
        values = _asarray(data)
    except ValueError:
        depth, item = 0, data
        while isinstance(item, list) and item:
            depth, item = depth + 1, item[0]
        if depth > _MAX_DIMENSIONS:
            raise _fail(
                model,
                f"'data' has too many dimensions: it nests {depth} deep, a tensor has at most "
                f"{_MAX_DIMENSIONS}",
                name,
            ) from None
        raise _fail(model, "'data' is a ragged array; nest it regularly or send it flat", name) from None
    if values.dtype.kind == "O" and "f" in accepted:  # an integer past 64 bits is a float here
        try:
            values = np.asarray(data, dtype=np.float64)
        except OverflowError:  # an integer past a double's range
            bad = max((v for v in np.asarray(data, dtype=object).flat if type(v) is int), key=abs)
            raise _out_of_range(model, name, bad, wire, dtype.numpy) from None
        except (TypeError, ValueError):
            raise not_numbers from None
        if np.isnan(values).any():  # a null (a NaN token was refused by the parser)
            raise not_numbers
    if values.dtype.kind in "fO" and accepted == "iu":
        values = _wide_integers(model, name, data, wire, dtype.numpy, not_numbers)
    if values.size and values.dtype.kind not in accepted:
        raise not_numbers
    count = math.prod(shape)
    if values.size != count:
        raise _fail(model, f"'data' holds {values.size} values, shape {shape} needs {count}", name)
    if values.dtype.kind in "iu" and dtype.numpy.kind in "iu" and values.size:
        info = np.iinfo(dtype.numpy)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise _out_of_range(model, name, bad, wire, dtype.numpy)
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise _fail(model, "'data' holds a number too large for a double (such as 1e400)", name)
    with np.errstate(over="ignore"):
        cast = np.ascontiguousarray(values, dtype=dtype.numpy)
    if values.dtype.kind in "iuf" and "f" in accepted and dtype.numpy != np.float64 and values.size:
        if not np.isfinite(cast.astype(np.float64)).all():
            largest = float(np.abs(values).max())
            raise _out_of_range(model, name, f"{largest:g}", wire, dtype.numpy)
    return cast.tobytes()


def decode_infer(body: memoryview, header_length: int | None, model: str, version: str) -> RestInfer:
    """Parse a REST inference body for `model` (the URL's) into a request whose binary tensors
    are views of `body`; the parsed JSON is gone, without a collection, when this returns.

    Its JSON takes at most 45 ms of the caller's interpreter: up to `INLINE_JSON` bytes it is
    parsed by the C parser with a bound on its arrays and objects (`parse_json`); past it, this
    must be called in a worker thread: its JSON is parsed by `_fair_loads` and its `data` lists
    converted in slices (`_asarray`), giving the interpreter back between them."""
    parsed: list[Any] = []
    with no_collections():
        try:
            return _decode_infer(body, header_length, model, version, parsed)
        except InvalidInput as e:
            raise e.with_traceback(None) from None  # its frames held the parsed JSON
        finally:
            dismantle(parsed)


def _decode_infer(
    body: memoryview, header_length: int | None, model: str, version: str, parsed: list[Any]
) -> RestInfer:
    length = len(body) if header_length is None else header_length
    if not 0 <= length <= len(body):
        raise _fail(
            model, f"Inference-Header-Content-Length is {length}, the body has only {len(body)} bytes"
        )
    try:
        fair = length > INLINE_JSON
        header = parse_json(bytes(body[:length]), None if fair else INLINE_JSON // CONTAINER_BYTES, fair)
        parsed.append(header)
    except ValueError as e:
        raise _fail(model, str(e)) from None
    if not isinstance(header, dict):
        raise _fail(model, "the request must be a JSON object with 'inputs'")
    request = hot.ModelInferRequest(model_name=model, model_version=version)
    request_id = _get(header, "id", str, model, "")
    if request_id:
        request.id = request_id
    parameters = _get(header, "parameters", dict, model, "") or {}
    _set_parameters(request.parameters, parameters, model, "")
    binary_default = parameters.get(_BINARY_DATA_OUTPUT) is True
    inputs = _get(header, "inputs", list, model, "")
    if not inputs:
        raise _fail(model, "the request has no 'inputs'")
    offset = length
    raw: list[bytes | memoryview] = []
    for tensor in inputs:
        if not isinstance(tensor, dict):
            raise _fail(model, "each of 'inputs' must be an object with name, shape, datatype")
        name = _get(tensor, "name", str, model, "an input's ")
        if not name:
            raise _fail(model, "an input has no 'name'")
        wire = _get(tensor, "datatype", str, model, f"input {name!r}: ") or ""
        shape = _shape(tensor, model, name)
        params = _get(tensor, "parameters", dict, model, f"input {name!r}: ") or {}
        added = request.inputs.add(name=name, datatype=wire, shape=shape)
        _set_parameters(added.parameters, params, model, f"input {name!r}: ")
        if SHM_REGION in params:
            continue
        size = params.get(BINARY_DATA_SIZE)
        if size is not None and tensor.get("data") is not None:
            raise _fail(model, f"has both 'data' and {BINARY_DATA_SIZE}; send one", name)
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _fail(model, f"{BINARY_DATA_SIZE} must be a non-negative integer", name)
            if offset + size > len(body):
                raise _fail(
                    model,
                    f"{BINARY_DATA_SIZE} is {size}, but only {len(body) - offset} bytes of binary data "
                    "are left in the body",
                    name,
                )
            view = body[offset : offset + size]
            raw.append(bytes(view) if wire == "BYTES" else view)  # BYTES elements become objects
            offset += size
        elif tensor.get("data") is not None:
            raw.append(_json_tensor(model, name, tensor["data"], wire, shape))
        else:
            raise _fail(model, f"has no 'data', {BINARY_DATA_SIZE} or {SHM_REGION}", name)
    if offset != len(body):
        raise _fail(
            model,
            f"{len(body) - offset} bytes follow the JSON header and the inputs' {BINARY_DATA_SIZE}; "
            "the binary sizes must add up to the body",
        )
    binary: dict[str, bool] = {}
    for output in _get(header, "outputs", list, model, "") or ():
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise _fail(model, "each of 'outputs' must be an object with a 'name'")
        params = _get(output, "parameters", dict, model, f"output {output['name']!r}: ") or {}
        requested = request.outputs.add(name=output["name"])
        _set_parameters(requested.parameters, params, model, f"output {output['name']!r}: ")
        binary[output["name"]] = params.get(_BINARY_DATA, binary_default) is True
    return RestInfer(ViewedRequest(request, raw), binary, binary_default)


def json_output_bytes(response: hot.ModelInferResponse, decoded: RestInfer) -> int:
    """The tensor bytes of `response` that `encode_infer` writes as JSON numbers (those past
    `INLINE_JSON` are encoded in a worker thread: 3 ms per 4096 values)."""
    return sum(
        len(raw)
        for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True)
        if SHM_REGION not in tensor.parameters and not decoded.binary.get(tensor.name, decoded.binary_default)
    )


def encode_infer(
    response: hot.ModelInferResponse, decoded: RestInfer, fair: bool = False
) -> tuple[list[bytes], int | None]:
    """The REST body of a ModelInferResponse, as the JSON header and the binary outputs that
    follow it (sent as they are, not joined), and the header's length when binary follows.
    Numbers are written `_SLICE` values at a time, so that, in a worker thread, the interpreter
    passes to the loop between slices (`json.dumps` of a whole tensor is one C call); `fair`, for
    a worker thread: meanwhile the switch interval is `_FAIR_SWITCH_S`, as for a fair parse."""
    if fair:
        with _fair_switching():
            return encode_infer(response, decoded)
    outputs = []
    blobs: list[bytes] = []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        data = None
        if SHM_REGION in tensor.parameters:
            out["parameters"] = {
                key: getattr(value, value.WhichOneof("parameter_choice"))
                for key, value in tensor.parameters.items()
            }
        elif decoded.binary.get(tensor.name, decoded.binary_default):
            out["parameters"] = {BINARY_DATA_SIZE: len(raw)}
            blobs.append(raw)
        elif tensor.datatype == "BYTES":  # classification strings
            data = _dumps(_strings(raw))
        else:
            array = np.frombuffer(raw, dtype=dtypes.by_wire(tensor.datatype).numpy)
            if array.dtype.kind == "V" or array.dtype == np.float16:  # bfloat16, float16: as floats
                array = array.astype(np.float32)
            data = (
                b"["
                + b",".join(
                    _dumps(_finite_json(array[i : i + _SLICE]))[1:-1] for i in range(0, len(array), _SLICE)
                )
                + b"]"
            )
        text = _dumps(out)
        outputs.append(text if data is None else text[:-1] + b',"data":' + data + b"}")
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": "1"}
    if response.id:
        body["id"] = response.id
    header = _dumps(body)[:-1] + b',"outputs":[' + b",".join(outputs) + b"]}"
    return [header, *blobs], len(header) if blobs else None


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _finite_json(array: np.ndarray) -> list[Any]:
    """`array`'s values as JSON values; NaN and the infinities, which JSON has no number for, as
    the strings "NaN", "Infinity" and "-Infinity" (protobuf's JSON mapping of a float)."""
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return list(array.tolist())
    values = array.astype(object)
    values[np.isnan(array)] = "NaN"
    values[np.isposinf(array)] = "Infinity"
    values[np.isneginf(array)] = "-Infinity"
    return list(values.tolist())


def _strings(raw: bytes) -> list[str]:
    """The elements of a BYTES tensor's raw contents (each 4-byte little-endian length first)."""
    strings, offset = [], 0
    while offset < len(raw):
        length = int.from_bytes(raw[offset : offset + 4], "little")
        strings.append(raw[offset + 4 : offset + 4 + length].decode("utf-8", "replace"))
        offset += 4 + length
    return strings
