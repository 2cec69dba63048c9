"""A cheap gRPC load generator: raw HTTP/2 over a few sockets, one prebuilt ModelInfer request.

grpcio's asyncio client spends about 0.1 ms of Python per call, so one core offers only ~3x
what hloserve sustains on the MLP and then measures its own lag. Here a request costs a few
microseconds: its frames are built once (only the stream id changes), sent in one write per
connection per tick, and only the answers' frame headers and header blocks (for the status) are
decoded. Open loop sends at a fixed rate whatever comes back; closed loop keeps a number of
requests in flight. As a gRPC client, it keeps to the server's limit of streams per connection
(a request due while every connection is full waits, its clock running), and cancels a request
unanswered `deadline_s` after it was due (RST_STREAM), counted as `timeout` (`UNSENT` when
it never got a stream).
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import hpack

__all__ = ["UNSENT", "generate"]

UNSENT = "timeout, never sent"
"""The outcome of a request whose deadline passed while it waited for a stream."""

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _DATA, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW, _CONTINUATION = 1, 0, 3, 4, 6, 7, 8, 9
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_WINDOW_MAX = 2**31 - 1
_STATUS = {0: "OK", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED", 13: "INTERNAL", 14: "UNAVAILABLE"}


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


@dataclass
class _Connection:
    sock: socket.socket
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    next_stream: int = 1
    window: int = 65535
    """What the server lets this connection send."""
    max_streams: int = 100
    """The server's SETTINGS_MAX_CONCURRENT_STREAMS (h2's default until it says)."""
    out: bytearray = field(default_factory=bytearray)
    inbox: bytearray = field(default_factory=bytearray)
    block: bytearray = field(default_factory=bytearray)
    open: dict[int, float] = field(default_factory=dict)
    """Streams awaiting their answer, by when they were due."""
    received: int = 0


def _request_frames(url: str, message: bytes) -> tuple[bytes, bytes]:
    """The header block (without a timeout) and the DATA payload of every request."""
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", url), ("content-type", "application/grpc"), ("te", "trailers"),
    ]  # fmt: skip
    # A fresh encoder refers only to the static table, so the block stays valid when repeated.
    block = hpack.Encoder().encode(headers)
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return block, body


def _timeout_field(seconds: float) -> bytes:
    """`grpc-timeout` as an HPACK literal without indexing: what is left when the request goes
    out, as a gRPC client computes it from its deadline."""
    value = f"{max(1, int(seconds * 1000))}m".encode()
    return b"\x00\x0cgrpc-timeout" + bytes((len(value),)) + value


def generate(
    url: str,
    message: bytes,
    *,
    seconds: float,
    rate: float | None = None,
    concurrency: int = 64,
    deadline_s: float | None = None,
    connections: int = 8,
    backoff_s: float = 0.0,
) -> dict[str, Any]:
    """Send `message` (a serialized ModelInferRequest) for `seconds`: at `rate` per second, or
    keeping `concurrency` callers busy when `rate` is None (a caller refused with UNAVAILABLE
    waits `backoff_s` before its next request, as under a gRPC retry policy). Returns counts and
    latencies by outcome."""
    host, port = url.rsplit(":", 1)
    block, body = _request_frames(url, message)
    selector = selectors.DefaultSelector()

    def connect() -> _Connection:
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = _Connection(sock)
        conn.out += _PREFACE + _frame(_SETTINGS, 0, 0, struct.pack(">HI", 4, _WINDOW_MAX))
        conn.out += _frame(_WINDOW, 0, 0, struct.pack(">I", _WINDOW_MAX - 65535))
        selector.register(sock, selectors.EVENT_READ, conn)
        return conn

    conns = [connect() for _ in range(connections)]

    def reconnect(conn: _Connection, now: float) -> None:
        """The server closed or reset `conn` (or sent GOAWAY): its open streams fail as "connection
        lost", and a new connection takes its place, as a gRPC client's channel reconnects."""
        for stream in list(conn.open):
            finish(conn, stream, "connection lost", now)
        selector.unregister(conn.sock)
        conn.sock.close()
        conns[conns.index(conn)] = connect()

    outcomes: defaultdict[str, int] = defaultdict(int)
    latencies: defaultdict[str, list[float]] = defaultdict(list)
    messages: defaultdict[str, list[str]] = defaultdict(list)  # the first few of each refusal
    due: deque[tuple[float, _Connection, int]] = deque()  # open streams, oldest first
    backing_off: deque[float] = deque()  # when each refused caller sends again
    sent = 0
    inflight = 0

    def finish(conn: _Connection, stream: int, outcome: str, now: float) -> None:
        nonlocal inflight
        started = conn.open.pop(stream, None)
        if started is None:
            return  # cancelled already
        inflight -= 1
        if backoff_s and outcome == "UNAVAILABLE":
            backing_off.append(now + backoff_s)
        outcomes[outcome] += 1
        latencies[outcome].append(now - started)

    def send(conn: _Connection, started: float, now: float) -> bool:
        nonlocal sent, inflight
        if conn.window < len(body) or len(conn.open) >= conn.max_streams:
            return False
        sent += 1
        headers = block
        if deadline_s is not None:
            left = deadline_s - (now - started)
            if left <= 0:  # expired while waiting for a stream, as a gRPC client fails it locally
                outcomes[UNSENT] += 1
                latencies[UNSENT].append(now - started)
                return True
            headers = block + _timeout_field(left)
        stream = conn.next_stream
        conn.next_stream += 2
        conn.window -= len(body)
        conn.out += _frame(_HEADERS, _END_HEADERS, stream, headers) + _frame(_DATA, _END_STREAM, stream, body)
        conn.open[stream] = started
        due.append((started, conn, stream))
        inflight += 1
        return True

    def on_frame(conn: _Connection, kind: int, flags: int, stream: int, payload: bytes, now: float) -> None:
        if kind in (_HEADERS, _CONTINUATION):
            if kind == _HEADERS and flags & 0x8:  # padded
                payload = payload[1 : len(payload) - payload[0]]
            if kind == _HEADERS and flags & 0x20:  # priority
                payload = payload[5:]
            conn.block += payload
            if flags & _END_HEADERS:
                headers = dict(conn.decoder.decode(bytes(conn.block)))
                conn.block.clear()
                status = headers.get("grpc-status")
                if status is not None:
                    outcome = _STATUS.get(int(status), f"status {status}")
                    if outcome != "OK" and len(messages[outcome]) < 3:
                        messages[outcome].append(unquote(headers.get("grpc-message", "")))
                    finish(conn, stream, outcome, now)
        elif kind == _DATA:
            conn.received += len(payload)
            if conn.received > 1 << 20:
                conn.out += _frame(_WINDOW, 0, 0, struct.pack(">I", conn.received))
                conn.received = 0
        elif kind == _RST:
            finish(conn, stream, "RST_STREAM", now)
        elif kind == _WINDOW:
            increment = struct.unpack(">I", payload)[0] & _WINDOW_MAX
            if stream == 0:
                conn.window += increment
        elif kind == _SETTINGS and not flags & _ACK:
            for i in range(0, len(payload), 6):
                setting, value = struct.unpack(">HI", payload[i : i + 6])
                if setting == 3:
                    conn.max_streams = value
            conn.out += _frame(_SETTINGS, _ACK, 0, b"")
        elif kind == _PING and not flags & _ACK:
            conn.out += _frame(_PING, _ACK, 0, payload)
        elif kind == _GOAWAY:
            if len(messages["GOAWAY"]) < 3:
                messages["GOAWAY"].append(repr(payload[8:200]))
            raise ConnectionResetError("GOAWAY")

    start = time.perf_counter()
    stop = start + seconds
    index = 0
    while True:
        now = time.perf_counter()
        while backing_off and backing_off[0] <= now:
            backing_off.popleft()
        if now < stop:
            if rate is not None:
                wanted = int((now - start) * rate) - sent
            else:
                wanted = concurrency - inflight - len(backing_off)
            for _ in range(wanted):
                started = start + sent / rate if rate is not None else now
                for _ in range(connections):  # the next connection with room for a stream
                    index += 1
                    if send(conns[index % connections], started, now):
                        break
                else:
                    break  # every connection is full: what is due waits here, as in a client
        elif inflight == 0 or now > stop + (deadline_s or 5.0) + 1:
            break
        if deadline_s is not None:
            while due and now - due[0][0] > deadline_s:
                started, conn, stream = due.popleft()
                if stream in conn.open:
                    conn.out += _frame(_RST, 0, stream, struct.pack(">I", 8))  # CANCEL
                    finish(conn, stream, "timeout", now)
        else:
            while due and due[0][2] not in due[0][1].open:
                due.popleft()
        for conn in list(conns):
            if conn.out:
                try:
                    written = conn.sock.send(conn.out)
                except BlockingIOError:
                    written = 0
                except OSError:  # reset
                    reconnect(conn, time.perf_counter())
                    continue
                del conn.out[:written]
        for key, _ in selector.select(0.0005):
            conn = key.data
            if not any(c is conn for c in conns):
                continue  # replaced in this round
            try:
                chunk = conn.sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionResetError("closed")
                inbox = conn.inbox
                inbox += chunk
                offset, now = 0, time.perf_counter()
                while len(inbox) - offset >= 9:
                    length = int.from_bytes(inbox[offset : offset + 3], "big")
                    if len(inbox) - offset - 9 < length:
                        break
                    kind, flags = inbox[offset + 3], inbox[offset + 4]
                    stream = int.from_bytes(inbox[offset + 5 : offset + 9], "big") & _WINDOW_MAX
                    on_frame(conn, kind, flags, stream, bytes(inbox[offset + 9 : offset + 9 + length]), now)
                    offset += 9 + length
                del inbox[:offset]
            except BlockingIOError:
                continue
            except OSError:  # reset, closed, or GOAWAY
                reconnect(conn, time.perf_counter())
    elapsed = min(time.perf_counter(), stop) - start
    for conn in conns:
        conn.sock.close()
    return {
        "sent": sent,
        "elapsed": elapsed,
        "unanswered": inflight,
        "outcomes": dict(outcomes),
        "latencies": dict(latencies),
        "messages": dict(messages),
    }
