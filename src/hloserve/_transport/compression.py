"""gRPC message compression (`grpc-encoding` gzip and deflate), which grpclib 0.4.9 lacks.

Triton accepts compressed requests and compresses its replies for clients that compress theirs
(tritonclient's `compression_algorithm`); grpclib refuses every compressed message. Here:

* a compressed request is inflated with its output capped at `server.max_message_bytes`, so a
  small message that inflates to gigabytes is refused (RESOURCE_EXHAUSTED) before more than
  the limit is ever held; its inflated bytes count against the budgets of messages being
  received (`server.max_receiving_bytes`, per connection and in all), as an uncompressed
  message's bytes do, so small compressed messages cannot make the server hold more than they
  allow; a message that does not inflate is INVALID_ARGUMENT; an encoding other
  than gzip and deflate is UNIMPLEMENTED, as the gRPC spec says;
* a reply is compressed with the request's encoding when the request was compressed and its
  `grpc-accept-encoding` lists it (a client that compresses asks for it); replies say which
  encodings are accepted.

All of it applies to hloserve's own server only: its events processor keeps the two headers on
each stream (`keep_headers`), and `_grpclib_patches.GuardedStream` calls `refused` and `inflate`
when receiving and `send_initial_metadata` and `send_message` when replying.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from typing import Any, Protocol

import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError
from grpclib.metadata import encode_metadata
from multidict import MultiDict

__all__ = [
    "ACCEPT_ENCODING",
    "WBITS",
    "inflate",
    "keep_headers",
    "refused",
    "send_compressed",
    "send_initial_metadata",
]

WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's window bits for each encoding, on gRPC and REST: gzip framing, or zlib framing ("deflate",
as Triton reads it on both)."""
ACCEPT_ENCODING = "identity,deflate,gzip"
_LEVEL = 1
"""zlib's fastest level: most of the gain, least time."""
_PIECE = 4 << 20
"""What one step of a large inflation produces."""
ON_LOOP_BYTES = 1 << 10
"""A compressed request up to this size is inflated on the loop (at most about a megabyte, the
deflate format's ratio being at most about 1000:1: about a millisecond), a reply up to 64 times it
compressed there; larger ones in a worker thread (zlib lets go of the interpreter)."""


_HEADERS = ("grpc-encoding", "grpc-accept-encoding")


class Budget(Protocol):
    """The budgets of messages being received (`_h2_protocol.GuardedProtocol`'s)."""

    def receiving_room(self) -> int: ...
    def refusal(self, length: int, rpc: str, what: str = "") -> GRPCError | None: ...


def _header(stream: Any, name: str) -> str:
    """A request header of grpclib's server `stream` ("" when absent)."""
    for key, value in stream._stream.headers or ():
        if key == name:
            return str(value)
    return ""


def keep_headers(stream: Any, headers: Any) -> None:
    """Keep a request's encoding headers on its grpclib stream (grpclib's server keeps none that
    start with "grpc-")."""
    stream.headers = [(k, v) for k, v in headers or () if k in _HEADERS]


def refused(stream: Any, flags: int) -> GRPCError | None:
    """Why a message with these flags cannot be read (None: it can)."""
    if not flags:
        return None
    encoding = _header(stream, "grpc-encoding") or "identity"
    if encoding in WBITS:
        return None
    return GRPCError(
        Status.UNIMPLEMENTED,
        f"message compressed with grpc-encoding {encoding[:64]!r}; hloserve accepts {ACCEPT_ENCODING}",
    )


