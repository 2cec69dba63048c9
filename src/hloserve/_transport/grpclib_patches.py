"""What grpclib 0.4.9 (with h2 4.4.1, hyperframe 6.1.0) lacks for serving tensors, added to
hloserve's own server and client only: a grpclib `Server` or `Channel` anyone else creates in
the process stays stock.

* grpclib has no receive size limit (vmagamedov/grpclib#195): it buffers whatever length the
  client announces. `GracefulServer`'s streams refuse a message over `server.max_message_bytes`,
  or over the budgets of messages being received, from its 5-byte prefix, before any is buffered.
* grpclib answers a request body that does not decode, or a unary call with no message or two,
  with UNKNOWN "Internal Server Error" or not at all (not filed upstream: `Stream.recv_message`
  lets the codec's exception escape, and never checks the message count of a unary call); here
  they are INVALID_ARGUMENT naming the RPC.
* grpclib's close() cancels the calls in flight and never sends GOAWAY, so clients hang or fail
  (vmagamedov/grpclib#107, which its maintainer ties to python-hyper/h2#1181; the fix, PR #190,
  is unmerged): `GracefulServer.shutdown` lets them finish, then sends GOAWAY.
* grpclib advertises and accepts 16 KiB frames, so a 4.8 MB tensor comes in ~300 frames:
  `GracefulServer`'s connections (`hloserve._transport.h2_limits`) and `BigFrameChannel` take 1 MiB.
* h2 remembers how its last 65,536 closed streams closed, about 90 bytes each: a channel that
  lives for hours (the node's to each worker, a client's) grows by ~6 MB. `BigFrameChannel`'s
  connections remember `CLIENT_CLOSED_STREAMS`.
* grpclib refuses every compressed message (not filed upstream: its server `Stream` keeps no
  `grpc-encoding` header and raises NotImplementedError): `GuardedStream` inflates gzip and
  deflate within the message limit and compresses replies (`hloserve._transport.compression`);
* grpclib answers a call whose deadline passed before it began UNKNOWN, not DEADLINE_EXCEEDED
  (not filed upstream: `DeadlineWrapper.start` raises outside the wrapper that turns a timeout
  into the status): `_deadline_start`, the one process-wide change, since grpclib's request
  handler builds the wrapper itself; for any other grpclib server it only turns that UNKNOWN
  into DEADLINE_EXCEEDED;
* grpclib writes a unary reply's headers, message and trailers to the socket one by one: three
  system calls where one does (not filed upstream: `send_reply`).

`install()` checks the libraries are those this was written for (`REQUIRES`), once, and applies
`_deadline_start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpclib.client
import grpclib.const
import grpclib.protocol
import grpclib.server
import grpclib.utils
import h2.settings
import h2.utilities
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError

from hloserve._transport import compression as _compression
from hloserve._transport import h2_limits as _h2_limits
from hloserve._transport import hpack_patches as _hpack_patches
from hloserve._transport.h2_limits import MAX_FRAME_SIZE, ServerGuard, TransportLimits
from hloserve._transport.h2_protocol import GuardedProtocol
from hloserve._transport.requirements import Requires, check

__all__ = [
    "CLIENT_CLOSED_STREAMS",
    "REQUIRES",
    "WINDOW_BYTES",
    "BigFrameChannel",
    "GracefulServer",
    "TransportLimits",
    "install",
    "send_reply",
]

WINDOW_BYTES = 16 << 20
"""The servers' HTTP/2 flow-control windows (connection and stream): a 4.8 MB tensor in one."""

_DETAIL_CHARS = 200

