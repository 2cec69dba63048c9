"""A raw unary gRPC call over HTTP/2, for what tritonclient cannot send: chosen headers (an
encoding, a deadline already passed), or a body framed by hand."""

from __future__ import annotations

import socket
import struct

import h2.config
import h2.connection
import h2.events

__all__ = ["SERVICE", "frame", "raw_call"]

SERVICE = "/inference.GRPCInferenceService/"


def raw_call(
    port: int, rpc: str, message: bytes, headers: list[tuple[str, str]]
) -> tuple[dict[str, str], bytes]:
    """One raw unary call over h2 with `headers` added; the response headers and trailers, and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        base = [
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + rpc),
            (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
        ]  # fmt: skip
        conn.send_headers(1, base + headers)
        conn.send_data(1, message, end_stream=True)
        sock.sendall(conn.data_to_send())
        found: dict[str, str] = {}
        body = b""
        pending = b""
        for _ in range(1000):  # bounded: a reply is a few frames
            data = sock.recv(1 << 20)
            assert data, "connection closed before the call ended"
            pending += data
            # Frame by frame, so that the call ends at the first end of its stream: under load
            # Triton sometimes repeats its trailers-only answer to an expired deadline (with a
            # RST_STREAM between), which h2 would raise on if it read on.
            while len(pending) >= 9 and len(pending) >= 9 + int.from_bytes(pending[:3], "big"):
                size = 9 + int.from_bytes(pending[:3], "big")
                one, pending = pending[:size], pending[size:]
                for event in conn.receive_data(one):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        found.update((str(k), str(v)) for k, v in event.headers or ())  # utf-8 decoded
                    elif isinstance(event, h2.events.DataReceived):
                        body += event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, 1)
                    elif isinstance(event, h2.events.StreamEnded):
                        return found, body
                    elif isinstance(event, h2.events.StreamReset):  # no status: the reset's code
                        return {**found, "reset": str(event.error_code)}, body
            sock.sendall(conn.data_to_send())
        raise AssertionError("the call never ended")


def frame(message: bytes, compressed: bool) -> bytes:
    """A gRPC message: the compressed flag and the length, then the bytes."""
    return struct.pack(">?I", compressed, len(message)) + message
