"""Request bodies on the REST port, read within the server's bounds, and content codings.

A body is bounded by `server.max_message_bytes` (`server.http_max_json_bytes` for JSON), refused
from its Content-Length before it is read (and counted while read when chunked or compressed),
against `server.max_receiving_bytes` for all bodies together, and by `server.http_body_timeout_s`.
gzip and deflate bodies inflate within `server.http_max_inflation_ratio`. A body with a
Content-Length is read into one buffer, whose binary tensors reach the data plane as views of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve._transport.compression import WBITS
from hloserve.api.rest.inflight import InFlight
from hloserve.config import ServerConfig

__all__ = ["BodyReader", "Disconnected", "HttpRefusal", "Receive", "compress", "response_encoding"]


_RATIO_FLOOR = 1 << 20
"""A compressed body may always inflate to this (`server.http_max_inflation_ratio` or not)."""

_INLINE_INFLATE = 1 << 20
"""A body whose inflation is capped at this is inflated on the loop (3 ms at most); past it, in
a worker thread (a hop costs more than inflating a small body)."""


class HttpRefusal(GRPCError):
    """A request refused at the HTTP layer (its body or headers), before the service sees it;
    `http` overrides the HTTP status that `status` maps to. A GRPCError, so that a call's
    accounting (`hloserve.api.data_plane.Call`) reads its status as any other's."""

    def __init__(
        self,
        message: str,
        status: Status = Status.INVALID_ARGUMENT,
        headers: Mapping[str, str] | None = None,
        http: int | None = None,
    ) -> None:
        super().__init__(status, message)
        self.headers, self.http = dict(headers or {}), http

    def __str__(self) -> str:
        return self.message or ""


class Disconnected(GRPCError):
    """The client closed its connection while its request was being served: CANCELLED, as a
    gRPC client's cancellation (traced, not counted)."""

    def __init__(self) -> None:
        super().__init__(Status.CANCELLED, "the client closed its connection")


def response_encoding(accept: str | None) -> str | None:
    """gzip or deflate when the client's Accept-Encoding prefers it (q weights as Triton reads
    them); None for identity."""
    best, weight = None, 0.0
    for part in (accept or "").split(","):
        name, _, q = part.partition(";")
        name, q = name.strip().lower(), q.strip()
        try:
            w = float(q[2:]) if q.startswith("q=") else 1.0
        except ValueError:
            continue
        if name in ("identity", "gzip", "deflate") and w > weight:
            best, weight = name, w
    return None if best == "identity" else best


COMPRESS_ON_LOOP_BYTES = 64 << 10
"""An answer up to this size is compressed on the loop (well under a millisecond); a larger one in
a worker thread (zlib lets go of the interpreter), as large bodies are parsed and inflated."""


async def compress(pieces: Sequence[bytes | memoryview], encoding: str) -> bytes:
    """The answer's pieces as one gzip or deflate body, built off the loop when it is large."""
    if sum(len(p) for p in pieces) <= COMPRESS_ON_LOOP_BYTES:
        return _compress(pieces, encoding)
    return await asyncio.get_running_loop().run_in_executor(None, _compress, pieces, encoding)