async def inflate(stream: Any, data: bytes, limit: int, rpc: str, budget: Budget) -> bytes:
    """A compressed message's bytes, inflated to at most `limit` bytes and what `budget` can
    hold (more is refused before it is inflated further); in a worker thread unless the message
    is small enough that its inflation cannot hold the loop (`ON_LOOP_BYTES`)."""
    encoding = _header(stream, "grpc-encoding")
    inflater = zlib.decompressobj(WBITS[encoding])
    room = budget.receiving_room()
    cap = min(limit, room)
    try:
        if len(data) <= ON_LOOP_BYTES:
            message = inflater.decompress(data, cap + 1)
        else:
            loop = asyncio.get_running_loop()
            message = await loop.run_in_executor(None, _inflate_in_pieces, inflater, data, cap + 1)
    except zlib.error as e:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"{rpc}: the {encoding} message does not inflate ({e})"
        ) from None
    if len(message) > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request of {len(data)} {encoding} bytes inflates past server.max_message_bytes ({limit}); "
            "send large tensors through system shared memory or raise the limit",
        )
    if len(message) > room:  # held as received bytes are: the same budgets
        what = f"a request of {len(data)} {encoding} bytes inflating past {room} bytes"
        refused = budget.refusal(len(message), rpc, what)
        assert refused is not None  # past the room
        raise refused
    if not inflater.eof:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{rpc}: the {encoding} message is truncated")
    return message


def _inflate_in_pieces(inflater: Any, data: bytes, most: int) -> bytes:
    """At most `most` inflated bytes, `_PIECE` at a time: zlib lets go of the interpreter while it
    inflates, but one call gathers its output into one object holding it (a quarter of a second
    for 256 MiB, during which the loop cannot run)."""
    pieces, size, pending = [], 0, data
    while size < most and not inflater.eof:
        piece = inflater.decompress(pending, min(_PIECE, most - size))
        pending = inflater.unconsumed_tail
        if not piece and not pending:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def _reply_encoding(stream: Any) -> str | None:
    encoding = _header(stream, "grpc-encoding")
    accepted = {e.strip() for e in _header(stream, "grpc-accept-encoding").split(",")}
    return encoding if encoding in WBITS and encoding in accepted else None


async def send_initial_metadata(self: grpclib.server.Stream[Any, Any], metadata: Any = None) -> None:
    """grpclib's, plus `grpc-accept-encoding` and, when the reply is compressed, `grpc-encoding`."""
    if self._send_initial_metadata_done:
        raise ProtocolError("Initial metadata was already sent")
    headers = [(":status", "200"), ("content-type", self._content_type)]
    headers.append(("grpc-accept-encoding", ACCEPT_ENCODING))
    encoding = _reply_encoding(self)
    if encoding is not None:
        headers.append(("grpc-encoding", encoding))
    (metadata,) = await self._dispatch.send_initial_metadata(MultiDict(metadata or ()))
    headers.extend(encode_metadata(metadata))
    await self._stream.send_headers(headers)
    self._send_initial_metadata_done = True


def _compress(encoded: bytes, encoding: str) -> bytes:
    packer = zlib.compressobj(_LEVEL, zlib.DEFLATED, WBITS[encoding])
    return packer.compress(encoded) + packer.flush()


async def send_compressed(self: grpclib.server.Stream[Any, Any], message: Any) -> bool:
    """grpclib's `send_message`, compressing the message when the reply is compressed; False
    (nothing sent) when it is not."""
    encoding = _reply_encoding(self)
    if encoding is None:
        return False
    if not self._send_initial_metadata_done:
        await self.send_initial_metadata()
    if not self._cardinality.server_streaming and self._send_message_done:
        raise ProtocolError("Message was already sent")
    (message,) = await self._dispatch.send_message(message)
    encoded = self._codec.encode(message, self._send_type)
    if len(encoded) <= ON_LOOP_BYTES << 6:
        data = _compress(encoded, encoding)
    else:
        data = await asyncio.get_running_loop().run_in_executor(None, _compress, encoded, encoding)
    await self._stream.send_data(struct.pack(">?I", True, len(data)) + data)
    self._send_message_done = True
    self._messages_sent += 1
    self._stream.connection.messages_sent += 1
    self._stream.connection.last_message_sent = time.monotonic()
    return True