REQUIRES = (
    Requires(
        __name__,
        "grpclib",
        "0.4.9",
        members=(
            "grpclib.const.Handler._replace",
            "grpclib.server.Stream._stream",
            "grpclib.server.Stream._method_name",
            "grpclib.server.Stream._cardinality",
            "grpclib.server.Stream._codec",
            "grpclib.server.Stream._recv_type",
            "grpclib.server.Stream._dispatch",
            "grpclib.server.Stream._messages_received",
            "grpclib.server.Stream.send_message",
            "grpclib.server.Stream.send_trailing_metadata",
            "grpclib.server.Server._mapping",
            "grpclib.server.Server._codec",
            "grpclib.server.Server._status_details_codec",
            "grpclib.server.Server.__dispatch__",
            "grpclib.server.Server._handlers",
            "grpclib.server.Server._config",
            "grpclib.server.Server._h2_config",
            "grpclib.server.Server._server",
            "grpclib.server.Server._loop",
            "grpclib.server.Server.__gc_step__",
            "grpclib.server.Handler._tasks",
            "grpclib.protocol.Stream._transport",
            "grpclib.protocol.Stream._h2_connection",
            "grpclib.protocol.Stream.connection",
            "grpclib.protocol.Stream.buffer",
            "grpclib.protocol.Stream.closable",
            "grpclib.protocol.Stream.__terminated__",
            "grpclib.protocol.Buffer._acked",
            "grpclib.protocol.Buffer._acked_size",
            "grpclib.protocol.Buffer._unacked",
            "grpclib.protocol.Connection._connection",
            "grpclib.protocol.Connection.messages_received",
            "grpclib.protocol.Connection.last_message_received",
            "grpclib.protocol.Connection.stream_close_waiter",
            "grpclib.protocol.Connection.write_ready",
            "grpclib.protocol.Connection.data_sent",
            "grpclib.protocol.EventsProcessor.streams",
            "grpclib.protocol.EventsProcessor.process_request_received",
            "grpclib.protocol.EventsProcessor.process_remote_settings_changed",
            "grpclib.protocol.EventsProcessor.process_stream_reset",
            "grpclib.protocol._set_nodelay",
            "grpclib.client.Channel._config",
            "grpclib.client.Channel._h2_config",
            "grpclib.server.Stream._send_initial_metadata_done",
            "grpclib.server.Stream._send_message_done",
            "grpclib.server.Stream._content_type",
            "grpclib.server.Stream._send_type",
            "grpclib.server.Stream._messages_sent",
            "grpclib.protocol.Connection.messages_sent",
            "grpclib.protocol.Connection.last_message_sent",
            "grpclib.utils.DeadlineWrapper.start",
        ),
        parameters={
            "grpclib.server.Handler.__init__": (
                "self",
                "mapping",
                "codec",
                "status_details_codec",
                "dispatch",
            ),
            "grpclib.server.Server._protocol_factory": ("self",),
            "grpclib.client.Channel._protocol_factory": ("self",),
            "grpclib.protocol.H2Protocol.__init__": ("self", "handler", "config", "h2_config"),
            "grpclib.protocol.EventsProcessor.__init__": ("self", "handler", "connection"),
            "grpclib.protocol.EventsProcessor.register": ("self", "stream"),
            "grpclib.protocol.Stream.recv_data": ("self", "size"),
        },
    ),
    Requires(__name__, "h2", "4.4.1", members=("h2.utilities.SizeLimitDict",)),  # BigFrameChannel's
    *_h2_limits.REQUIRES,
    _hpack_patches.REQUIRES,
)
"""Everything in grpclib, h2, hyperframe and hpack that this module and the transport's own
(`hloserve._transport.h2_limits`, `hloserve._transport.h2_protocol`) reach into."""


@functools.cache
def install() -> None:
    """Check that grpclib, h2, hyperframe and hpack are what the patches were written for; raise
    `PatchMismatch` saying what differs otherwise. Then `_deadline_start`, the one change made
    for every grpclib server (see the module docstring)."""
    check(*REQUIRES)
    grpclib.utils.DeadlineWrapper.start = _deadline_start  # type: ignore[method-assign]


@contextlib.contextmanager
def _deadline_start(self: grpclib.utils.DeadlineWrapper, deadline: Any) -> Iterator[None]:
    """grpclib's `DeadlineWrapper.start`, but a deadline that passed before the call began is
    DEADLINE_EXCEEDED: grpclib raised outside its wrapper, answered UNKNOWN "Internal Server
    Error" and logged a traceback."""
    if not deadline.time_remaining():
        self.cancelled = True  # so that the request handler answers DEADLINE_EXCEEDED
        raise TimeoutError("Deadline exceeded")
    with _plain_deadline_start(self, deadline):
        yield


_plain_deadline_start = grpclib.utils.DeadlineWrapper.start