def _compress(pieces: Sequence[bytes | memoryview], encoding: str) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, WBITS[encoding])
    return b"".join([*(compressor.compress(p) for p in pieces), compressor.flush()])


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def _stream(receive: Receive) -> AsyncIterator[bytes]:
    """An ASGI request body, chunk by chunk; a client that disconnects ends the request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


_PIECE = 1 << 20
"""Bytes inflated per zlib call: the interpreter is held only between calls, and past a bound
inflation stops within one piece of it."""


def _inflate(
    inflater: zlib._Decompress, data: bytes | memoryview, cap: int, book: Callable[[int], None]
) -> memoryview | None:
    """`data` inflated by `inflater` into one buffer, piece by piece; None as soon as it passes
    `cap` bytes (what it inflated is dropped). Each piece is booked by `book` (the bytes being
    received), which raises when the server has no room for it. Runs in a worker thread for a
    large `cap`: zlib frees the interpreter while it inflates, and the pieces are copied one by one
    (one copy of 1 GiB would hold it for a third of a second)."""
    pieces: list[bytes] = []
    size = 0
    while not inflater.eof:
        piece = inflater.decompress(data, min(_PIECE, cap + 1 - size))
        data = inflater.unconsumed_tail
        if not piece:
            break  # every byte taken: truncated, the caller sees no end of stream
        size += len(piece)
        if size > cap:
            del piece, pieces
            _return_memory(size)
            return None
        try:
            book(len(piece))
        except HttpRefusal:
            del piece, pieces
            _return_memory(size)
            raise
        pieces.append(piece)
    if len(pieces) == 1:
        return memoryview(pieces[0])
    view = np.empty(size, np.uint8).data
    offset = size
    while pieces:  # from the end: each piece is dropped once copied
        piece = pieces.pop()
        view[offset - len(piece) : offset] = piece
        offset -= len(piece)
    del piece
    _return_memory(size)
    return view


_INLINE_MEMBERS_BYTES = 4096
"""A compressed body inflated on the loop is at most this long, so that the members it may hold
(20 bytes at least each, `_inflate_members`) are a few hundred turns at most."""


def _inflate_members(
    encoding: str, data: bytes | memoryview, cap: int, book: Callable[[int], None]
) -> memoryview | None:
    """A gzip body of one or more members (RFC 1952 section 2.2: `cat a.gz b.gz` is one gzip
    file), or a deflate body (one zlib stream), inflated into one buffer of at most `cap` bytes
    in all; None past it. HttpRefusal when a member is truncated or bytes follow a deflate stream;
    zlib.error when a member is not valid."""
    members: list[memoryview] = []
    size = 0
    while True:
        inflater = zlib.decompressobj(WBITS[encoding])
        try:
            member = _inflate(inflater, data, cap - size, book)
        except zlib.error:
            if not members:
                raise
            raise HttpRefusal(
                f"{len(data)} bytes follow the end of the gzip data and are not a gzip member"
            ) from None
        if member is None:
            return None
        if not inflater.eof:
            raise HttpRefusal(f"the {encoding} body is truncated")
        members.append(member)
        size += len(member)
        data = inflater.unused_data
        if not data:
            break
        if encoding != "gzip":
            raise HttpRefusal(
                f"{len(data)} bytes follow the end of the {encoding} data; send one compressed stream"
            )
    if len(members) == 1:
        return members[0]
    joined = np.empty(size, np.uint8).data  # booked already, member by member
    offset = 0
    while members:  # each member dropped once copied
        member = members.pop(0)
        joined[offset : offset + len(member)] = member
        offset += len(member)
    return joined


_LIBC = ctypes.CDLL(None)

_TRIM_BYTES = 16 << 20


def _return_memory(freed: int) -> None:
    """Give the allocator's free memory back to the system after `freed` bytes of pieces: glibc
    keeps freed 1 MiB blocks in its arenas (a refused 100 MB bomb left the worker 100 MB larger)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if freed >= _TRIM_BYTES and trim is not None:
        trim(0)


