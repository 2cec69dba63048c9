"""The KServe V2 REST front end: Starlette routes over the data plane and the gRPC service,
served by hypercorn in the worker's own trio run, on the trio-asyncio loop that hosts grpclib.

hypercorn's asyncio worker rather than its trio one: the service's handlers are asyncio
coroutines (the model queues answer asyncio futures), and reaching them from trio costs a
trio-asyncio hop per call (server CPU per tiny request 0.38 ms against 0.31 ms). On the same
loop as grpclib, a REST request runs where a gRPC one does. Inference is a bare ASGI handler;
the other routes go through Starlette.

Inference, readiness and the counts go through the data plane (`hloserve.api.data_plane`); every
other route calls the gRPC service's method (with the betterproto2 messages), so checks,
statistics, metrics and error classes are the gRPC ones. A gRPC status becomes an HTTP status as
Triton maps its error codes (`HTTP_STATUS`), with a JSON `{"error": "..."}` body. Request bodies
are bounded by `server.max_message_bytes`, refused from their Content-Length before they are
read (and counted while read when chunked or compressed); connections, heads and the time a head
or body takes by `server.http_*` (see `RestServer`). A client that disconnects while its
inference is awaited cancels it, which withdraws it from its model's queue.

A body with a Content-Length is read into one buffer and its binary tensors reach the service
as views of it (`viewed_request.ViewedRequest`); binary outputs are sent after the JSON header
without joining them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import dataclasses
import functools
import json
import re
import socket
import ssl
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, MutableMapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import betterproto2
import hypercorn.asyncio.tcp_server
import hypercorn.config
import hypercorn.utils
import numpy as np
import structlog
import trio
import trio_asyncio
from grpclib.const import Status
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.events import Closed
from hypercorn.protocol.h2 import H2Protocol
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._transport.h2_limits import CONNECTIONS, default_max_connections
from hloserve._transport.requirements import Requires, check
from hloserve.api.rest import http1 as _rest_http1
from hloserve.api.rest.codec import (
    INLINE_JSON,
    decode_infer,
    dismantle,
    encode_infer,
    header_length,
    json_output_bytes,
    no_collections,
    parse_json,
)
from hloserve.api.rest.http1 import Refused, StrictH11
from hloserve.api.status import to_grpc_error
from hloserve.config import ServerConfig
from hloserve.restricted import Restrictions, http_group, http_message
from hloserve.tls import server_context

log = structlog.get_logger("hloserve.rest")

if TYPE_CHECKING:
    from hloserve.api.codec import InferRequest
    from hloserve.api.data_plane import DataPlane
    from hloserve.engine.model_table import ModelEntry
    from hloserve.engine.tracing import RequestSpans

__all__ = ["HTTP_STATUS", "REQUIRES", "RestServer", "build_app"]

REQUIRES = Requires(
    __name__,
    "hypercorn",
    "0.18.0",
    members=(
        "hypercorn.asyncio.tcp_server.MAX_RECV",
        "hypercorn.asyncio.tcp_server.TCPServer._read_data",
        "hypercorn.protocol.h11.H11Protocol._check_protocol",
        "hypercorn.protocol.h11.H11Protocol._send_error_response",
        "hypercorn.protocol.h11.H11Protocol._send_h11_event",
        "hypercorn.protocol.ProtocolWrapper.handle",
        "hypercorn.asyncio.tcp_server.TCPServer._initiate_server_close",
        "hypercorn.asyncio.tcp_server.TCPServer.idle_task",
        "hypercorn.asyncio.tcp_server.TCPServer.writer",
        "hypercorn.asyncio.worker_context.WorkerContext.terminated",
        "hypercorn.utils.wrap_app",
        "hypercorn.utils.parse_socket_addr",
    ),
    parameters={
        "hypercorn.asyncio.tcp_server.TCPServer.__init__": (
            "self", "app", "loop", "config", "context", "state", "reader", "writer"
        ),
        "hypercorn.asyncio.worker_context.WorkerContext.__init__": ("self", "max_requests"),
        "hypercorn.protocol.h11.H11Protocol.__init__": (
            "self", "app", "config", "context", "task_group", "connection_state", "ssl", "client",
            "server", "send",
        ),
    },
)  # fmt: skip
"""What `RestServer` reaches into: it runs hypercorn's connection handler under its own accept
loop (the connection cap), replaces its idle-timeout task and its HTTP/1.1 protocol
(`_Connection`, `StrictH11`)."""

HTTP_STATUS = {
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 503,  # Triton answers a request whose timeout expired UNAVAILABLE
    Status.INTERNAL: 500,
    Status.UNIMPLEMENTED: 501,
}
"""HTTP status by gRPC status, as Triton's HttpCodeFromError; every other status is 400."""

_HEADER_LENGTH = "inference-header-content-length"
_HEADER_LENGTH_OUT = b"Inference-Header-Content-Length"
_INFER_HEADERS = {
    b"content-length",
    b"content-encoding",
    b"accept-encoding",
    _HEADER_LENGTH.encode(),
    b"traceparent",
}  # the request headers inference reads
_WBITS = {"gzip": 31, "deflate": 15}  # zlib window bits: gzip container, zlib container (as Triton)
_RATIO_FLOOR = 1 << 20
"""A compressed body may always inflate to this (`server.http_max_inflation_ratio` or not)."""
_INLINE_INFLATE = 1 << 20
"""A body whose inflation is capped at this is inflated on the loop (3 ms at most); past it, in
a worker thread (a hop costs more than inflating a small body)."""


