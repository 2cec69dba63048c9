"""One gRPC connection within the server's `TransportLimits`, under grpclib 0.4.9 / h2 4.4.1.

grpclib trusts the peer: streams reset before their handler starts are never released (+70 MiB
per 10,000), a connection's closed streams keep their buffers until a later collection, PING and
SETTINGS acks queue without bound for a peer that never reads, idle and silent sockets stay
for ever, GOAWAYs h2 prepares on a protocol error are never sent, and an exhausted descriptor
table crashes the worker. `GuardedProtocol` answers each with a bound: a stream is refused
(RST_STREAM REFUSED_STREAM, or a RESOURCE_EXHAUSTED status), an abusive connection gets GOAWAY
ENHANCE_YOUR_CALM, and nothing else on the server notices. None of these is filed upstream
(vmagamedov/grpclib): each is stated where it is answered, precisely enough to be. What this
module reaches into in grpclib and h2 is listed in `hloserve._transport.grpclib_patches.REQUIRES`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpclib.protocol
import h2.exceptions
import h2.settings
import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import encode_grpc_message
from h2.errors import ErrorCodes
from h2.events import RemoteSettingsChanged, RequestReceived, StreamReset
from h2.stream import StreamState

from hloserve._transport import compression as _compression
from hloserve._transport.h2_limits import CONNECTIONS, LimitedH2Connection, ServerGuard
from hloserve.allocator import return_freed_memory

__all__ = ["GuardedProtocol"]

log = structlog.get_logger("hloserve.grpc")

_GOAWAY_GRACE_S = 2.0
"""How long a connection told GOAWAY is kept (reading and discarding, so that closing it does not
reset away the GOAWAY) for its peer to read that and close; then it is dropped."""
_TRIM_BYTES = 1 << 20
"""Dropping at least this much of a partial message returns the freed heap to the system."""


class _Gone:
    """The transport as a call ended by GOAWAY sees it: closing, and writing nothing (the
    connection stays open a moment for its peer to read the GOAWAY)."""

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes) -> None:
        pass


def _drop(stream: grpclib.protocol.Stream) -> int:
    """Free what a stream's buffer holds; the flow-controlled bytes it had not acknowledged."""
    buffer = stream.buffer
    held = buffer._acked_size + sum(part.data_size for part in buffer._unacked._queue)  # type: ignore[attr-defined]
    unacked = buffer.unacked_size()
    buffer._acked.clear()
    buffer._acked_size = 0
    if held >= _TRIM_BYTES:
        return_freed_memory()  # the megabyte frames of an abandoned message
    return unacked