class GuardedStream(grpclib.server.Stream[Any, Any]):
    """grpclib's server stream, receiving within the transport's bounds and speaking gRPC
    compression. `GracefulServer` makes each of its calls' streams one (grpclib builds them in a
    module function no server can configure)."""

    async def send_initial_metadata(self, *, metadata: Any = None) -> None:
        """grpclib's, plus `grpc-accept-encoding` and, for a compressed reply, `grpc-encoding`."""
        await _compression.send_initial_metadata(self, metadata)

    async def send_message(self, message: Any) -> None:
        """grpclib's, compressing the message when the reply is compressed."""
        if not await _compression.send_compressed(self, message):
            await super().send_message(message)

    async def recv_message(self) -> Any:
        """A message over `server.max_message_bytes` or the budgets of messages being received
        is refused before it is buffered; a body that does not decode, and a unary call without
        exactly one message, are INVALID_ARGUMENT naming the RPC."""
        stream = self._stream
        rpc = self._method_name.rpartition("/")[2]
        unary = not self._cardinality.client_streaming
        meta = await _whole(stream, 5, rpc, "5-byte message prefix")
        if not meta:
            if unary and not self._messages_received:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, f"{rpc}: the request has no message; a unary call carries one"
                )
            return None
        refused = _compression.refused(self, meta[0])
        if refused is not None:
            raise refused
        (length,) = struct.unpack(">I", meta[1:])
        protocol: GuardedProtocol = stream.connection.guard  # type: ignore[attr-defined]
        limit = protocol.guard.limits.max_message_bytes
        if length > limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request of {length} bytes exceeds server.max_message_bytes ({limit}); "
                "send large tensors through system shared memory or raise the limit",
            )
        with protocol.receiving(length, rpc):
            data = await _whole(stream, length, rpc, f"{length}-byte message its prefix declares")
            if meta[0]:  # while the compressed bytes are held: the inflated ones count too
                data = await _compression.inflate(self, data, limit, rpc, protocol)
        try:
            message = self._codec.decode(data, self._recv_type)
        except GRPCError:
            raise
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"[:_DETAIL_CHARS]
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{rpc}: the request body does not decode as {self._recv_type.__name__} ({detail})",
            ) from None
        if unary and await stream.recv_data(5):
            raise GRPCError(Status.INVALID_ARGUMENT, f"{rpc} is unary: the request carries a second message")
        (message,) = await self._dispatch.recv_message(message)
        self._messages_received += 1
        stream.connection.messages_received += 1
        stream.connection.last_message_received = time.monotonic()
        return message


async def _whole(stream: Any, size: int, rpc: str, what: str) -> bytes:
    """`size` bytes of `stream`'s data (b"" at its end); INVALID_ARGUMENT when it ends sooner:
    grpclib asserts instead ("Received less data than expected"), which was answered UNKNOWN."""
    try:
        data: bytes = await stream.recv_data(size)
        return data
    except AssertionError as e:
        if "less data than expected" not in str(e):
            raise
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"{rpc}: the request ended before the whole {what} arrived"
        ) from None


def _guarded(handler: grpclib.const.Handler) -> grpclib.const.Handler:
    """`handler`, its stream made a `GuardedStream` before the method sees it."""
    method: Callable[[Any], Coroutine[Any, Any, None]] = handler.func

    async def guarded(stream: grpclib.server.Stream[Any, Any]) -> None:
        stream.__class__ = GuardedStream  # the same object: grpclib's request_handler closes it
        await method(stream)

    return handler._replace(func=guarded)


CLIENT_CLOSED_STREAMS = 1024
"""Closed streams a `BigFrameChannel` connection remembers (to tell a late frame on a stream it
reset from a protocol error): the streams it has open at once, ~100 at most, a few times over."""


class _BigFrameClientProtocol(grpclib.protocol.H2Protocol):
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        connection = self.connection._connection
        # no stream has closed yet: the record starts empty, bounded
        connection._closed_streams = h2.utilities.SizeLimitDict(size_limit=CLIENT_CLOSED_STREAMS)
        connection.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE})
        self.connection.flush()


class BigFrameChannel(grpclib.client.Channel):
    """A grpclib channel that takes 1 MiB frames, so a large reply comes in few, and remembers
    `CLIENT_CLOSED_STREAMS` closed streams, so that it holds the same memory after hours."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install()
        super().__init__(*args, **kwargs)

    def _protocol_factory(self) -> grpclib.protocol.H2Protocol:
        return _BigFrameClientProtocol(grpclib.client.Handler(), self._config, self._h2_config)


class _Cork:
    """Stands in for a stream's transport while a reply is framed, keeping what it is given."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)


