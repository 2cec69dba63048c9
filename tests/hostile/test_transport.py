"""Hostile HTTP/2 peers against the gRPC transport (`hloserve._transport.h2_limits`): frame sizes, stream,
connection, header and receive bounds, floods, descriptors, and the statuses of bodies that do
not decode. Each test asserts what the peer is told and that a good request is answered after;
the memory cases run a server in a subprocess and assert its RSS comes back."""

from __future__ import annotations

import resource
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from h2.errors import ErrorCodes
from hyperframe.frame import ContinuationFrame, HeadersFrame, PingFrame, SettingsFrame
from support.clients import assert_serves, rss_bytes
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

from hloserve._transport.h2_limits import TransportLimits, default_max_connections
from hloserve.config import load_config
from hloserve.errors import ConfigError

pytestmark = pytest.mark.serial  # asserts on timing, or floods the machine

SERVICE = "/inference.GRPCInferenceService/"
MiB = 1 << 20
LIMITS = {
    "max_concurrent_streams": 8,
    "max_connections": 12,
    "max_header_list_bytes": 4096,
    "handshake_timeout_s": 0.5,
    "idle_timeout_s": 1.0,
    "stream_reset_burst": 200,
    "stream_reset_rate": 10.0,
    "max_send_backlog_bytes": 1 << 16,
}


@pytest.fixture(scope="module", name="server", params=[0, 2], ids=["frontends0", "frontends2"])
def _server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker with small transport bounds, so each is reached with little traffic; with two
    frontends each applies them to the connections it holds."""
    with start_worker(make_config(**LIMITS), frontends=request.param) as server:
        yield server


def framed(message: bytes) -> bytes:
    return struct.pack(">?I", False, len(message)) + message


class Peer:
    """A raw HTTP/2 client connection (h2 in client mode) that may break every rule."""

    def __init__(
        self,
        port: int,
        handshake: bool = True,
        receive_buffer: int | None = None,
        settings: dict[int, int] | None = None,
    ) -> None:
        self.sock = socket.socket()
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", port))
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.broken = not handshake  # a peer that says nothing: read and discard, never answer
        if settings:
            self.h2.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        if handshake:
            self.h2.initiate_connection()
            self.flush()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def flush(self) -> None:
        """Send what h2 has queued; a connection the server closed is found by reading."""
        try:
            self.sock.sendall(self.h2.data_to_send())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def start(self, rpc: str, end: bool = False, extra: list[tuple[str, str]] | None = None) -> int:
        """Open a gRPC call's stream; returns its id."""
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + rpc),
            (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
        ]  # fmt: skip
        self.h2.send_headers(stream_id, headers + (extra or []), end_stream=end)
        self.flush()
        return stream_id

    def read(self, until: Callable[[list[Any]], bool], timeout: float = 5) -> list[Any]:
        """The events received until `until(events)` holds, the connection ends, or `timeout`."""
        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while not until(events) and not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                break
            if self.broken:
                continue
            try:
                new = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:  # frames after the server's GOAWAY, or no preface
                self.broken = True  # what follows is read and discarded until the end
                continue
            events += new
            self.terminated = next(
                (e for e in new if isinstance(e, h2.events.ConnectionTerminated)), self.terminated
            )
            if reply := self.h2.data_to_send():  # acks
                try:
                    self.sock.sendall(reply)
                except OSError:
                    pass
        return events

    def call(
        self, rpc: str, body: bytes | None, extra: list[tuple[str, str]] | None = None
    ) -> dict[str, str]:
        """One unary call; the response's headers and trailers together."""
        stream_id = self.start(rpc, end=body is None, extra=extra)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=True)
            self.flush()
        events = self.read(lambda es: any(_ends(e, stream_id) for e in es))
        return _status(events, stream_id)

    def goaway(self, timeout: float = 5) -> h2.events.ConnectionTerminated:
        self.read(lambda _: self.terminated is not None, timeout)
        assert self.terminated is not None, "no GOAWAY"
        return self.terminated

    def raw_goaway(self, timeout: float = 10) -> tuple[int, bytes]:
        """The GOAWAY in whatever the socket still delivers, scanned frame by frame without h2
        (fast enough to drain megabytes of acks before the server drops them)."""
        data, offset, deadline = bytearray(), 0, time.monotonic() + timeout
        self.sock.settimeout(1)
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(1 << 22)
            except (TimeoutError, ConnectionResetError):
                chunk = b""
            data += chunk
            while offset + 9 <= len(data):
                length = int.from_bytes(data[offset : offset + 3], "big")
                if offset + 9 + length > len(data):
                    break
                if data[offset + 3] == 0x7:  # GOAWAY
                    payload = bytes(data[offset + 9 : offset + 9 + length])
                    return int.from_bytes(payload[4:8], "big"), payload[8:]
                offset += 9 + length
            del data[:offset]
            offset = 0
            if not chunk:
                break
        raise AssertionError("no GOAWAY before the connection ended")

    def ended(self, timeout: float = 5) -> bool:
        """Whether the server closes the connection within `timeout` (reading what comes)."""
        self.read(lambda _: False, timeout)
        return self.closed


