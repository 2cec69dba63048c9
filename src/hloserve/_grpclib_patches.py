"""What grpclib 0.4.9 (with h2 4.4.1, hyperframe 6.1.0) lacks for serving tensors, added here.

Measured in research/spike_grpc.md, each piece pinned to those versions by pyproject:

* h2 builds `repr(frame)` of every received frame for a trace log nobody reads, and hyperframe
  hexlifies the whole payload to do it (~42 us per 16 KiB frame, a few % of a tiny request);
* grpclib advertises 16 KiB frames, so a 4.8 MB tensor arrives in ~300 frames; 1 MiB cuts that;
* grpclib has no receive size limit: it buffers whatever length the client announces;
* grpclib's close() never sends GOAWAY, so clients with calls in flight hang: `GracefulServer`;
* grpclib writes a unary reply's headers, message and trailers to the socket one by one: three
  system calls where one does (`send_reply`).

`install()` is idempotent and process-wide; the receive limit is the largest any worker set.
"""

from __future__ import annotations

import asyncio
import struct
import weakref
from typing import Any

import grpclib.protocol
import grpclib.server
import h2.connection
import h2.settings
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError

__all__ = ["GracefulServer", "install", "send_reply"]

_MAX_FRAME_SIZE = 1 << 20
_receive_limit = 0


def _no_repr(_: object) -> str:
    return ""


class _BigFrameH2Connection(grpclib.protocol.H2Connection):
    def initiate_connection(self) -> None:
        super().initiate_connection()
        self.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: _MAX_FRAME_SIZE})


async def _recv_message_limited(stream: Any, codec: Any, message_type: Any) -> Any:
    """grpclib's recv_message, refusing a message longer than the limit before buffering it."""
    meta = await stream.recv_data(5)
    if not meta:
        return None
    if meta[0]:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported; send uncompressed")
    (length,) = struct.unpack(">I", meta[1:])
    if length > _receive_limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request of {length} bytes exceeds server.max_message_bytes ({_receive_limit}); "
            "send large tensors through system shared memory or raise the limit",
        )
    return codec.decode(await stream.recv_data(length), message_type)


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


def install(max_receive_bytes: int) -> None:
    """Apply the patches; the receive limit only ever grows (several workers in one process)."""
    global _receive_limit
    _receive_limit = max(_receive_limit, max_receive_bytes)
    # The only repr() in h2.connection is the argument of that trace call; a module global
    # shadows the builtin there and nowhere else.
    h2.connection.repr = _no_repr  # type: ignore[attr-defined]
    grpclib.protocol.H2Connection = _BigFrameH2Connection  # type: ignore[misc]
    grpclib.server.recv_message = _recv_message_limited


class GracefulServer(grpclib.server.Server):
    """A grpclib server whose shutdown lets calls finish, then tells clients with GOAWAY.

    New calls are refused with UNAVAILABLE once draining starts; calls still running after the
    grace period are cancelled. Relies on grpclib 0.4.9 internals (pinned).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        self.draining = False

        async def refuse_while_draining(event: RecvRequest) -> None:
            # Health calls are answered (NOT_SERVING) on the connections a drain leaves open.
            if self.draining and not event.method_name.startswith("/grpc.health.v1.Health/"):
                raise GRPCError(Status.UNAVAILABLE, "server is shutting down")

        listen(self, RecvRequest, refuse_while_draining)

    def _protocol_factory(self) -> Any:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        return protocol

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