class _Processor(grpclib.protocol.EventsProcessor):
    """grpclib's event processor, releasing a stream the moment it is reset (grpclib leaks the
    streams reset before their handler task starts) and refusing oversized header lists."""

    def __init__(
        self, handler: Any, connection: grpclib.protocol.Connection, protocol: GuardedProtocol
    ) -> None:
        super().__init__(handler, connection)
        self.protocol = protocol
        self.resets = 0

    def register(self, stream: grpclib.protocol.Stream) -> Any:
        stream_id = stream.id
        assert stream_id is not None
        self.streams[stream_id] = stream
        self.protocol.busy = True
        return lambda: self.release(stream_id)

    def release(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        self.connection.stream_close_waiter.set()
        if stream is None or self.connection.is_closing():
            return
        self.connection.ack(stream_id, _drop(stream))
        if stream.closable:  # the call is over for us, not for the client
            h2_stream = self.connection._connection.streams[stream_id]
            answered = h2_stream.state_machine.state is StreamState.HALF_CLOSED_LOCAL
            stream.reset_nowait(ErrorCodes.NO_ERROR if answered else ErrorCodes.CANCEL)

    def close(self, reason: str = "Connection closed") -> None:
        streams = list(self.streams.values())
        super().close(reason)
        for stream in streams:  # grpclib's handler keeps them until its next collection
            _drop(stream)

    def stop(self, reason: str) -> None:
        """End every call and free its buffers, leaving the transport open."""
        self.handler.close()
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream._transport = _Gone()  # type: ignore[assignment]
            stream.__terminated__(reason)
            _drop(stream)

    def process_request_received(self, event: RequestReceived) -> None:
        headers: Any = event.headers
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        limit = self.protocol.guard.limits.max_header_list_bytes
        if size <= limit:
            super().process_request_received(event)
            stream = self.streams.get(event.stream_id)
            if stream is not None:  # grpclib's server keeps no grpc-* header: compression needs two
                _compression.keep_headers(stream, headers)
            return
        h2_connection = self.connection._connection
        message = f"request headers of {size} bytes exceed server.max_header_list_bytes ({limit})"
        h2_connection.send_headers(
            event.stream_id,
            [
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", str(Status.RESOURCE_EXHAUSTED.value)),
                ("grpc-message", encode_grpc_message(message)),
            ],
            end_stream=True,
        )
        if not h2_connection.streams[event.stream_id].closed:
            h2_connection.reset_stream(event.stream_id, ErrorCodes.NO_ERROR)
        self.resets += 1  # a refusal, as cheap to send in a flood as a reset

    def process_remote_settings_changed(self, event: RemoteSettingsChanged) -> None:
        super().process_remote_settings_changed(event)
        self.protocol.handshaken()

    def process_stream_reset(self, event: StreamReset) -> None:
        super().process_stream_reset(event)
        self.release(event.stream_id)
        self.resets += event.remote_reset


class GuardedProtocol(grpclib.protocol.H2Protocol):
    """grpclib's server protocol for one connection, within the server's `TransportLimits`."""

    processor: _Processor

    def __init__(self, handler: Any, config: Any, h2_config: Any, guard: ServerGuard) -> None:
        super().__init__(handler, config, h2_config)
        self.guard = guard
        self.busy = False
        """A call started since the idle timer last looked."""
        self._admitted = False
        self._closing = False
        """GOAWAY sent: what the peer sends is discarded until it closes or the grace ends."""
        self._shaken = False
        self._backlog = 0
        self._receiving = 0
        self._stalled_at = -1
        """`connection.data_sent` when the idle timer last saw our data wait on the peer."""
        self._resets_counted = 0
        self._reset_tokens = float(guard.limits.stream_reset_burst)
        self._reset_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- lifetime --------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        limits = self.guard.limits
        self._transport = transport
        if self.guard.connections >= limits.max_connections:
            self._refuse_connection(transport, "server.max_connections", limits.max_connections)
            return
        if not CONNECTIONS.take():
            self._refuse_connection(transport, "server.max_open_connections", CONNECTIONS.cap)
            return
        self.guard.refusing = False
        self._admitted = True
        self.guard.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            grpclib.protocol._set_nodelay(sock)
        self._h2 = LimitedH2Connection(self.h2_config, limits)
        self._h2.initiate_connection()
        initial = self._h2.local_settings.initial_window_size
        if self.config.http2_connection_window_size != initial:
            self._h2.increment_flow_control_window(self.config.http2_connection_window_size - initial)
        if self.config.http2_stream_window_size != initial:
            self._h2.update_settings(
                {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size}
            )
        self.connection = grpclib.protocol.Connection(self._h2, transport, config=self.config)
        self.connection.guard = self  # type: ignore[attr-defined]  # for `receiving`
        self.connection.flush()
        self.connection.initialize()
        self.processor = _Processor(self.handler, self.connection, self)
        self._reset_at = asyncio.get_event_loop().time()
        self._timer = asyncio.get_event_loop().call_later(limits.handshake_timeout_s, self._handshake_due)

    def _refuse_connection(self, transport: Any, key: str, cap: int) -> None:
        """Past `server.max_connections` or the process's `server.max_open_connections`: our
        preface and GOAWAY, then close."""
        h2_connection = h2.connection.H2Connection(self.h2_config)
        h2_connection.initiate_connection()
        h2_connection.close_connection(ErrorCodes.NO_ERROR, f"{key} ({cap}) reached; retry later".encode(), 0)
        transport.write(h2_connection.data_to_send())
        transport.close()
        self.handler.close()
        if not self.guard.refusing:  # once per spell at the cap
            self.guard.refusing = True
            log.warning("refusing connections", key=key, cap=cap)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self.guard.connections -= 1
        CONNECTIONS.give()
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def handshaken(self) -> None:
        if self._shaken:
            return
        self._shaken = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_event_loop().call_later(self.guard.limits.idle_timeout_s, self._idle_due)

    def _handshake_due(self) -> None:
        if not self._shaken and not self._closing:
            self._transport.abort()  # it has not spoken HTTP/2: nothing to tell it

    def _idle_due(self) -> None:
        """Every `idle_timeout_s`: close a connection that had no call since the last look (gRPC's
        MAX_CONNECTION_IDLE), or whose peer accepted none of our data since then while replies
        wait for it (it does not read, or opens no flow-control window)."""
        if self._closing:
            return
        if not self.processor.streams and not self.busy:
            self._goaway(ErrorCodes.NO_ERROR, "idle for server.idle_timeout_s")
            return
        sent, blocked = self.connection.data_sent, self._blocked()
        if blocked and self._stalled_at == sent:
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, "the peer accepted no data for server.idle_timeout_s")
            return
        self._stalled_at = sent if blocked else -1
        self.busy = False
        self._timer = asyncio.get_event_loop().call_later(self.guard.limits.idle_timeout_s, self._idle_due)

    def _blocked(self) -> bool:
        """Whether our data waits on the peer: it does not read, or a call's window is shut."""
        if not self.connection.write_ready.is_set():
            return True
        h2_streams = self._h2.streams
        return any(
            self._h2.local_flow_control_window(stream_id) <= 0
            for stream_id in self.processor.streams
            if stream_id in h2_streams and not h2_streams[stream_id].closed
        )

    def _goaway(self, code: ErrorCodes, reason: str) -> None:
        """GOAWAY with `reason`, every call ended, the connection dropped after the grace."""
        self._h2.close_connection(code, reason.encode())
        self._wind_down(reason)
        if code != ErrorCodes.NO_ERROR:
            peer = str(self._transport.get_extra_info("peername"))
            log.warning("connection closed", reason=reason, peer=peer)

    def _wind_down(self, reason: str) -> None:
        self.connection.flush()
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        self.processor.stop(reason)
        self._timer = asyncio.get_event_loop().call_later(_GOAWAY_GRACE_S, self._transport.abort)

    # -- frames ----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not self._admitted or self._closing:
            return
        queued = self._transport.get_write_buffer_size()
        try:
            events = self.connection.feed(data)
        except h2.exceptions.ProtocolError as e:
            self._wind_down(f"protocol error: {e}")  # sends the GOAWAY h2 prepared (grpclib drops it)
            if not self._shaken:  # no preface (garbage, an HTTP/1.1 request): no call to finish
                if self._timer is not None:
                    self._timer.cancel()
                self._transport.close()  # after the GOAWAY; it stayed open for the grace period
            return
        self.connection.flush()
        for event in events:
            self.processor.process(event)
        if self._closing or self.connection.is_closing():
            return
        self.connection.flush()
        self._count_resets()
        if not self.connection.write_ready.is_set() and not self._closing:
            self._backlog += max(0, self._transport.get_write_buffer_size() - queued)
            if self._backlog > self.guard.limits.max_send_backlog_bytes:
                self._goaway(
                    ErrorCodes.ENHANCE_YOUR_CALM,
                    "the peer does not read its replies (server.max_send_backlog_bytes)",
                )

    def resume_writing(self) -> None:
        self._backlog = 0
        super().resume_writing()

    def _count_resets(self) -> None:
        """nghttp2's rapid-reset defence: a token bucket of streams reset or refused."""
        resets = self.processor.resets + self._h2.refused
        spent, self._resets_counted = resets - self._resets_counted, resets
        if not spent:
            return
        limits = self.guard.limits
        now = asyncio.get_event_loop().time()
        refill = (now - self._reset_at) * limits.stream_reset_rate
        self._reset_tokens = min(float(limits.stream_reset_burst), self._reset_tokens + refill) - spent
        self._reset_at = now
        if self._reset_tokens < 0:
            self._goaway(
                ErrorCodes.ENHANCE_YOUR_CALM,
                "stream reset flood (server.stream_reset_burst, server.stream_reset_rate)",
            )

    # -- messages being received -----------------------------------------------------------------

    def receiving_room(self) -> int:
        """Bytes of messages the connection's and the server's budgets can still hold now."""
        limits, guard = self.guard.limits, self.guard
        return max(
            0,
            min(
                limits.max_receiving_bytes_per_connection - self._receiving,
                limits.max_receiving_bytes - guard.receiving,
            ),
        )

    def refusal(self, length: int, rpc: str, what: str = "") -> GRPCError | None:
        """Why `length` more bytes of messages (`what`: a message of that many bytes) cannot be
        held now, over the connection's or the server's budget; None when they can."""
        limits, guard = self.guard.limits, self.guard
        what = what or f"a message of {length} bytes"
        held = self._receiving
        if held + length > limits.max_receiving_bytes_per_connection:
            return GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"{rpc}: {what} would hold {held + length} bytes of messages "
                "being received on this connection, over server.max_receiving_bytes_per_connection "
                f"({limits.max_receiving_bytes_per_connection}); send large tensors through shared memory",
            )
        if guard.receiving + length > limits.max_receiving_bytes:
            return GRPCError(
                Status.UNAVAILABLE,
                f"{rpc}: the server is receiving {guard.receiving} bytes of messages already; "
                f"{what} would pass server.max_receiving_bytes "
                f"({limits.max_receiving_bytes}); retry later",
            )
        return None

    @contextmanager
    def receiving(self, length: int, rpc: str) -> Iterator[None]:
        """Hold `length` bytes of a message being received against the connection's and the
        server's budgets, refusing the call when either would overflow."""
        guard = self.guard
        refused = self.refusal(length, rpc)
        if refused is not None:
            raise refused
        held = self._receiving
        self._receiving = held + length
        guard.receiving += length
        try:
            yield
        finally:
            self._receiving -= length
            guard.receiving -= length