def _ends(event: Any, stream_id: int) -> bool:
    return isinstance(event, h2.events.StreamEnded | h2.events.StreamReset) and event.stream_id == stream_id


def _status(events: list[Any], stream_id: int) -> dict[str, str]:
    found: dict[str, str] = {}
    for e in events:
        if getattr(e, "stream_id", None) == stream_id and hasattr(e, "headers"):
            found.update(e.headers)
        if isinstance(e, h2.events.StreamReset) and e.stream_id == stream_id:
            found["rst"] = str(e.error_code)
    return found


def infer(url: str, padding: int, timeout: float = 10) -> None:
    """A good MLP request made `padding` bytes larger by a request parameter."""
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
        result = client.infer("mlp", [tensor], parameters={"padding": "x" * padding}, client_timeout=timeout)
        assert result.as_numpy("OUTPUT0").shape == (2, 4)
    finally:
        client.close()


# -- frames --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [17 << 10, 40 << 10, 64 << 10, 200 << 10])
def test_a_large_first_request_on_a_fresh_grpcio_connection_is_answered(
    server: ServerThread, size: int
) -> None:
    """The server's 1 MiB frames hold from its first byte, not only once the client acks them."""
    for _ in range(3):  # a fresh channel, hence a fresh connection, each time
        infer(server.url, size)


# -- streams and headers -------------------------------------------------------------------------


def test_streams_past_the_limit_are_refused_and_the_connection_lives(server: ServerThread) -> None:
    limit = LIMITS["max_concurrent_streams"]
    with Peer(server.worker.grpc_port) as peer:
        held = [peer.start("ServerLive") for _ in range(limit)]  # open, no message yet: held
        extra = [peer.start("ServerLive") for _ in range(3)]
        events = peer.read(lambda es: sum(isinstance(e, h2.events.StreamReset) for e in es) >= 3)
        refused = {e.stream_id: e.error_code for e in events if isinstance(e, h2.events.StreamReset)}
        assert refused == {s: ErrorCodes.REFUSED_STREAM for s in extra}
        for stream_id in held:
            peer.h2.send_data(stream_id, framed(b""), end_stream=True)
        peer.flush()
        events = peer.read(lambda es: all(any(_ends(e, s) for e in es) for s in held))
        assert all(_status(events, s).get("grpc-status") == "0" for s in held)
        assert peer.call("ServerLive", framed(b"")).get("grpc-status") == "0"
        assert peer.terminated is None
    assert_serves(server.url)


def test_oversized_request_metadata_is_resource_exhausted_and_the_connection_lives(
    server: ServerThread,
) -> None:
    with Peer(server.worker.grpc_port) as peer:
        answer = peer.call("ServerLive", framed(b""), extra=[("x-big", "v" * 5000)])
        assert answer["grpc-status"] == "8", answer
        assert "server.max_header_list_bytes" in answer["grpc-message"]
        assert peer.call("ServerLive", framed(b"")).get("grpc-status") == "0"
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(SERVICE + "ServerLive")(b"", metadata=[("x-big", "v" * 5000)])  # grpcio
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_serves(server.url)