class HttpRefusal(Exception):
    """A request refused at the HTTP layer (its body or headers), before the service sees it;
    `http` overrides the HTTP status that `status` maps to."""

    def __init__(
        self,
        message: str,
        status: Status = Status.INVALID_ARGUMENT,
        headers: Mapping[str, str] | None = None,
        http: int | None = None,
    ) -> None:
        self.status, self.headers, self.http = status, dict(headers or {}), http
        super().__init__(message)


def _error(error: Exception, rpc: str) -> tuple[Status, int, str, dict[str, str]]:
    """The gRPC status, HTTP status, message and extra headers a client gets for `error`."""
    if isinstance(error, HttpRefusal):
        return error.status, error.http or HTTP_STATUS.get(error.status, 400), str(error), error.headers
    grpc_error = to_grpc_error(error, rpc)
    return grpc_error.status, HTTP_STATUS.get(grpc_error.status, 400), grpc_error.message or "", {}


def _error_response(error: Exception, rpc: str) -> Response:
    _, http, message, headers = _error(error, rpc)
    return JSONResponse({"error": message}, http, headers)


class _Disconnected(Exception):
    """The client closed its connection while its request was being served."""


def _plain(value: Any) -> Any:
    """A betterproto2 `to_dict` in Python form as JSON values: enums by name, unset messages gone."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.name if isinstance(value, Enum) else value


def _to_json(message: betterproto2.Message) -> Any:
    return _plain(
        message.to_dict(
            output_format=betterproto2.OutputFormat.PYTHON,
            casing=betterproto2.Casing.SNAKE,
            include_default_values=True,
        )
    )


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _stats_json(value: Any) -> Any:
    """`_to_json` of a statistics message, walking its fields directly: the same JSON at a third
    of the cost (betterproto2's `to_dict` made `GET /v2/models/stats` cost 4.7 ms against 1.7 ms for
    gRPC's ModelStatistics). Statistics hold only integers, strings, messages, lists and maps."""
    if isinstance(value, betterproto2.Message):
        out = {}
        for name in _field_names(type(value)):
            field = getattr(value, name)
            if field is not None:
                out[name] = _stats_json(field)
        return out
    if isinstance(value, list):
        return [_stats_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _stats_json(v) for k, v in value.items()}
    return value


def _response_encoding(accept: str | None) -> str | None:
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


def _compress(body: bytes, encoding: str) -> bytes:
    return zlib.compress(body, 6, _WBITS[encoding])


Handler = Callable[[Request], Awaitable[Response]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_JSON = [(b"content-type", b"application/json")]
_BINARY = [(b"content-type", b"application/octet-stream")]


async def _stream(receive: Receive) -> AsyncIterator[bytes]:
    """An ASGI request body, chunk by chunk; a client that disconnects ends the request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


_JSON_KEYS = ("ready", "parameters", "key", "offset", "byte_size")
"""What the routes read from a JSON body (`_Routes._json`)."""


def _parse_fairly(body: bytes) -> Any:
    """A large JSON body parsed in a worker thread (`parse_json(fair=True)`), with only what the
    routes read from it kept, as they read it: the rest is dismantled here, in slices, rather than
    freed on the loop in one long C call. A load's non-string parameters become what the load
    takes from them, their truth."""
    with no_collections():
        value = parse_json(body, fair=True)
        if not isinstance(value, dict):
            dismantle(value)
            return None
        kept = {key: value[key] for key in _JSON_KEYS if key in value}
        for key, item in kept.items():
            if key == "parameters" and isinstance(item, dict):
                kept[key] = {name: v if isinstance(v, str) else bool(v) for name, v in item.items()}
            elif isinstance(item, (list, dict)):
                kept[key] = type(item)()  # refused all the same: the routes take no container here
        dismantle(value)
        return kept


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


_LIBC = ctypes.CDLL(None)
_TRIM_BYTES = 16 << 20


def _return_memory(freed: int) -> None:
    """Give the allocator's free memory back to the system after `freed` bytes of pieces: glibc
    keeps freed 1 MiB blocks in its arenas (a refused 100 MB bomb left the worker 100 MB larger)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if freed >= _TRIM_BYTES and trim is not None:
        trim(0)


class _InFlight:
    """What the REST connections and requests are waiting for, so that one sweep a tick ends
    those that waited too long: the deadline of each body being read (its task is cancelled),
    of each answer being sent (its connection is aborted: a client that does not read would
    hold it, and the answer's bytes, forever) and of each idle connection (it is closed); and the
    task serving each connection's inference, by client address, for its connection to cancel
    when the client goes. A task or a timer per request (hypercorn restarts an idle-timeout task
    after every answer) costs about 25 us each on trio-asyncio, a tenth of a tiny request."""

    def __init__(self, body_timeout_s: float, idle_timeout_s: float) -> None:
        self.body_timeout_s, self.idle_timeout_s = body_timeout_s, idle_timeout_s
        self.serving: dict[Hashable, asyncio.Task[None]] = {}
        self.reading: dict[asyncio.Task[object], float] = {}
        self.idle: dict[_Connection, float] = {}
        self.sending: dict[asyncio.Task[None], tuple[float, Hashable]] = {}
        """The deadline of each answer being sent, and its client, by the task sending it: one
        stream's answer completing (h2c, or pipelined HTTP/1.1) leaves its siblings' deadlines."""
        self.connections: dict[Hashable, _Connection] = {}
        """Open connections by client address."""
        self.cancelled: set[asyncio.Task[object]] = set()
        """Tasks cancelled here (by a disconnect or a deadline), not by a shutdown."""
        self._closing: set[asyncio.Future[None]] = set()

    def disconnected(self, client: Hashable) -> None:
        task = self.serving.pop(client, None)
        if task is not None:
            self._cancel(task)

    async def sweep(self) -> None:
        """Cancel body reads and close idle connections past their deadlines, forever."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.body_timeout_s / 4, self.idle_timeout_s / 4))
            now = loop.time()
            for task in [t for t, deadline in self.reading.items() if deadline <= now]:
                del self.reading[task]
                self._cancel(task)
            self.close_idle([c for c, deadline in self.idle.items() if deadline <= now])
            late = {client for deadline, client in self.sending.values() if deadline <= now}
            for client in late:
                connection = self.connections.get(client)
                if connection is not None:
                    connection.abort()
            for task, (_, client) in list(self.sending.items()):
                if client in late:  # hypercorn's h2 streams would wait on their windows for good
                    del self.sending[task]
                    task.cancel()
            for connection in self.connections.values():
                if connection not in self.idle and connection.h2_idle():
                    # hypercorn stops the idle timer at the PRI preface and restarts it only when
                    # a stream closes: an h2c connection that never opens one was never timed out
                    self.idle[connection] = now + self.idle_timeout_s

    def close_idle(self, connections: list[_Connection]) -> None:
        for connection in connections:
            del self.idle[connection]
            closing = asyncio.ensure_future(connection.close_idle())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _cancel(self, task: asyncio.Task[object]) -> None:
        self.cancelled.add(task)
        task.cancel()

    def ours(self, task: asyncio.Task[object]) -> bool:
        """Whether `task`'s cancellation came from here; if so it is taken back (uncancelled)."""
        if task not in self.cancelled:
            return False
        self.cancelled.discard(task)
        task.uncancel()
        return True


class _Routes:
    """The endpoints, bound to one data plane and one service."""

    def __init__(
        self,
        plane: DataPlane,
        service: kserve.GrpcInferenceServiceBase,
        models: Mapping[str, ModelEntry],
        config: ServerConfig,
    ) -> None:
        self._plane = plane
        self._service = service
        self._models = models
        self._limit = config.max_message_bytes
        self._json_limit = config.http_max_json_bytes
        self._ratio = config.http_max_inflation_ratio
        self._max_receiving = config.max_receiving_bytes
        self.receiving = 0
        """Bytes of request bodies being received or inflated now (`server.max_receiving_bytes`)."""
        self._receiving_lock = threading.Lock()  # inflations book from worker threads
        self.inflight = _InFlight(config.http_body_timeout_s, config.http_idle_timeout_s)

    async def _body(
        self, headers: Mapping[str, str], receive: Receive, limit: int | None = None
    ) -> memoryview:
        """The request body, decompressed, in one buffer; refused once it, or its inflated bytes,
        pass `limit` (`server.http_max_json_bytes`, or `server.max_message_bytes` when None or
        less: at once when its Content-Length does) or take longer than `server.http_body_timeout_s`."""
        key = "server.http_max_json_bytes"
        if limit is None or limit >= self._limit:
            key, limit = "server.max_message_bytes", self._limit
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in (*_WBITS, "identity", ""):
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
        if encoding not in _WBITS:
            return memoryview(body)
        return await self._inflate(body, encoding, limit, key)

    async def _inflate(self, body: bytes | memoryview, encoding: str, limit: int, key: str) -> memoryview:
        """A gzip or deflate body inflated to at most `limit` bytes and `server.http_max_inflation_ratio`
        times its size (1 MiB at least): zlib stops at the first byte past the bound, and the
        request is refused. Past `_INLINE_INFLATE` bytes it inflates in a worker thread (zlib frees
        the interpreter meanwhile), so a bomb never stalls the loop. The inflated bytes count
        against `server.max_receiving_bytes` while it inflates, as received ones do."""
        cap = min(limit, max(self._ratio * len(body), _RATIO_FLOOR))
        inflater = zlib.decompressobj(_WBITS[encoding])
        booked = [0]

        def book(size: int) -> None:
            self._reserve(size)
            booked[0] += size

        try:
            if cap <= _INLINE_INFLATE:
                inflated = _inflate(inflater, body, cap, book)
            else:
                loop = asyncio.get_running_loop()
                inflated = await loop.run_in_executor(None, _inflate, inflater, body, cap, book)
        except zlib.error as e:
            raise HttpRefusal(f"the body is not valid {encoding} data: {e}") from None
        finally:
            self._release(booked[0])
        if inflated is None:
            if cap == limit:
                raise self._too_large(f"{encoding} body that inflates to more than {limit} bytes", limit, key)
            raise HttpRefusal(
                f"the {len(body)}-byte {encoding} body inflates past {cap} bytes, more than "
                f"server.http_max_inflation_ratio ({self._ratio}) times its size"
            )
        if not inflater.eof:
            raise HttpRefusal(f"the {encoding} body is truncated")
        if inflater.unused_data:
            raise HttpRefusal(
                f"{len(inflater.unused_data)} bytes follow the end of the {encoding} data; "
                "send one compressed stream"
            )
        return memoryview(inflated)

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
                raise self._too_large(f"request body of {declared} bytes", limit, key)
        chunks: list[bytes] = []
        view, size = None, 0
        try:
            async for chunk in _stream(receive):
                if size + len(chunk) > (limit if expected is None else expected):
                    if expected is None:
                        raise self._too_large(f"request body of more than {limit} bytes", limit, key)
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

    @staticmethod
    def _too_large(what: str, limit: int, key: str) -> HttpRefusal:
        """400 for a body past `limit`, naming its config `key` (Triton answers 400 too)."""
        advice = ""
        if key == "server.http_max_json_bytes":
            advice = "; send large tensors in binary (the binary tensor extension) or through shared memory"
        return HttpRefusal(f"{what} exceeds the server's limit of {limit} bytes ({key}){advice}")

    async def _json(self, request: Request, files: bool = False) -> dict[str, Any]:
        """A JSON object body (at most `server.http_max_json_bytes`, or with `files`, a load's,
        whose `file:` contents are base64 strings, `server.max_message_bytes`); an empty body is
        {}. Past `INLINE_JSON` bytes it is parsed in a worker thread, fairly (`parse_json`)."""
        body = bytes(await self._body(request.headers, request.receive, None if files else self._json_limit))
        if not body.strip():
            return {}
        try:
            if len(body) <= INLINE_JSON:
                value = parse_json(body)  # with no numpy to convert, arrays cost what numbers do
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(None, _parse_fairly, body)
        except ValueError as e:
            raise HttpRefusal(str(e)) from None
        if not isinstance(value, dict):
            raise HttpRefusal("the request must be a JSON object")
        return value

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self, model: str, version: str, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None:
        """POST .../infer as a bare ASGI handler: the hot path skips Starlette's routing,
        middleware and request objects."""
        started = time.perf_counter()
        label = model if model in self._models else "<unknown>"
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _INFER_HEADERS
        }
        spans = None
        if self._plane.tracing is not None:
            spans = self._plane.trace_request(label, headers.get("traceparent"), time.monotonic_ns())
        try:
            length = header_length(headers.get(_HEADER_LENGTH), model)
            if length is not None and length > self._json_limit:
                raise self._too_large(
                    f"the JSON header of {length} bytes", self._json_limit, "server.http_max_json_bytes"
                )
            received = await self._body(headers, receive, self._json_limit if length is None else None)
            if (len(received) if length is None else length) <= INLINE_JSON:
                decoded = decode_infer(received, length, model, version)
            else:  # the worker thread gives the loop the interpreter back (`parse_json(fair=True)`)
                loop = asyncio.get_running_loop()
                decoded = await loop.run_in_executor(None, decode_infer, received, length, model, version)
            response = await self._unless_disconnected(decoded.request, scope["client"], spans)
            if json_output_bytes(response, decoded) <= INLINE_JSON:
                pieces, binary_length = encode_infer(response, decoded)
            else:  # written a slice at a time in a worker thread, which gives the loop the interpreter
                loop = asyncio.get_running_loop()
                pieces, binary_length = await loop.run_in_executor(
                    None, encode_infer, response, decoded, True
                )
        except _Disconnected:
            if spans is not None:
                spans.end("CANCELLED")
            return  # nobody to answer; as a cancelled gRPC call, it is not counted
        except Exception as e:
            status, http, message, extra = _error(e, "ModelInfer")
            self._plane.count(label, status.name, time.perf_counter() - started)
            if spans is not None:
                spans.end(status.name)
            body = json.dumps({"error": message}).encode()
            extra_headers = [(k.lower().encode(), v.encode()) for k, v in extra.items()]
            await _respond(send, http, [body], _JSON + extra_headers)
            return
        self._plane.count(label, "OK", time.perf_counter() - started)
        response_headers = _JSON if binary_length is None else _BINARY
        if binary_length is not None:
            response_headers = [*response_headers, (_HEADER_LENGTH_OUT, str(binary_length).encode())]
        encoding = _response_encoding(headers.get("accept-encoding"))
        if encoding is not None:
            pieces = [_compress(b"".join(pieces), encoding)]
            response_headers = [*response_headers, (b"content-encoding", encoding.encode())]
        sending, task = self.inflight.sending, asyncio.current_task()
        assert task is not None
        sending[task] = (asyncio.get_running_loop().time() + self.inflight.body_timeout_s, scope["client"])
        try:
            await _respond(send, 200, pieces, response_headers)
        finally:
            sending.pop(task, None)
        if spans is not None:
            spans.mark("reply")
            spans.end()

    async def _unless_disconnected(
        self, request: InferRequest, client: Hashable, spans: RequestSpans | None = None
    ) -> hot.ModelInferResponse:
        """The service's answer; a client that disconnects meanwhile cancels it, so that a
        request still in its model's queue is withdrawn (as a gRPC cancellation withdraws one)."""
        task, serving = asyncio.current_task(), self.inflight.serving
        assert task is not None
        serving[client] = task
        try:
            return await self._plane.infer(request, None, spans)
        except asyncio.CancelledError:
            if not self.inflight.ours(task):
                raise
            raise _Disconnected() from None
        finally:
            if serving.get(client) is task:
                del serving[client]
            self.inflight.cancelled.discard(task)  # a cancellation the service swallowed, if any

    # -- health and metadata -------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        reply = await self._service.server_live(kserve.ServerLiveRequest())
        return Response(status_code=200 if reply.live else 400)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if await self._plane.ready() else 400)

    async def server_metadata(self, request: Request) -> Response:
        reply = await self._service.server_metadata(kserve.ServerMetadataRequest())
        return JSONResponse(_to_json(reply))

    @staticmethod
    def _model(request: Request) -> tuple[str, str]:
        return request.path_params["model"], request.path_params.get("version", "")

    async def model_ready(self, request: Request) -> Response:
        name, version = self._model(request)
        return Response(status_code=200 if await self._plane.model_ready(name, version) else 400)

    async def model_metadata(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._service.model_metadata(kserve.ModelMetadataRequest(name, version))
        return JSONResponse(_to_json(reply))

    async def model_config(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._service.model_config(kserve.ModelConfigRequest(name, version))
        return JSONResponse(_to_json(reply)["config"])  # Triton answers the config itself

    async def model_stats(self, request: Request) -> Response:
        name, version = request.path_params.get("model", ""), request.path_params.get("version", "")
        reply = await self._service.model_statistics(kserve.ModelStatisticsRequest(name, version))
        return JSONResponse(_stats_json(reply))

    async def trace_setting(self, request: Request) -> Response:
        """GET or POST /v2[/models/{model}]/trace/setting: the settings as Triton writes them
        (`trace_level` a list, the others strings); a POST that changes any is refused (501)."""
        changes = await self._json(request) if request.method == "POST" else {}
        message = kserve.TraceSettingRequest(
            {
                str(key)[:64]: kserve.TraceSettingRequestSettingValue(
                    [str(v) for v in value] if isinstance(value, list) else [str(value)]
                )
                for key, value in changes.items()
            },
            request.path_params.get("model", ""),
        )
        reply = await self._service.trace_setting(message)
        return JSONResponse(
            {k: v.value if k == "trace_level" else "".join(v.value) for k, v in reply.settings.items()}
        )

    # -- model repository ----------------------------------------------------------------------

    async def repository_index(self, request: Request) -> Response:
        ready = (await self._json(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise HttpRefusal("Invalid value for 'ready': expected a boolean")
        reply = await self._service.repository_index(kserve.RepositoryIndexRequest(ready=ready))
        return JSONResponse(_to_json(reply)["models"])

    async def load(self, request: Request) -> Response:
        parameters = (await self._json(request, files=True)).get("parameters", {})
        if not isinstance(parameters, dict):
            raise HttpRefusal("Invalid value for 'parameters': expected an object")
        files = sum(
            len(v) for k, v in parameters.items() if isinstance(v, str) and str(k).startswith("file:")
        )
        if files <= INLINE_JSON:
            decoded = _load_parameters(parameters)
        else:  # decoded a slice at a time in a worker thread, which gives the loop the interpreter back
            decoded = await asyncio.get_running_loop().run_in_executor(None, _load_parameters, parameters)
        message = kserve.RepositoryModelLoadRequest(
            model_name=request.path_params["model"], parameters=decoded
        )
        await self._service.repository_model_load(message)
        return Response()

    async def unload(self, request: Request) -> Response:
        await self._json(request)
        name = request.path_params["model"]
        await self._service.repository_model_unload(kserve.RepositoryModelUnloadRequest(model_name=name))
        return Response()

    # -- system shared memory ------------------------------------------------------------------

    async def shm_status(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        reply = await self._service.system_shared_memory_status(kserve.SystemSharedMemoryStatusRequest(name))
        return JSONResponse([_to_json(r) for r in reply.regions.values()])

    async def shm_register(self, request: Request) -> Response:
        body = await self._json(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise HttpRefusal("Shared memory register request needs 'key', a string")
        for field, value in (("offset", offset), ("byte_size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
                raise HttpRefusal(f"Shared memory register request needs '{field}', an integer >= 0")
        assert isinstance(size, int)
        message = kserve.SystemSharedMemoryRegisterRequest(request.path_params["region"], key, offset, size)
        await self._service.system_shared_memory_register(message)
        return Response()

    async def shm_unregister(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        await self._service.system_shared_memory_unregister(kserve.SystemSharedMemoryUnregisterRequest(name))
        return Response()

    async def cuda_shm_status(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        await self._service.cuda_shared_memory_status(kserve.CudaSharedMemoryStatusRequest(name))
        return JSONResponse([])

    async def cuda_shm_unregister(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        await self._service.cuda_shared_memory_unregister(kserve.CudaSharedMemoryUnregisterRequest(name))
        return Response()

    async def cuda_shm(self, request: Request) -> Response:
        await self._service.cuda_shared_memory_register(kserve.CudaSharedMemoryRegisterRequest())
        raise AssertionError("unreachable")  # it answers UNIMPLEMENTED


_JOIN_BYTES = 1 << 16
"""A response this small is joined and sent in one piece (one pass through hypercorn and h11
costs more than copying it); a larger one is sent piece by piece, its tensors never copied."""


async def _respond(send: Send, status: int, pieces: list[bytes], headers: list[tuple[bytes, bytes]]) -> None:
    length = sum(map(len, pieces))
    headers = [*headers, (b"content-length", str(length).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if length <= _JOIN_BYTES:
        pieces = [b"".join(pieces)]
    for i, piece in enumerate(pieces, 1 - len(pieces)):
        await send({"type": "http.response.body", "body": piece, "more_body": i < 0})


def _endpoint(handler: Handler, rpc: str) -> Handler:
    """`handler`, with whatever it raises answered as an error response."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except _Disconnected:
            return Response(status_code=400)  # nobody is left to read it
        except Exception as e:
            return _error_response(e, rpc)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, exc.status_code, exc.headers)


def build_app(
    plane: DataPlane,
    service: kserve.GrpcInferenceServiceBase,
    models: Mapping[str, ModelEntry],
    config: ServerConfig,
) -> _App:
    """The Starlette application of the V2 REST protocol over `plane` and `service`."""
    r = _Routes(plane, service, models, config)

    def get(path: str, handler: Handler, rpc: str) -> Route:
        return Route(path, _endpoint(handler, rpc), methods=["GET"])

    def post(path: str, handler: Handler, rpc: str) -> Route:
        return Route(path, _endpoint(handler, rpc), methods=["POST"])

    routes = [
        get("/v2", r.server_metadata, "ServerMetadata"),
        get("/v2/health/live", r.live, "ServerLive"),
        get("/v2/health/ready", r.ready, "ServerReady"),
        get("/v2/models/stats", r.model_stats, "ModelStatistics"),
        post("/v2/repository/index", r.repository_index, "RepositoryIndex"),
        post("/v2/repository/models/{model}/load", r.load, "RepositoryModelLoad"),
        post("/v2/repository/models/{model}/unload", r.unload, "RepositoryModelUnload"),
        get("/v2/systemsharedmemory/status", r.shm_status, "SystemSharedMemoryStatus"),
        get("/v2/systemsharedmemory/region/{region}/status", r.shm_status, "SystemSharedMemoryStatus"),
        post("/v2/systemsharedmemory/region/{region}/register", r.shm_register, "SystemSharedMemoryRegister"),
        post(
            "/v2/systemsharedmemory/region/{region}/unregister",
            r.shm_unregister,
            "SystemSharedMemoryUnregister",
        ),
        post("/v2/systemsharedmemory/unregister", r.shm_unregister, "SystemSharedMemoryUnregister"),
        get("/v2/cudasharedmemory/status", r.cuda_shm_status, "CudaSharedMemoryStatus"),
        get("/v2/cudasharedmemory/region/{region}/status", r.cuda_shm_status, "CudaSharedMemoryStatus"),
        post("/v2/cudasharedmemory/unregister", r.cuda_shm_unregister, "CudaSharedMemoryUnregister"),
        post(
            "/v2/cudasharedmemory/region/{region}/unregister",
            r.cuda_shm_unregister,
            "CudaSharedMemoryUnregister",
        ),
        Route("/v2/trace/setting", _endpoint(r.trace_setting, "TraceSetting"), methods=["GET", "POST"]),
        Route(
            "/v2/cudasharedmemory/{rest:path}",
            _endpoint(r.cuda_shm, "CudaSharedMemory"),
            methods=["GET", "POST"],
        ),
    ]
    for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            get(model, r.model_metadata, "ModelMetadata"),
            get(model + "/ready", r.model_ready, "ModelReady"),
            get(model + "/config", r.model_config, "ModelConfig"),
            get(model + "/stats", r.model_stats, "ModelStatistics"),
            Route(
                model + "/trace/setting", _endpoint(r.trace_setting, "TraceSetting"), methods=["GET", "POST"]
            ),
        ]
    starlette = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return _App(r, starlette, config.http_max_header_bytes, Restrictions.http(config.http_restricted_api))


class _App:
    """The ASGI application: inference straight to its handler, the rest through Starlette;
    a request to a restricted API group without its header is answered 403 first."""

    def __init__(
        self, routes: _Routes, starlette: Starlette, max_head_bytes: int, restrictions: Restrictions
    ) -> None:
        self.routes, self._starlette, self._max_head_bytes = routes, starlette, max_head_bytes
        self._restrictions = restrictions
        self.inflight = routes.inflight

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self._starlette(scope, receive, send)
        # h11 bounds a head still arriving; one that came whole in a single read is counted here
        head = (
            len(scope["raw_path"])
            + len(scope["query_string"])
            + sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        )
        if head > self._max_head_bytes:
            message = (
                f"the request line and headers take {head} bytes, past the server's limit of "
                f"{self._max_head_bytes} (server.http_max_header_bytes)"
            )
            return await _respond(send, 431, [json.dumps({"error": message}).encode()], _JSON)
        if self._restrictions:
            headers = {name.decode("latin-1"): value for name, value in scope["headers"]}
            rule = self._restrictions.refusal(http_group(scope["path"]), headers)
            if rule is not None:  # Triton's status and words (http_server.cc RespondIfRestricted)
                # A body it declared is never read: the connection closes after the answer
                # (reading it would let a client without the header make the server take its
                # bytes), else it stays open for the next request.
                body = headers.get("content-length", b"0") != b"0" or "transfer-encoding" in headers
                extra = [(b"connection", b"close")] if body else []
                error = json.dumps({"error": http_message(rule)}).encode()
                return await _respond(send, 403, [error], [*_JSON, *extra])
        if scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                return await self.routes.infer(match[1], match[2] or "", scope, receive, send)
        await self._starlette(scope, receive, send)


_READ_BYTES = 1 << 20
"""Bytes hypercorn takes from a connection's buffer per read (its default is 64 KiB)."""


def _listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket, as hypercorn makes one, closed again when it cannot bind
    (hypercorn's own leaks it); `reuse_port` shares the port with sibling processes."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Connection(TCPServer):
    """hypercorn's connection handler, which tells the routes when its client has gone, keeps
    its idle deadline in `_InFlight` instead of an idle-timeout task, speaks HTTP/1.1 through
    `StrictH11` (h2c only with `server.http2`). What its protocol raises leaves `run` (whose
    task group cancels the connection's streams) and is contained by `RestServer`."""

    def __init__(self, inflight: _InFlight, client: Hashable, http2: bool, *args: Any) -> None:
        super().__init__(*args)
        self._inflight, self._client, self._http2 = inflight, client, http2
        self.idle_task = _IdleDeadline(inflight, self)  # type: ignore[assignment]  # duck-typed

    async def _read_data(self) -> None:
        wrapper = self.protocol  # made by `run` before it reads, with nothing read yet
        h11 = StrictH11(
            wrapper.app, wrapper.config, wrapper.context, wrapper.task_group, wrapper.state,
            wrapper.ssl, wrapper.client, wrapper.server, wrapper.send,
        )  # fmt: skip
        h11.http2 = self._http2
        wrapper.protocol = h11
        try:
            await super()._read_data()  # until the client closes (or the connection fails)
        except Refused:
            await self.protocol.handle(Closed())  # answered, and the connection closes
        finally:
            self._inflight.disconnected(self._client)

    async def close_idle(self) -> None:
        await self._initiate_server_close()

    def h2_idle(self) -> bool:
        """Whether this connection speaks h2c and has no stream open."""
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        return isinstance(protocol, H2Protocol) and not protocol.streams

    def abort(self) -> None:
        """Drop the connection now, with whatever it has not sent (a close would wait for it)."""
        self.writer.transport.abort()


class _IdleDeadline:
    """Stands in for hypercorn's idle-timeout task (`AsyncioSingleTask`): `restart` when the
    connection goes idle sets its deadline, `stop` when a request head arrives clears it."""

    def __init__(self, inflight: _InFlight, connection: _Connection) -> None:
        self._inflight, self._connection = inflight, connection

    async def restart(self, task_group: Any, action: Any) -> None:
        deadline = asyncio.get_running_loop().time() + self._inflight.idle_timeout_s
        self._inflight.idle[self._connection] = deadline

    async def stop(self) -> None:
        self._inflight.idle.pop(self._connection, None)


def _refusal(key: str, cap: int) -> bytes:
    """The whole answer to a connection past `server.http_max_connections` or the process's
    `server.max_open_connections`."""
    body = json.dumps({"error": f"{key} ({cap}) reached; retry later"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


class RestServer:
    """hypercorn serving the REST app on `server.host`:`server.http_port` until `stop()`.

    hypercorn's own accept loop (`worker_serve`) has no connection cap, so this one runs its
    connection handler (`TCPServer`) itself: past `server.http_max_connections` a new connection
    is answered 503 with a JSON error and closed at once, never read (a client that had already
    sent its request may see the close as a reset). h11 bounds a request head still arriving
    (`server.http_max_header_bytes`: 431 and close) and the app one that came whole (431); the
    sweep of `_InFlight` closes a connection without a whole head for
    `server.http_idle_timeout_s` and answers 408 to a body slower than
    `server.http_body_timeout_s`.
    """

    def __init__(self, app: _App, config: ServerConfig, *, reuse_port: bool = False) -> None:
        self._app = app
        self._config = config
        self._reuse_port = reuse_port
        """Share the port (SO_REUSEPORT) with sibling processes: the frontends."""
        self._stop = trio.Event()
        self.stopped = trio.Event()
        """Set once every connection is closed (after `stop()`, within the grace period)."""
        self.connections = 0
        """Connections open now (refused ones are never counted)."""

    @property
    def receiving_bytes(self) -> int:
        """Bytes of request bodies being received now."""
        return self._app.routes.receiving

    @property
    def inferring(self) -> int:
        """Inference requests whose answer the service is working on now."""
        return len(self._app.inflight.serving)

    def stop(self) -> None:
        """Stop accepting connections; those open finish their requests within the grace period."""
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound port, serve until stopped; an address in use raises OSError."""
        check(REQUIRES, _rest_http1.REQUIRES)
        settings = hypercorn.config.Config()
        settings.graceful_timeout = self._config.shutdown_grace_s
        settings.h11_max_incomplete_size = self._config.http_max_header_bytes
        settings.h2_max_concurrent_streams = self._config.max_concurrent_streams
        settings.h2_max_header_list_size = self._config.http_max_header_bytes
        settings.accesslog = settings.errorlog = None  # the routes answer and log what goes wrong
        # 64 KiB per read made a 4.8 MB body 75 passes through h11 and the ASGI queue.
        hypercorn.asyncio.tcp_server.MAX_RECV = _READ_BYTES
        tls = server_context(self._config, "http")  # a bad file: ConfigError before binding
        try:
            sock = _listen(self._config.host, self._config.http_port, settings.backlog, self._reuse_port)
            task_status.started(sock.getsockname()[1])
            await trio_asyncio.aio_as_trio(self._serve)(sock, settings, tls)
        finally:
            self.stopped.set()

    async def _serve(
        self, sock: socket.socket, settings: hypercorn.config.Config, tls: ssl.SSLContext | None
    ) -> None:
        """hypercorn's `worker_serve` for one TCP socket (TLS with `tls`), with the connection cap."""
        loop = asyncio.get_running_loop()
        app = hypercorn.utils.wrap_app(self._app, settings.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
        context = WorkerContext(None)
        state: dict[str, Any] = {}
        cap = self._config.http_max_connections or default_max_connections()
        refusal = _refusal("server.http_max_connections", cap)
        open_: set[asyncio.Task[Any]] = set()
        inflight = self._app.inflight

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(open_) >= cap:
                writer.write(refusal)
                writer.close()
                return
            if not CONNECTIONS.take():  # the process's budget, shared with gRPC and metrics
                writer.write(_refusal("server.max_open_connections", CONNECTIONS.cap))
                writer.close()
                return
            # asyncio's recv size (256 KiB) made a 4.8 MB body 19 passes through the stack
            writer.transport.max_size = _READ_BYTES  # type: ignore[attr-defined]
            task = asyncio.current_task()
            assert task is not None
            open_.add(task)
            self.connections = len(open_)
            peer = writer.get_extra_info("peername")  # as hypercorn names the client in the scope
            family = writer.get_extra_info("socket").family
            client = None if peer is None else hypercorn.utils.parse_socket_addr(family, peer)
            connection = inflight.connections[client] = _Connection(
                inflight, client, self._config.http2, app, loop, settings, context, state, reader, writer
            )
            try:
                await connection
            except Exception:
                # e.g. priority.TooManyStreamsError out of hypercorn's H2 protocol: left to the
                # accept loop, it ended the worker. Only this connection ends.
                log.exception("REST connection failed; closed it", client=str(client)[:80])
                writer.transport.abort()
            finally:
                del inflight.connections[client]
                CONNECTIONS.give()
                open_.discard(task)
                self.connections = len(open_)

        server = await asyncio.start_server(
            connected,
            sock=sock,
            backlog=settings.backlog,
            limit=_READ_BYTES,
            ssl=tls,
            ssl_handshake_timeout=self._config.handshake_timeout_s if tls is not None else None,
        )
        sweep = loop.create_task(inflight.sweep())
        try:
            await trio_asyncio.trio_as_aio(self._stop.wait)()
        finally:
            sweep.cancel()
            await context.terminated.set()  # busy connections close after their request
            inflight.close_idle(list(inflight.idle))
            server.close()
            await server.wait_closed()
            if open_:
                _, late = await asyncio.wait(open_, timeout=settings.graceful_timeout)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late)


def _load_parameters(parameters: dict[Any, Any]) -> dict[str, kserve.ModelRepositoryParameter]:
    return {str(key): _load_parameter(str(key), value) for key, value in parameters.items()}


_BASE64_STEP = 1 << 20
"""Base64 characters decoded at once (5 ms); a multiple of 4."""


def _base64(value: str) -> bytes:
    """`base64.b64decode(value, validate=True)`, `_BASE64_STEP` characters at a time (one call over
    a 64 MiB file holds the interpreter for a third of a second). The last group of 4 and what
    follows it are decoded together, as b64decode reads padding there (`0000=` is 3 bytes)."""
    tail = max(0, (len(value) // 4 - 1) * 4)
    pieces = []
    for start in range(0, tail, _BASE64_STEP):
        piece = value[start : min(tail, start + _BASE64_STEP)]
        if "=" in piece:
            raise binascii.Error("padding before the end")
        pieces.append(base64.b64decode(piece, validate=True))
    pieces.append(base64.b64decode(value[tail:], validate=True))
    return b"".join(pieces)


def _load_parameter(key: str, value: Any) -> kserve.ModelRepositoryParameter:
    """A load parameter as on gRPC: a config is a JSON string, a `file:` one the file's bytes in
    base64 (as Triton's REST load takes them); anything else is refused by the service."""
    if not isinstance(value, str):
        return kserve.ModelRepositoryParameter(bool_param=bool(value))
    if not key.startswith("file:"):
        return kserve.ModelRepositoryParameter(string_param=value)
    try:
        return kserve.ModelRepositoryParameter(bytes_param=_base64(value))
    except ValueError:  # binascii.Error, or a character past ASCII
        raise HttpRefusal(f"Invalid value for {key[:80]!r}: expected the file's bytes in base64") from None