async def send_reply(stream: Any, message: Any) -> None:
    """A unary call's reply and its OK trailers; in one socket write when the message fits the
    flow-control window and one frame (a larger one would wait for a window update that the
    held-back bytes themselves must earn, so it goes out frame by frame as grpclib sends it)."""
    h2_stream = stream._stream
    room = min(
        h2_stream._h2_connection.local_flow_control_window(h2_stream.id),
        h2_stream._h2_connection.max_outbound_frame_size,
    )
    if message.ByteSize() + 5 > room:
        await stream.send_message(message)
        return
    transport, cork = h2_stream._transport, _Cork()
    h2_stream._transport = cork
    try:
        await stream.send_message(message)
        await stream.send_trailing_metadata()
    finally:
        h2_stream._transport = transport
        transport.write(b"".join(cork.parts))


class GracefulServer(grpclib.server.Server):
    """A grpclib server within `limits`, whose shutdown lets calls finish, then tells clients
    with GOAWAY.

    New calls are refused with UNAVAILABLE once draining starts; calls still running after the
    grace period are cancelled. Its connections are `GuardedProtocol`s, its streams
    `GuardedStream`s.
    """

    def __init__(self, *args: Any, limits: TransportLimits | None = None, **kwargs: Any) -> None:
        install()
        super().__init__(*args, **kwargs)
        self._mapping = {path: _guarded(handler) for path, handler in self._mapping.items()}
        self.guard = ServerGuard(limits or TransportLimits())
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        self.draining = False

        async def refuse_while_draining(event: RecvRequest) -> None:
            # Health calls are answered (NOT_SERVING) on the connections a drain leaves open.
            if self.draining and not event.method_name.startswith("/grpc.health.v1.Health/"):
                raise GRPCError(Status.UNAVAILABLE, "server is shutting down")

        listen(self, RecvRequest, refuse_while_draining)

    def _protocol_factory(self) -> Any:
        self.__gc_step__()
        handler = grpclib.server.Handler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
        self._handlers.add(handler)
        protocol = GuardedProtocol(handler, self._config, self._h2_config, self.guard)
        self._protocols.add(protocol)
        return protocol

    async def start(
        self, *args: Any, ssl: Any = None, handshake_timeout_s: float = 60.0, **kwargs: Any
    ) -> None:
        """grpclib's start; running out of descriptors pauses accepting instead of failing.
        With `ssl` (a TLS context) a connection must finish its TLS handshake within
        `handshake_timeout_s` (grpclib leaves asyncio's 60 s): until then it is no connection of
        this server's, so `max_connections` does not count it."""
        self._loop.set_exception_handler(self.guard.exception_handler(self._loop.get_exception_handler()))
        if ssl is None:
            await super().start(*args, **kwargs)
            return
        host, port = args
        if self._server is not None:
            raise RuntimeError("Server is already started")
        self._server = await self._loop.create_server(
            self._protocol_factory,
            host,
            port,
            ssl=ssl,
            ssl_handshake_timeout=handshake_timeout_s,
            backlog=100,  # as grpclib's start
            **kwargs,
        )
        self._server_closed_fut = self._loop.create_future()

    @property
    def port(self) -> int:
        """The bound TCP port (useful when started on port 0)."""
        assert self._server is not None, "server not started"
        return int(self._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def running_calls(self) -> list[asyncio.Task[None]]:
        return [t for h in self._handlers for t in h._tasks.values() if not t.done()]

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, let running calls finish for up to `grace` seconds, then close."""
        if self._server is None:
            return
        self._server.close()
        self.draining = True
        pending = self.running_calls()
        if pending and grace > 0:
            await asyncio.wait(pending, timeout=grace)
        self.close()
        await asyncio.sleep(0)
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None and not connection.is_closing():
                connection._connection.close_connection()
                connection.flush()
            if getattr(protocol, "processor", None) is not None:
                protocol.processor.close("Server shutdown")
        await self.wait_closed()
        # Every call is done and each peer was sent GOAWAY: hang up on those that have not yet
        # (a connection left open would outlive the event loop, unclosed).
        for protocol in list(self._protocols):
            transport = getattr(protocol, "_transport", None)  # GuardedProtocol keeps it
            if transport is not None and not transport.is_closing():
                transport.close()
        await asyncio.sleep(0)  # the transports' connection_lost callbacks, which close the sockets