def test_a_header_block_that_never_ends_gets_goaway_enhance_your_calm(server: ServerThread) -> None:
    """CONTINUATION frames may not pile up header bytes without END_HEADERS."""
    with Peer(server.worker.grpc_port) as peer:
        peer.read(lambda es: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in es))
        first = HeadersFrame(1, data=b"\x00" * 4000)  # no END_HEADERS
        frames = [first.serialize()] + [
            ContinuationFrame(1, data=b"\x00" * 4000).serialize() for _ in range(8)
        ]
        try:
            peer.sock.sendall(b"".join(frames))
        except OSError:
            pass
        assert peer.goaway().error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert_serves(server.url)


# -- timeouts and connections --------------------------------------------------------------------


def test_a_socket_that_never_sends_the_preface_is_closed(server: ServerThread) -> None:
    with Peer(server.worker.grpc_port, handshake=False) as peer:
        started = time.monotonic()
        assert peer.ended(timeout=5)
        assert time.monotonic() - started < 3
    assert_serves(server.url)


@pytest.mark.parametrize(
    "payload", [b"\x17" * 1024, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"], ids=["garbage", "http1"]
)
def test_a_fatal_preface_error_gets_goaway_and_is_closed_at_once(
    server: ServerThread, payload: bytes
) -> None:
    """The connection stayed open for the GOAWAY grace (2 s) after the error, with no call to finish."""
    with socket.create_connection(("127.0.0.1", server.worker.grpc_port), timeout=10) as sock:
        sock.sendall(payload)
        started, data = time.monotonic(), b""
        while chunk := sock.recv(65536):
            data += chunk
        assert time.monotonic() - started < 1.0
    assert data  # our preface and the GOAWAY h2 prepared
    assert_serves(server.url)


def test_an_idle_connection_gets_goaway_and_is_closed(server: ServerThread) -> None:
    with Peer(server.worker.grpc_port) as peer:
        assert peer.call("ServerLive", framed(b"")).get("grpc-status") == "0"
        started = time.monotonic()
        assert peer.goaway(timeout=5).error_code == ErrorCodes.NO_ERROR
        assert 0.9 < time.monotonic() - started < 3.5  # one to two idle_timeout_s
    assert_serves(server.url)


def test_a_peer_that_accepts_no_reply_data_gets_goaway_enhance_your_calm(server: ServerThread) -> None:
    """A reply held by a shut flow-control window is not held for ever."""
    shut = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    with Peer(server.worker.grpc_port, settings=shut) as peer:
        stream_id = peer.start("ServerLive", end=False)
        peer.h2.send_data(stream_id, framed(b""), end_stream=True)
        peer.flush()
        started = time.monotonic()
        goaway = peer.goaway(timeout=5)
        assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        assert b"accepted no data" in goaway.additional_data
        assert time.monotonic() - started < 3.5  # within two idle_timeout_s
    assert_serves(server.url)


def test_connections_past_the_cap_get_goaway_and_serving_goes_on(server: ServerThread) -> None:
    if server.config.server.frontends:
        pytest.skip(
            "one-way: server.max_connections bounds the descriptors of the process that holds the "
            "connections, so each frontend applies it to its own (docs/frontends.md), and the "
            "kernel's hash decides which of cap + 1 connections reach which"
        )
    cap = LIMITS["max_connections"]
    peers: list[Peer] = []
    try:
        for _ in range(cap + 1):  # (other tests' connections may still be winding down)
            peers.append(Peer(server.worker.grpc_port))
        answers = [peer.call("ServerLive", framed(b"")).get("grpc-status") for peer in peers]
        admitted = [peer for peer, answer in zip(peers, answers, strict=True) if answer == "0"]
        refused = [peer for peer in peers if peer not in admitted]
        assert cap - 2 <= len(admitted) <= cap and refused, answers
        for peer in refused:
            assert peer.terminated is not None and peer.terminated.error_code == ErrorCodes.NO_ERROR
            assert b"server.max_connections" in peer.terminated.additional_data
            assert peer.ended(timeout=3)
        assert admitted[0].call("ServerLive", framed(b"")).get("grpc-status") == "0"  # the held serve
    finally:
        for peer in peers:
            peer.sock.close()
    deadline = time.monotonic() + 5
    while True:  # the server notices the closed connections at its next loop turn
        try:
            assert_serves(server.url, timeout=2)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)


