"""A ModelInferRequest whose tensor bytes stay where they arrived.

A 4.8 MB tensor parsed by upb is copied into the message, and copied again each time Python
reads `raw_input_contents`. `ViewedRequest` holds the request's other fields as a upb message
and its `raw_input_contents` as views of the bytes received: the REST body, or the gRPC message,
whose top-level fields `parse_viewed` walks in Python (a handful of tags) so that only the rest
goes through upb.
"""

from __future__ import annotations

from collections.abc import Sequence

from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.tensor_codec import InputTensor, Parameters, RequestedOutput

__all__ = ["VIEW_FROM_BYTES", "ViewedRequest", "parse_viewed"]

VIEW_FROM_BYTES = 64 << 10
"""gRPC ModelInferRequests of at least this many bytes are parsed by `parse_viewed`; below it,
upb's copies cost less than walking the fields in Python."""
_RAW_INPUT_CONTENTS = 7
"""The field number of `raw_input_contents` in ModelInferRequest."""
_LENGTH_DELIMITED = 2
_RAW_TAG = bytes([_RAW_INPUT_CONTENTS << 3 | _LENGTH_DELIMITED])
_FIXED_BYTES = {1: 8, 5: 4}
"""Wire types of fixed size: 64-bit and 32-bit."""


class ViewedRequest:
    """A hot-path ModelInferRequest (`hloserve.api.tensor_codec.InferRequest`) whose `raw_input_contents`
    are views of the bytes received; every other field is the upb message's."""

    __slots__ = ("_message", "raw_input_contents")

    def __init__(self, message: hot.ModelInferRequest, raw: list[bytes | memoryview]) -> None:
        self._message, self.raw_input_contents = message, raw

    @property
    def model_name(self) -> str:
        return self._message.model_name

    @property
    def model_version(self) -> str:
        return self._message.model_version

    @property
    def id(self) -> str:
        return self._message.id

    @property
    def parameters(self) -> Parameters:
        return self._message.parameters

    @property
    def inputs(self) -> Sequence[InputTensor]:
        return self._message.inputs

    @property
    def outputs(self) -> Sequence[RequestedOutput]:
        return self._message.outputs

    def SerializeToString(self) -> bytes:
        """The whole request on the wire: the message, then each raw entry as field 7 (a
        protobuf parser takes fields in any order and appends repeated ones in order)."""
        parts: list[bytes | memoryview] = [self._message.SerializeToString()]
        for entry in self.raw_input_contents:
            parts += [_RAW_TAG, _varint_bytes(len(entry)), entry]
        return b"".join(parts)


def parse_viewed(data: bytes) -> ViewedRequest:
    """Parse ModelInferRequest `data`, its `raw_input_contents` left as views of `data`.

    Raises ValueError for wire data that does not parse (a truncated field, a bad varint);
    fields of a wire type that cannot appear in ModelInferRequest (groups) go to upb, which
    judges them as it would in a whole message.
    """
    view = memoryview(data)
    rest: list[memoryview] = []
    raw: list[bytes | memoryview] = []
    kept = position = 0  # rest[-1] ends at `kept`; the field being read starts at `position`
    end = len(data)
    while position < end:
        tag, at = _varint(data, position)
        wire = tag & 7
        if wire == _LENGTH_DELIMITED:
            length, at = _varint(data, at)
            stop = at + length
            if tag >> 3 == _RAW_INPUT_CONTENTS:
                if stop > end:
                    raise ValueError("malformed protobuf wire data: raw_input_contents runs past the message")
                rest.append(view[kept:position])
                raw.append(view[at:stop])
                kept = stop
        elif wire == 0:
            _, stop = _varint(data, at)
        elif wire in _FIXED_BYTES:
            stop = at + _FIXED_BYTES[wire]
        else:
            stop = end  # a group or an invalid wire type: upb's to judge, with what follows
        position = stop
    rest.append(view[kept:end])
    try:
        message = hot.ModelInferRequest.FromString(b"".join(rest))
    except Exception as e:  # google.protobuf's DecodeError
        raise ValueError("malformed protobuf wire data") from e
    return ViewedRequest(message, raw)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at `position` and where it ends."""
    value = shift = 0
    for index in range(position, min(position + 10, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    raise ValueError("malformed protobuf wire data: a varint runs past the message or 10 bytes")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
