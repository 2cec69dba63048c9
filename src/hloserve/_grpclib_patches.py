"""What grpclib 0.4.9 (with h2 4.4.1, hyperframe 6.1.0) lacks for serving tensors, added here.

Measured in research/spike_grpc.md, each piece pinned to those versions by pyproject:

* h2 builds `repr(frame)` of every received frame for a trace log nobody reads, and hyperframe
  hexlifies the whole payload to do it (~42 us per 16 KiB frame, a few % of a tiny request);
* grpclib advertises 16 KiB frames, so a 4.8 MB tensor arrives in ~300 frames; 1 MiB cuts that
  (a client's own connection here; the server's transport and its bounds are `_h2_limits`
  and `_h2_protocol`);
* grpclib has no receive size limit: it buffers whatever length the client announces;
* grpclib answers a request body that does not decode, or a unary call with no message or two,
  with UNKNOWN "Internal Server Error" or not at all: `_recv_message` says INVALID_ARGUMENT;
* grpclib's close() never sends GOAWAY, so clients with calls in flight hang: `GracefulServer`;
* grpclib answers a call whose deadline passed before it began UNKNOWN, not DEADLINE_EXCEEDED;
* grpclib writes a unary reply's headers, message and trailers to the socket one by one: three
  system calls where one does (`send_reply`).

`install()` is idempotent and process-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import weakref
from collections.abc import Iterator
from typing import Any

import grpclib.protocol
import grpclib.server
import grpclib.utils
import h2.connection
import h2.settings
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError

from hloserve import _compression
from hloserve._h2_limits import MAX_FRAME_SIZE, ServerGuard, TransportLimits
from hloserve._h2_protocol import GuardedProtocol

__all__ = ["GracefulServer", "TransportLimits", "install", "send_reply"]

_DETAIL_CHARS = 200
_UNGUARDED = TransportLimits()
"""The limits of a grpclib server other than `GracefulServer` in this process (patched alike)."""


def _no_repr(_: object) -> str:
    return ""


class _BigFrameH2Connection(grpclib.protocol.H2Connection):
    def initiate_connection(self) -> None:
        super().initiate_connection()
        self.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE})


def _payload_refused(stream: grpclib.server.Stream[Any, Any], flags: int) -> GRPCError | None:
    """Why a message cannot be read, before any of it is buffered (compression: `_compression`)."""
    return _compression.refused(stream, flags)


async def _recv_message(self: grpclib.server.Stream[Any, Any]) -> Any:
    """grpclib's server `Stream.recv_message`, within the transport's bounds: a message over
    `server.max_message_bytes` or the budgets of messages being received is refused before it
    is buffered; a body that does not decode, and a unary call without exactly one message,
    are INVALID_ARGUMENT naming the RPC."""
    stream = self._stream
    rpc = self._method_name.rpartition("/")[2]
    unary = not self._cardinality.client_streaming
    meta = await stream.recv_data(5)
    if not meta:
        if unary and not self._messages_received:
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"{rpc}: the request has no message; a unary call carries one"
            )
        return None
    refused = _payload_refused(self, meta[0])
    if refused is not None:
        raise refused
    (length,) = struct.unpack(">I", meta[1:])
    protocol: GuardedProtocol | None = getattr(stream.connection, "guard", None)  # None: not ours
    limit = (protocol.guard.limits if protocol is not None else _UNGUARDED).max_message_bytes
    if length > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request of {length} bytes exceeds server.max_message_bytes ({limit}); "
            "send large tensors through system shared memory or raise the limit",
        )
    with protocol.receiving(length, rpc) if protocol is not None else contextlib.nullcontext():
        data = await stream.recv_data(length)
    if meta[0]:
        data = _compression.inflate(self, data, limit, rpc)
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


def install() -> None:
    """Apply the patches."""
    # The only repr() in h2.connection is the argument of that trace call; a module global
    # shadows the builtin there and nowhere else.
    h2.connection.repr = _no_repr  # type: ignore[attr-defined]
    grpclib.protocol.H2Connection = _BigFrameH2Connection  # type: ignore[misc]
    grpclib.server.Stream.recv_message = _recv_message  # type: ignore[method-assign]
    _compression.install()
    grpclib.utils.DeadlineWrapper.start = _deadline_start  # type: ignore[method-assign]


class GracefulServer(grpclib.server.Server):
    """A grpclib server within `limits`, whose shutdown lets calls finish, then tells clients
    with GOAWAY.

    New calls are refused with UNAVAILABLE once draining starts; calls still running after the
    grace period are cancelled. Relies on grpclib 0.4.9 internals (pinned).
    """

    def __init__(self, *args: Any, limits: TransportLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """grpclib's start; running out of descriptors pauses accepting instead of failing."""
        self._loop.set_exception_handler(self.guard.exception_handler(self._loop.get_exception_handler()))
        await super().start(*args, **kwargs)

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