# -- floods ----------------------------------------------------------------------------------------


def test_a_stream_reset_flood_gets_goaway_enhance_your_calm(server: ServerThread) -> None:
    with Peer(server.worker.grpc_port) as peer:
        for _ in range(LIMITS["stream_reset_burst"] + 100):
            stream_id = peer.start("ServerLive")
            peer.h2.reset_stream(stream_id, ErrorCodes.CANCEL)
            try:
                peer.flush()
            except OSError:
                break
        assert peer.goaway().error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert_serves(server.url)


@pytest.mark.parametrize(
    "frame", [PingFrame(0, opaque_data=b"12345678"), SettingsFrame(0)], ids=["ping", "settings"]
)
def test_a_control_frame_flood_from_a_peer_that_never_reads_is_cut_off(
    server: ServerThread, frame: Any
) -> None:
    """The acks h2 queues for a peer that does not read are bounded: GOAWAY and close."""
    batch = frame.serialize() * 4096  # 68 KiB of frames, each answered by an ack
    with Peer(server.worker.grpc_port, receive_buffer=4096) as peer:
        peer.start("ServerLive")  # a call held open: the connection is not idle
        for _ in range(300):  # 20 MB, not a byte read: a few MB of acks fill the socket buffers
            try:
                peer.sock.sendall(batch)
            except OSError:
                break
        code, reason = peer.raw_goaway()
        assert code == ErrorCodes.ENHANCE_YOUR_CALM
        assert b"server.max_send_backlog_bytes" in reason
        if frame.type == PingFrame.type:  # (once is enough: the grace costs 2 s)
            assert peer.ended()  # dropped after the grace, though this peer never closes
    assert_serves(server.url)


# -- statuses --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rpc", "body"),
    [
        ("ModelInfer", b"\xff\xff\xff\xff"),  # upb: a truncated tag
        ("ModelMetadata", b"\x0a\x02\xff\xfe"),  # betterproto2: a name that is not UTF-8
        ("ModelReady", b"\x0a\x02\xff\xfe"),
    ],
)
def test_a_body_that_does_not_decode_is_invalid_argument_naming_the_rpc(
    server: ServerThread, rpc: str, body: bytes
) -> None:
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(SERVICE + rpc)(body, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{rpc}: the request body does not decode")
    assert_serves(server.url)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (None, "the request has no message"),
        (framed(b"") + framed(b""), "carries a second message"),
        # a prefix declaring 1 GiB - 1 with a short body and END_STREAM: grpclib asserted (UNKNOWN)
        (
            b"\x00" + struct.pack(">I", (1 << 30) - 1) + b"abc",
            "the request ended before the whole 1073741823-byte message its prefix declares arrived",
        ),
        (b"\x00\x00\x00", "the request ended before the whole 5-byte message prefix arrived"),
    ],
    ids=["none", "two", "short", "short-prefix"],
)
def test_a_unary_call_with_other_than_one_message_is_invalid_argument(
    server: ServerThread, body: bytes | None, says: str
) -> None:
    with Peer(server.worker.grpc_port) as peer:
        answer = peer.call("ServerLive", body)
        assert answer.get("grpc-status") == "3", answer
        assert says in answer["grpc-message"]
        assert peer.call("ServerLive", framed(b"")).get("grpc-status") == "0"
    assert_serves(server.url)


def test_a_compressed_message_is_still_unimplemented(server: ServerThread) -> None:
    with Peer(server.worker.grpc_port) as peer:
        answer = peer.call("ServerLive", struct.pack(">?I", True, 0))
        assert answer.get("grpc-status") == "12", answer
    assert_serves(server.url)