class BodyReader:
    """Reads request bodies within the server's bounds: their bytes, inflation and time."""

    def __init__(self, config: ServerConfig, inflight: InFlight) -> None:
        self._limit = config.max_message_bytes
        self.json_limit = config.http_max_json_bytes
        self._ratio = config.http_max_inflation_ratio
        self._max_receiving = config.max_receiving_bytes
        self.receiving = 0
        """Bytes of request bodies being received or inflated now (`server.max_receiving_bytes`)."""
        self._receiving_lock = threading.Lock()  # inflations book from worker threads
        self.inflight = inflight

    async def read(
        self, headers: Mapping[str, str], receive: Receive, limit: int | None = None
    ) -> memoryview:
        """The request body, decompressed, in one buffer; refused once it, or its inflated bytes,
        pass `limit` (`server.http_max_json_bytes`, or `server.max_message_bytes` when None or
        less: at once when its Content-Length does) or take longer than `server.http_body_timeout_s`."""
        limit, key = self._bound(limit)
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in (*WBITS, "identity", ""):
            raise HttpRefusal(
                f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or identity",
                Status.UNIMPLEMENTED,  # as Triton: 501, saying what it accepts
                {"Accept-Encoding": "gzip, deflate"},
            )
        task, inflight = asyncio.current_task(), self.inflight
        assert task is not None
        inflight.reading[task] = asyncio.get_running_loop().time() + inflight.body_timeout_s
        try:
            body = await self._receive(headers.get("content-length"), receive, limit, key)
        except asyncio.CancelledError:
            if not inflight.ours(task):
                raise
            raise HttpRefusal(
                f"the request body did not arrive within {inflight.body_timeout_s} s "
                "(server.http_body_timeout_s)",
                Status.DEADLINE_EXCEEDED,
                http=408,
            ) from None
        finally:
            inflight.reading.pop(task, None)
            inflight.cancelled.discard(task)  # a cancellation the read swallowed, if any
        if encoding not in WBITS:
            return memoryview(body)
        return await self._inflate(body, encoding, limit, key)

    async def _inflate(self, body: bytes | memoryview, encoding: str, limit: int, key: str) -> memoryview:
        """A gzip or deflate body inflated to at most `limit` bytes and `server.http_max_inflation_ratio`
        times its size (1 MiB at least): zlib stops at the first byte past the bound, and the
        request is refused. Past `_INLINE_INFLATE` bytes it inflates in a worker thread (zlib frees
        the interpreter meanwhile), so a bomb never stalls the loop. The inflated bytes count
        against `server.max_receiving_bytes` while it inflates, as received ones do."""
        cap = min(limit, max(self._ratio * len(body), _RATIO_FLOOR))
        booked = [0]

        def book(size: int) -> None:
            self._reserve(size)
            booked[0] += size

        try:
            if cap <= _INLINE_INFLATE and len(body) <= _INLINE_MEMBERS_BYTES:
                inflated = _inflate_members(encoding, body, cap, book)
            else:
                loop = asyncio.get_running_loop()
                inflated = await loop.run_in_executor(None, _inflate_members, encoding, body, cap, book)
        except zlib.error as e:
            raise HttpRefusal(f"the body is not valid {encoding} data: {e}") from None
        finally:
            self._release(booked[0])
        if inflated is None:
            if cap == limit:
                raise self.too_large(f"{encoding} body that inflates to more than {limit} bytes", limit, key)
            raise HttpRefusal(
                f"the {len(body)}-byte {encoding} body inflates past {cap} bytes, more than "
                f"server.http_max_inflation_ratio ({self._ratio}) times its size"
            )
        return inflated

    async def _receive(
        self, declared: str | None, receive: Receive, limit: int, key: str
    ) -> bytes | memoryview:
        """The body as sent: with a Content-Length, each chunk copied once into a buffer of that
        size (numpy's: not zeroed first, as a bytearray is), used only once every declared byte
        has been written into it; chunked, joined once it has all come. Its bytes count against
        `server.max_receiving_bytes` as they arrive, as gRPC's messages being received do (a
        declared length books nothing: a client that sends nothing holds nothing)."""
        expected = None
        if declared is not None:
            expected = int(declared)  # h11 has checked it is digits, and the only length
            if expected > limit:
                raise self.too_large(f"request body of {declared} bytes", limit, key)
        chunks: list[bytes] = []
        view, size = None, 0
        try:
            async for chunk in _stream(receive):
                if size + len(chunk) > (limit if expected is None else expected):
                    if expected is None:
                        raise self.too_large(f"request body of more than {limit} bytes", limit, key)
                    raise HttpRefusal(f"the body has more than its Content-Length of {expected} bytes")
                self._reserve(len(chunk))
                if expected is None:
                    chunks.append(chunk)
                else:
                    if view is None:
                        view = np.empty(expected, np.uint8).data
                    view[size : size + len(chunk)] = chunk
                size += len(chunk)
            if expected is None:
                return b"".join(chunks)
            if size != expected:
                raise HttpRefusal(f"the body has {size} bytes, its Content-Length says {expected}")
            return b"" if view is None else view
        finally:
            self._release(size)

    def _reserve(self, size: int) -> None:
        with self._receiving_lock:
            if self.receiving + size > self._max_receiving:
                raise HttpRefusal(
                    f"the server is receiving {self.receiving} bytes of request bodies; {size} more "
                    f"would pass server.max_receiving_bytes ({self._max_receiving}); retry later",
                    Status.UNAVAILABLE,
                )
            self.receiving += size

    def _release(self, size: int) -> None:
        with self._receiving_lock:
            self.receiving -= size

    def _bound(self, limit: int | None) -> tuple[int, str]:
        """The bound `read` applies for `limit`, and its config key."""
        if limit is None or limit >= self._limit:
            return self._limit, "server.max_message_bytes"
        return limit, "server.http_max_json_bytes"

    def refusal_from_head(self, path: str, headers: Mapping[str, str]) -> HttpRefusal | None:
        """The refusal a request's body will meet from its declared Content-Length alone, as the
        routes bound it: a load's body (file contents) and an inference body with the binary
        extension's header up to `server.max_message_bytes`, any other JSON body up to
        `server.http_max_json_bytes`. The HTTP/1.1 protocol answers it instead of `100 Continue`
        to a client that waits for one before sending its body (`Expect: 100-continue`)."""
        declared = headers.get("content-length", "")
        if not declared.isdigit():
            return None  # chunked, or a framing error h11 answers itself
        binary = path.endswith("/infer") and "inference-header-content-length" in headers
        limit, key = self._bound(None if binary or path.endswith("/load") else self.json_limit)
        if int(declared) <= limit:
            return None
        return self.too_large(f"request body of {int(declared)} bytes", limit, key)

    @staticmethod
    def too_large(what: str, limit: int, key: str) -> HttpRefusal:
        """413 Content Too Large for a body past `limit` (RFC 9110 section 15.5.14), naming its
        config `key`."""
        advice = ""
        if key == "server.http_max_json_bytes":
            advice = "; send large tensors in binary (the binary tensor extension) or through shared memory"
        return HttpRefusal(
            f"{what} exceeds the server's limit of {limit} bytes ({key}){advice}",
            Status.RESOURCE_EXHAUSTED,
            http=413,
        )
