"""The gRPC transport's bounds (`TransportLimits`, one `ServerGuard` per server) and the part
h2 itself enforces: `LimitedH2Connection`, hloserve's server-side h2 connection (no other h2
user in the process is touched), which

* holds its advertised settings from the first frame: h2 4.4.1 applies local settings only once
  the peer acks them (python-hyper/h2#1288, as designed there), and checks a read's frames
  against the limit in force when the read began, so a client's SETTINGS ack and its first
  64 KiB request in one read were torn down as an oversized frame;
* refuses a stream past the stream limit (REFUSED_STREAM) rather than the whole connection;
* bounds header blocks in bytes (h2 counts 64 CONTINUATION frames: 64 MiB at 1 MiB frames);
* does not hexlify DATA payloads for a trace log: h2 builds `repr(frame)` of every frame it
  receives before calling the logger, and hyperframe's repr of a DATA frame serializes and
  hexlifies the whole payload before cutting it to 20 digits, ~3.5 ms per 1 MiB frame (not
  filed upstream: h2 could pass the frame to the logger lazily, hyperframe could hexlify only
  the digits it shows);
* Huffman-encodes headers in linear time (`hloserve._transport.hpack_patches`).

What grpclib must do per connection is `hloserve._transport.h2_protocol`; `REQUIRES` lists what this
module reaches into.
"""

from __future__ import annotations

import asyncio
import errno
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h2.connection
import h2.exceptions
import h2.frame_buffer
import h2.settings
import structlog
from h2.errors import ErrorCodes
from h2.events import RequestReceived, StreamEnded
from hyperframe.exceptions import InvalidDataError, InvalidFrameError
from hyperframe.frame import DataFrame, Frame, HeadersFrame

from hloserve._transport.hpack_patches import LinearHuffmanEncoder
from hloserve._transport.requirements import Requires

if TYPE_CHECKING:
    from hloserve.config import ServerConfig

__all__ = [
    "CONNECTIONS",
    "MAX_FRAME_SIZE",
    "REQUIRES",
    "ConnectionBudget",
    "LimitedH2Connection",
    "ServerGuard",
    "TransportLimits",
    "default_max_connections",
]

log = structlog.get_logger("hloserve.grpc")

MAX_FRAME_SIZE = 1 << 20
"""Advertised and accepted from the first byte: a 4.8 MB tensor in 5 frames instead of 300."""
_HARD_HEADER_FACTOR = 4
"""Header lists up to this multiple of the limit are decoded and refused per stream (HPACK's
state must stay in step); beyond it the connection is closed (an HPACK bomb)."""
_DESCRIPTOR_RESERVE = 128
_CLOSED_STREAMS_FACTOR = 4
"""Closed streams a connection remembers, per stream it allows open (`LimitedH2Connection`)."""
REQUIRES = (
    Requires(
        __name__,
        "h2",
        "4.4.1",
        members=(
            "h2.connection.H2Connection.MAX_CLOSED_STREAMS",
            "h2.connection.H2Connection._frame_dispatch_table",
            "h2.connection.H2Connection._receive_data_frame",
            "h2.connection.H2Connection._receive_headers_frame",
            "h2.connection.H2Connection.open_inbound_streams",
            "h2.connection.H2Connection.local_settings",
            "h2.connection.H2Connection.max_inbound_frame_size",
            "h2.connection.H2Connection.incoming_buffer",
            "h2.connection.H2Connection.decoder",
            "h2.connection.H2Connection.encoder",
            "h2.connection.H2Connection.streams",
            "h2.frame_buffer.FrameBuffer._headers_buffer",
            "h2.frame_buffer.FrameBuffer._data",
            "h2.frame_buffer.FrameBuffer._validate_frame_length",
            "h2.settings.Settings.max_concurrent_streams",
            "h2.stream.H2Stream.state_machine",
            "h2.stream.StreamState.HALF_CLOSED_LOCAL",
        ),
        parameters={
            "h2.frame_buffer.FrameBuffer.__init__": ("self", "server"),
            "h2.frame_buffer.FrameBuffer._update_header_buffer": ("self", "f"),
            "h2.connection.H2Connection._receive_frame": ("self", "frame"),
            "h2.connection.H2Connection._receive_data_frame": ("self", "frame"),
            "h2.connection.H2Connection._receive_headers_frame": ("self", "frame"),
        },
    ),
    Requires(__name__, "hyperframe", "6.1.0", members=("hyperframe.frame.DataFrame.data",)),
)