# -- memory (a server in a subprocess, measured from outside) --------------------------------------


@pytest.fixture(scope="module", name="lean")
def _lean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`hloserve serve` of the MLP alone, with small receive budgets and no reset limit."""
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    env = {
        "HLOSERVE_SERVER_MAX_RECEIVING_BYTES_PER_CONNECTION": str(64 * MiB),
        "HLOSERVE_SERVER_MAX_RECEIVING_BYTES": str(100 * MiB),
        "HLOSERVE_SERVER_STREAM_RESET_BURST": "1000000",
    }
    with start_worker(process="subprocess", repository=repository, env=env) as process:
        yield process


def settled_rss(pid: int, below: int, timeout: float = 5) -> int:
    """The process's RSS once it is under `below`, or its last value after `timeout`."""
    deadline = time.monotonic() + timeout
    while (rss := rss_bytes(pid)) >= below and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


def test_cancelled_streams_are_released_at_once(lean: Any) -> None:
    """Streams opened and cancelled by the thousand leave nothing behind (grpclib kept each one
    reset before its handler started: +70 MiB per 10,000, for the connection's life)."""

    def open_and_cancel(peer: Peer, streams: int) -> None:
        for _ in range(streams // 500):
            for _ in range(500):
                peer.h2.reset_stream(peer.start("ServerLive"), ErrorCodes.CANCEL)
            peer.flush()
            peer.read(lambda _: False, timeout=0.02)
        assert peer.call("ServerLive", framed(b"")).get("grpc-status") == "0"  # all processed

    with Peer(lean.grpc_port) as peer:
        for _ in range(2):  # the first rounds grow the heap to its working size (pools, dicts)
            open_and_cancel(peer, 5000)
        before = rss_bytes(lean.pid)
        for _ in range(2):  # leaking, these would add about 70 MiB
            open_and_cancel(peer, 5000)
        grown = settled_rss(lean.pid, before + 16 * MiB) - before
        assert grown < 16 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"
        assert peer.terminated is None
    assert_serves(lean.url)


def send_partial(peer: Peer, rpc: str, length: int, sent: int) -> int:
    """Start a call announcing a `length`-byte message and send `sent` bytes of it."""
    stream_id = peer.start(rpc)
    prefix = struct.pack(">?I", False, length)
    peer.h2.send_data(stream_id, prefix)
    chunk = b"\x00" * peer.h2.max_outbound_frame_size
    left = sent
    while left:
        window = min(peer.h2.local_flow_control_window(stream_id), left, len(chunk))
        if window <= 0:
            peer.flush()
            peer.read(lambda es: any(isinstance(e, h2.events.WindowUpdated) for e in es), timeout=5)
            continue
        peer.h2.send_data(stream_id, chunk[:window])
        left -= window
    peer.flush()
    return stream_id


def test_incomplete_messages_are_bounded_and_freed_when_the_client_leaves(lean: Any) -> None:
    before = rss_bytes(lean.pid)
    with Peer(lean.grpc_port) as peer, Peer(lean.grpc_port) as other, Peer(lean.grpc_port) as third_peer:
        send_partial(peer, "ModelInfer", 40 * MiB, 30 * MiB)
        over = send_partial(peer, "ModelInfer", 40 * MiB, 0)  # 80 MiB > 64 MiB on one connection
        answer = _status(peer.read(lambda es: any(_ends(e, over) for e in es)), over)
        assert answer.get("grpc-status") == "8", answer
        assert "server.max_receiving_bytes_per_connection" in answer["grpc-message"]
        send_partial(other, "ModelInfer", 40 * MiB, 30 * MiB)
        third = send_partial(third_peer, "ModelInfer", 30 * MiB, 0)  # 110 MiB > 100 MiB on the server
        answer = _status(third_peer.read(lambda es: any(_ends(e, third) for e in es)), third)
        assert answer.get("grpc-status") == "14", answer
        assert "server.max_receiving_bytes" in answer["grpc-message"]
        held = rss_bytes(lean.pid) - before
        assert held > 40 * MiB  # the two partial messages are in memory now ...
    grown = settled_rss(lean.pid, before + 16 * MiB) - before  # ... and not once their clients left
    assert grown < 16 * MiB, f"RSS still {grown / MiB:.1f} MiB above (held {held / MiB:.0f} MiB)"
    assert_serves(lean.url)


# -- descriptors -----------------------------------------------------------------------------------


@contextmanager
def nofile(soft: int) -> Iterator[None]:
    """This process's descriptor limit lowered while a child is started, which inherits it
    (preexec_fn would fork a process running JAX's threads)."""
    previous = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, previous)