_DATA = 0x0
"""The type of a DATA frame, its header's fourth byte."""
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def default_max_connections() -> int:
    """The soft RLIMIT_NOFILE less a reserve for the worker's own files, within 16..10000."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, min(10_000, soft - _DESCRIPTOR_RESERVE))


class ConnectionBudget:
    """The connections this process holds on all its listeners (gRPC, REST, metrics), against one
    budget of descriptors: `server.max_open_connections`, else `default_max_connections()`.
    A listener `take`s one for each connection it admits (refusing the connection when it gets
    none) and `give`s it back when the connection closes."""

    def __init__(self) -> None:
        self.open = 0
        self.limit: int | None = None

    def configure(self, limit: int | None) -> None:
        self.limit = limit

    @property
    def cap(self) -> int:
        return self.limit or default_max_connections()

    def take(self) -> bool:
        if self.open >= self.cap:
            return False
        self.open += 1
        return True

    def give(self) -> None:
        self.open -= 1

    def __repr__(self) -> str:
        return f"<ConnectionBudget {self.open}/{self.cap}>"


CONNECTIONS = ConnectionBudget()
"""This process's: every listener's connections count here."""


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """The `server.*` bounds of the gRPC transport (documented in `hloserve.config`)."""

    max_message_bytes: int = 1 << 30
    max_concurrent_streams: int = 100
    max_connections: int = 1000
    max_header_list_bytes: int = 16 << 10
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_receiving_bytes_per_connection: int = 1 << 30
    max_receiving_bytes: int = 2 << 30
    stream_reset_burst: int = 1000
    stream_reset_rate: float = 33.0
    max_send_backlog_bytes: int = 1 << 20

    @classmethod
    def from_config(cls, server: ServerConfig) -> TransportLimits:
        return cls(
            max_message_bytes=server.max_message_bytes,
            max_concurrent_streams=server.max_concurrent_streams,
            max_connections=server.max_connections or default_max_connections(),
            max_header_list_bytes=server.max_header_list_bytes,
            handshake_timeout_s=server.handshake_timeout_s,
            idle_timeout_s=server.idle_timeout_s,
            max_receiving_bytes_per_connection=server.max_receiving_bytes_per_connection,
            max_receiving_bytes=server.max_receiving_bytes,
            stream_reset_burst=server.stream_reset_burst,
            stream_reset_rate=server.stream_reset_rate,
            max_send_backlog_bytes=server.max_send_backlog_bytes,
        )


class ServerGuard:
    """What all connections of one server share: the limits, the connection count, and the
    bytes of messages being received."""

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.connections = 0
        self.receiving = 0
        self.refusing = False
        """Connections have been refused since one was last admitted."""

    def exception_handler(self, previous: Any) -> Any:
        """An event-loop exception handler that logs an accept() refused for want of
        descriptors (asyncio then retries a second later) instead of letting trio-asyncio
        raise it into the worker's nursery; every other error goes to `previous`."""

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            error = context.get("exception")
            accepting = str(context.get("message", "")).startswith("socket.accept()")
            if accepting and isinstance(error, OSError) and error.errno in _OUT_OF_DESCRIPTORS:
                log.warning("cannot accept a connection", error=str(error), connections=self.connections)
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        return handle


class _AdvertisedSettings(h2.settings.Settings):
    """Local settings in force from the start; h2's own stream count check, which tears the
    whole connection down, is left to `_LimitedH2Connection` (it refuses only the stream)."""

    @property  # type: ignore[misc]  # read-only: nothing sets it after construction
    def max_concurrent_streams(self) -> int:
        return 2**31


class _DataFrame(DataFrame):
    """A received DATA frame whose repr, built by h2 for every frame, costs nothing."""

    def __repr__(self) -> str:
        return f"DataFrame(stream_id={self.stream_id}, {len(self.data)} bytes)"


class _BoundedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, holding at most `limit` bytes of one header block before END_HEADERS
    (h2 counts 64 CONTINUATION frames, not bytes: 64 MiB at our frame size), and handing out
    DATA frames as `_DataFrame`s, each payload copied once out of the buffer (h2 slices the
    buffer, a copy, before hyperframe copies the slice)."""

    def __init__(self, limit: int) -> None:
        super().__init__(server=True)
        self.limit = limit

    def __next__(self) -> Any:
        data = self._data
        if len(data) < 9 or data[3] != _DATA or self._headers_buffer:
            frame = super().__next__()
            if type(frame) is DataFrame:
                frame.__class__ = _DataFrame
            return frame
        try:
            frame, length = Frame.parse_frame_header(memoryview(bytes(data[:9])))
        except (InvalidDataError, InvalidFrameError) as e:  # a DATA frame on stream 0
            raise h2.exceptions.ProtocolError(f"Received frame with invalid header: {e!s}") from e
        if len(data) < 9 + length:
            raise StopIteration
        self._validate_frame_length(length)
        try:
            with memoryview(data) as view, view[9 : 9 + length] as body:
                frame.parse_body(body)  # the payload's one copy
        except InvalidDataError as e:
            raise h2.exceptions.ProtocolError("Received frame with non-compliant data") from e
        except InvalidFrameError as e:
            raise h2.exceptions.FrameDataMissingError("Frame data missing or invalid") from e
        del data[: 9 + length]
        frame.__class__ = _DataFrame
        return frame

    def _update_header_buffer(self, f: Any) -> Any:
        f = super()._update_header_buffer(f)
        held = sum(len(part.data) for part in self._headers_buffer)
        if isinstance(f, HeadersFrame):
            held = len(f.data)
        if held > self.limit:
            raise h2.exceptions.DenialOfServiceError(
                f"header block of more than {self.limit} bytes "
                f"({_HARD_HEADER_FACTOR} x server.max_header_list_bytes)"
            )
        return f


class LimitedH2Connection(h2.connection.H2Connection):
    """A server-side h2 connection within `limits`; see the module docstring."""

    def __init__(self, config: Any, limits: TransportLimits) -> None:
        # h2 remembers how each closed stream closed, to tell a late frame on a reset stream
        # from a protocol error, and keeps the last 65,536: ~90 bytes each, so every long-lived
        # connection grows to hold ~6 MB over its first 65,536 requests (issue 38's soak). A
        # late frame can only name a stream the client still thought open, at most
        # `max_concurrent_streams` of them, so a few times that is plenty.
        self.MAX_CLOSED_STREAMS = _CLOSED_STREAMS_FACTOR * limits.max_concurrent_streams
        super().__init__(config)
        self.stream_limit = limits.max_concurrent_streams
        self.local_settings = _AdvertisedSettings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
            },
        )
        self.max_inbound_frame_size = MAX_FRAME_SIZE
        hard = _HARD_HEADER_FACTOR * limits.max_header_list_bytes
        self.decoder.max_header_list_size = hard
        self.incoming_buffer = _BoundedFrameBuffer(hard)
        self._frame_dispatch_table[_DataFrame] = self._receive_data_frame
        stock = self.encoder.huffman_coder
        self.encoder.huffman_coder = LinearHuffmanEncoder(
            stock.huffman_code_list, stock.huffman_code_list_lengths
        )
        self.refused = 0

    def _receive_headers_frame(self, frame: Any) -> Any:
        full = frame.stream_id not in self.streams and self.open_inbound_streams >= self.stream_limit
        frames, events = super()._receive_headers_frame(frame)  # decoded either way: HPACK state
        if full:
            self.reset_stream(frame.stream_id, ErrorCodes.REFUSED_STREAM)
            self.refused += 1
            events = [e for e in events if not isinstance(e, RequestReceived | StreamEnded)]
        return frames, events