@pytest.mark.slow
@pytest.mark.parametrize("max_connections", [None, 1000], ids=["default-cap", "cap-above-the-limit"])
def test_running_out_of_descriptors_refuses_connections_and_keeps_serving(
    tmp_path: Path, max_connections: int | None
) -> None:
    """At RLIMIT_NOFILE 256, 300 connections: the default cap refuses those past it; a cap set
    above the limit leaves accept() failing, which pauses accepting instead of killing the worker."""
    repository = tmp_path / "repository"
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    env = (  # the process's budget too (it would refuse first)
        {
            "HLOSERVE_SERVER_MAX_CONNECTIONS": str(max_connections),
            "HLOSERVE_SERVER_MAX_OPEN_CONNECTIONS": str(max_connections),
        }
        if max_connections
        else {}
    )
    with ExitStack() as stack:
        with nofile(256):
            process = stack.enter_context(start_worker(process="subprocess", repository=repository, env=env))
        existing = stack.enter_context(Peer(process.grpc_port))
        assert existing.call("ServerLive", framed(b"")).get("grpc-status") == "0"
        flood = []
        try:
            for _ in range(300):
                flood.append(Peer(process.grpc_port))
            time.sleep(1)
            assert process.process.poll() is None
            if max_connections is None:  # the cap is 256 - 128: the rest get GOAWAY and are closed
                deadline = time.monotonic() + 10  # a loaded machine may take a while to refuse all
                while True:
                    refused = sum(p.ended(timeout=0.01) and p.terminated is not None for p in flood)
                    if refused >= 300 - 127 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert refused >= 300 - 127, refused
            else:  # accept() runs out of descriptors: the rest wait in the listen backlog
                assert "cannot accept a connection" in process.log.read_text()
            assert existing.call("ServerLive", framed(b"")).get("grpc-status") == "0"
        finally:
            for peer in flood:
                peer.sock.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert_serves(process.url, timeout=2)
                break
            except Exception:
                assert time.monotonic() < deadline and process.process.poll() is None
                time.sleep(0.2)
        assert process.process.poll() is None


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MAX_CONCURRENT_STREAMS", "0"),
        ("MAX_CONNECTIONS", "0"),
        ("MAX_HEADER_LIST_BYTES", "100"),
        ("HANDSHAKE_TIMEOUT_S", "0"),
        ("IDLE_TIMEOUT_S", "-1"),
        ("MAX_RECEIVING_BYTES_PER_CONNECTION", str(4 << 30)),  # more than the server-wide budget
        ("STREAM_RESET_BURST", "0"),
        ("STREAM_RESET_RATE", "0"),
        ("MAX_SEND_BACKLOG_BYTES", "10"),
    ],
)
def test_a_bad_transport_bound_is_refused_at_start_naming_the_key(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"server.{variable.lower()}"):
        load_config(environ={f"HLOSERVE_SERVER_{variable}": value})


def test_the_default_connection_cap_leaves_descriptors_for_the_worker() -> None:
    with nofile(256):
        assert default_max_connections() == 128
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard >= 10_128:
        with nofile(hard):
            assert default_max_connections() == 10_000  # memory, not descriptors, bounds it there
    assert (
        TransportLimits.from_config(load_config(environ={}).server).max_connections
        == default_max_connections()
    )
