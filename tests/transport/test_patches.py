"""The patch layer (`hloserve._transport.grpclib_patches`, `_h2_limits`, `_hpack_patches`,
`_trio_asyncio_patches`): each checks the libraries it was written for and says what to do when
they differ; it changes hloserve's own server and client only, never grpclib for everyone else;
and what it adds works: a message over `server.max_message_bytes` refused from its prefix, a
1 MiB frame in a connection's first request, graceful shutdown finishing a call in flight and
then sending GOAWAY, a unary reply in one socket write, DATA frames traced without their payload.

The other behaviours are tested where their subject is: large first requests from grpcio and
the receive budgets in `tests/hostile/test_transport.py`, the trio-asyncio batch in
`tests/transport/test_trio_asyncio_patches.py`, the linear Huffman encoder in
`tests/hostile/test_strings.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpclib.client
import grpclib.const
import grpclib.protocol
import grpclib.server
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack.huffman
import pytest
import trio
import trio_asyncio
import trio_asyncio._base
from h2.config import DummyLogger, H2Configuration
from h2.errors import ErrorCodes
from support.servers import ServerThread
from tritonclient.grpc import service_pb2

from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve._transport import h11_strict as _h11_strict
from hloserve._transport import hpack_patches as _hpack_patches
from hloserve._transport import hypercorn_connection as _hypercorn_connection
from hloserve._transport import trio_asyncio_patches as _trio_asyncio_patches
from hloserve._transport.grpclib_patches import GracefulServer, GuardedStream, send_reply
from hloserve._transport.h2_limits import LimitedH2Connection, TransportLimits
from hloserve._transport.requirements import PatchMismatch, check

MiB = 1 << 20
Request, Reply = service_pb2.ServerLiveRequest, service_pb2.ServerLiveResponse
LIVE = Reply(live=True)
Method = Callable[[Any], Awaitable[None]]
T = TypeVar("T")


# -- the checks ------------------------------------------------------------------------------------


def test_the_installed_libraries_pass_every_check() -> None:
    every = (
        *_grpclib_patches.REQUIRES,
        _hpack_patches.REQUIRES,
        _trio_asyncio_patches.REQUIRES,
        _hypercorn_connection.REQUIRES,
        _h11_strict.REQUIRES,
    )
    check(*every)
    assert {r.distribution for r in every} == {
        "h11",
        "grpclib",
        "h2",
        "hyperframe",
        "hpack",
        "trio-asyncio",
        "hypercorn",
    }


def test_another_version_stops_start_up_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "hloserve._transport.requirements.version", lambda name: "0.5.0" if name == "grpclib" else "?"
    )
    with pytest.raises(PatchMismatch) as raised:
        _grpclib_patches.install.__wrapped__()  # what serve() and GracefulServer call, uncached
    assert str(raised.value).startswith(
        "hloserve._transport.grpclib_patches was written for grpclib 0.4.9: version 0.5.0 is installed, "
        "0.4.9 expected. Install grpclib==0.4.9 (as pyproject pins it), or update "
        "hloserve._transport.grpclib_patches for the version installed and pin that"
    ), raised.value


def test_a_missing_attribute_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(grpclib.protocol.EventsProcessor, "process_stream_reset")
    with pytest.raises(PatchMismatch) as raised:
        check(*_grpclib_patches.REQUIRES)
    assert "grpclib.protocol.EventsProcessor.process_stream_reset is missing" in str(raised.value)
    assert raised.value.distribution == "grpclib"


def test_an_instance_attribute_no_longer_assigned_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Buffer._acked` exists only on instances: the check finds its assignment in the class."""

    def init(self: Any, ack_callback: Any) -> None:
        self.ack = ack_callback

    monkeypatch.setattr(grpclib.protocol.Buffer, "__init__", init)
    with pytest.raises(PatchMismatch, match=r"grpclib\.protocol\.Buffer\._acked is missing"):
        check(*_grpclib_patches.REQUIRES)


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    async def one(self: Any) -> None:
        pass

    monkeypatch.setattr(trio_asyncio._base.BaseTrioEventLoop, "_main_loop_one", one)
    with pytest.raises(PatchMismatch) as raised:
        check(_trio_asyncio_patches.REQUIRES)
    assert "trio_asyncio._base.BaseTrioEventLoop._main_loop_one takes (self), not (self, no_wait)" in str(
        raised.value
    )
    assert "Install trio-asyncio==0.16.0" in str(raised.value)


# -- scope -----------------------------------------------------------------------------------------


def test_stock_grpclib_beside_a_running_worker_is_untouched(server: ServerThread) -> None:
    """With hloserve serving in this process, a plain grpclib server and channel are grpclib's:
    16 KiB frames both ways, grpclib's own stream and receive path, hpack's own encoder."""
    assert server.worker.grpc_port
    assert grpclib.server.Stream.recv_message.__module__ == "grpclib.server"
    assert grpclib.protocol.H2Connection is h2.connection.H2Connection
    assert "repr" not in vars(h2.connection)
    assert hpack.huffman.HuffmanEncoder.encode.__module__ == "hpack.huffman"
    streams: list[type] = []

    async def say(stream: Any) -> None:
        streams.append(type(stream))
        await stream.recv_message()
        await stream.send_message(LIVE)

    async def main() -> tuple[int, int]:
        stock = grpclib.server.Server([_Service(say=say)])
        await stock.start("127.0.0.1", 0)
        channel = grpclib.client.Channel("127.0.0.1", stock._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        try:
            method = grpclib.client.UnaryUnaryMethod(channel, "/test.Test/say", Request, Reply)
            assert await method(Request()) == LIVE
            h2_connection = (await channel.__connect__()).connection._connection
            return h2_connection.local_settings.max_frame_size, h2_connection.remote_settings.max_frame_size
        finally:
            channel.close()
            stock.close()
            await stock.wait_closed()

    assert _run(main) == (16384, 16384)
    assert streams == [grpclib.server.Stream]


def test_hloserve_s_server_gives_its_methods_guarded_streams() -> None:
    """The other side of scope: `GracefulServer`'s calls get `GuardedStream`s."""
    streams: list[type] = []

    async def say(stream: Any) -> None:
        streams.append(type(stream))
        await stream.recv_message()
        await send_reply(stream, LIVE)

    async def main() -> dict[str, str]:
        server = GracefulServer([_Service(say=say)])
        await server.start("127.0.0.1", 0)
        try:
            async with _AsyncClient(server.port) as client:
                return await asyncio.wait_for(client.call("say"), 5)
        finally:
            await server.shutdown(grace=0)

    assert _run(main).get("grpc-status") == "0"
    assert streams == [GuardedStream]


def test_hloserve_s_connections_log_data_frames_without_their_payload() -> None:
    """h2 builds the repr of every frame it receives for its trace log; on hloserve's
    connections a DATA frame's is a line, not a hexlified copy of the payload."""
    traced: list[str] = []

    class Logger(DummyLogger):
        def trace(self, message: str, *args: Any) -> None:
            traced.append(message % args)

    server = LimitedH2Connection(H2Configuration(client_side=False, logger=Logger()), TransportLimits())
    server.initiate_connection()
    client = h2.connection.H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.receive_data(server.data_to_send())  # the server's 1 MiB frames
    client.send_headers(1, [(":path", "/test.Test/say"), *_HEADERS])
    client.send_data(1, bytes(60_000), end_stream=True)  # one frame: 60,000 > 16 KiB
    events = server.receive_data(client.data_to_send())
    assert sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived)) == 60_000
    (data,) = [t for t in traced if t.startswith("Received frame: DataFrame")]
    assert data == "Received frame: DataFrame(stream_id=1, 60000 bytes)"


def _connected() -> tuple[LimitedH2Connection, h2.connection.H2Connection]:
    server = LimitedH2Connection(H2Configuration(client_side=False), TransportLimits())
    server.initiate_connection()
    client = h2.connection.H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.receive_data(server.data_to_send())  # the server's 1 MiB frames
    return server, client


def test_data_frames_split_across_reads_and_padded_arrive_whole() -> None:
    """hloserve reads a DATA frame's payload straight out of the receive buffer: frames cut at
    every byte boundary, several in one read and padded ones arrive as the client sent them."""
    server, client = _connected()
    client.send_headers(1, [(":path", "/test.Test/say"), *_HEADERS])
    payloads = [bytes(range(256)) * 100, b"x" * 1000, os.urandom(30_000)]  # within the 64 KiB window
    client.send_data(1, payloads[0])
    client.send_data(1, payloads[1], pad_length=17)
    client.send_data(1, payloads[2], end_stream=True)
    wire = client.data_to_send()
    received: list[bytes] = []
    for start in range(0, len(wire), 4099):  # reads that end inside headers and payloads
        events = server.receive_data(wire[start : start + 4099])
        received += [e.data for e in events if isinstance(e, h2.events.DataReceived)]
    assert b"".join(received) == b"".join(payloads)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (struct.pack(">I", 3)[1:] + b"\x00\x00" + struct.pack(">I", 0) + b"abc", "invalid header"),
        (struct.pack(">I", 3)[1:] + b"\x00\x08" + struct.pack(">I", 1) + b"\x05ab", "Padding is too long"),
    ],
    ids=["on stream 0", "padding past its end"],
)
def test_a_malformed_data_frame_is_a_protocol_error(frame: bytes, expected: str) -> None:
    """What h2 answers for a DATA frame it cannot take, through hloserve's payload path too."""
    server, client = _connected()
    client.send_headers(1, [(":path", "/test.Test/say"), *_HEADERS])
    server.receive_data(client.data_to_send())
    with pytest.raises(h2.exceptions.ProtocolError) as raised:
        server.receive_data(frame)
    assert expected in str(raised.value) or expected in str(raised.value.__cause__)


def test_a_data_frame_inside_a_header_block_is_a_protocol_error() -> None:
    """A header block waits for its CONTINUATION: a DATA frame there ends the connection."""
    server, client = _connected()
    server.receive_data(client.data_to_send())
    headers = struct.pack(">I", 1)[1:] + b"\x01\x00" + struct.pack(">I", 1) + b"\x82"  # no END_HEADERS
    data = struct.pack(">I", 1)[1:] + b"\x00\x00" + struct.pack(">I", 1) + b"a"
    with pytest.raises(h2.exceptions.ProtocolError, match="header block"):
        server.receive_data(headers + data)


# -- what the patches add --------------------------------------------------------------------------


def test_a_message_over_max_message_bytes_is_refused_from_its_prefix(server: ServerThread) -> None:
    """The 5-byte prefix announcing 4 GiB is answered RESOURCE_EXHAUSTED at once: nothing of the
    body was sent, so nothing was buffered (grpclib would wait for 4 GiB), and the process
    holds no more memory after; a good call follows on the same connection."""
    limit = server.config.server.max_message_bytes
    before = _rss()
    with _RawClient(server.worker.grpc_port) as client:
        stream_id = client.start("ModelInfer")
        client.h2.send_data(stream_id, struct.pack(">?I", False, 0xFFFFFFFF))
        client.flush()
        answer = client.answer(stream_id)
        assert answer.get("grpc-status") == "8", answer
        assert answer["grpc-message"] == (
            f"request of {0xFFFFFFFF} bytes exceeds server.max_message_bytes ({limit}); "
            "send large tensors through system shared memory or raise the limit"
        )
        good = client.start("ServerLive")
        client.h2.send_data(good, struct.pack(">?I", False, 0), end_stream=True)
        client.flush()
        assert client.answer(good).get("grpc-status") == "0"
    assert _rss() - before < 64 * MiB


def test_a_1_mib_frame_in_the_write_that_acks_the_settings_is_accepted(server: ServerThread) -> None:
    """A client's first request, in one 1 MiB DATA frame sent with its ack of the server's
    SETTINGS: the server's advertised frame size holds before it has seen that ack (h2 alone
    would check the frame against 16 KiB, the size in force when the read began)."""
    with _RawClient(server.worker.grpc_port) as client:
        client.read_settings()  # h2 queues the ack; it goes out with the request
        assert client.h2.max_outbound_frame_size == MiB
        stream_id = client.start("ModelInfer", flush=False)
        client.h2.send_data(stream_id, _framed(_infer_request(MiB - 5)), end_stream=True)  # one frame
        client.flush()
        answer = client.answer(stream_id)
    assert answer.get("grpc-status") == "0", answer


def test_shutdown_finishes_the_call_in_flight_then_sends_goaway() -> None:
    """grpclib's close() would cancel the call and leave the client to find a dead socket."""

    async def main() -> tuple[dict[str, str], dict[str, str], list[Any], bool]:
        entered, release = asyncio.Event(), asyncio.Event()

        async def hold(stream: Any) -> None:
            await stream.recv_message()
            entered.set()
            await release.wait()
            await send_reply(stream, LIVE)

        server = GracefulServer([_Service(hold=hold)])
        await server.start("127.0.0.1", 0)
        async with _AsyncClient(server.port) as client:
            held = asyncio.create_task(client.call("hold"))
            await asyncio.wait_for(entered.wait(), 5)
            shutdown = asyncio.create_task(server.shutdown(grace=10))
            await asyncio.sleep(0.2)
            waited = not shutdown.done()
            refused = await asyncio.wait_for(client.call("hold"), 5)  # a new call while draining
            release.set()
            await asyncio.wait_for(shutdown, 5)
            answered = await asyncio.wait_for(held, 5)
            await asyncio.wait_for(client.closed.wait(), 5)
            return answered, refused, client.events, waited

    answered, refused, events, waited = _run(main)
    assert waited, "shutdown did not wait for the call in flight"
    assert answered.get("grpc-status") == "0" and answered["data"] == _framed(
        LIVE.SerializeToString()
    ).decode("latin-1")
    assert refused.get("grpc-status") == "14" and refused["grpc-message"] == "server is shutting down"
    (goaway,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.error_code == ErrorCodes.NO_ERROR
    ended = [i for i, e in enumerate(events) if isinstance(e, h2.events.StreamEnded) and e.stream_id == 1]
    assert ended and ended[0] < events.index(goaway), "GOAWAY came before the call's answer"


def test_a_small_unary_reply_is_one_socket_write() -> None:
    """`send_reply` writes headers, message and trailers at once; grpclib's `send_message` and
    its trailers take a write each (asserted too, so the count is known to see them)."""

    async def corked(stream: Any) -> None:
        await stream.recv_message()
        await send_reply(stream, LIVE)

    async def plain(stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(LIVE)

    async def main() -> dict[str, list[list[tuple[int, int]]]]:
        server = GracefulServer([_Service(corked=corked, plain=plain)])
        await server.start("127.0.0.1", 0)
        try:
            async with _AsyncClient(server.port) as client:
                (protocol,) = await _connections(server)
                writes = _Writes(protocol.connection._transport)
                protocol.connection._transport = writes
                found = {}
                for name in ("corked", "plain"):
                    answer = await asyncio.wait_for(client.call(name), 5)
                    assert answer.get("grpc-status") == "0", answer
                    stream_id = client.last_stream_id
                    found[name] = [
                        fs for fs in map(_frames, writes.data) if any(s == stream_id for _, _, s in fs)
                    ]
                    writes.data.clear()
                return {name: [[(t, f) for t, f, _ in fs] for fs in w] for name, w in found.items()}
        finally:
            await server.shutdown(grace=0)

    found = _run(main)
    headers, data, end_stream = 0x1, 0x0, 0x1
    assert len(found["corked"]) == 1, found["corked"]
    (frames,) = found["corked"]
    assert [t for t, _ in frames] == [headers, data, headers] and frames[-1][1] & end_stream, frames
    assert len(found["plain"]) >= 2, found["plain"]


# -- helpers ---------------------------------------------------------------------------------------


class _Service:
    """A grpclib service of unary methods taking a ServerLiveRequest, on `/test.Test/<name>`."""

    def __init__(self, **methods: Method) -> None:
        self.methods = methods

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            f"/test.Test/{name}": grpclib.const.Handler(method, unary, Request, Reply)
            for name, method in self.methods.items()
        }


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """`main` on asyncio inside trio, as the worker runs grpclib."""

    async def run() -> T:
        async with trio_asyncio.open_loop():
            return await trio_asyncio.aio_as_trio(main)()

    return trio.run(run)


def _infer_request(size: int) -> bytes:
    """A good ModelInfer request for the MLP, made exactly `size` bytes by a padding parameter."""
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    assert tensor.name == "INPUT0"
    request.raw_input_contents.append(bytes(64))
    padding = request.parameters["padding"]
    for _ in range(4):  # the varint lengths settle in a step or two
        padding.string_param = "x" * (len(padding.string_param) + size - request.ByteSize())
    assert request.ByteSize() == size
    return request.SerializeToString()


def _framed(message: bytes) -> bytes:
    return struct.pack(">?I", False, len(message)) + message


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    """The (type, flags, stream id) of each HTTP/2 frame in `data`."""
    frames, offset = [], 0
    while offset + 9 <= len(data):
        length = int.from_bytes(data[offset : offset + 3], "big")
        stream_id = int.from_bytes(data[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
        frames.append((data[offset + 3], data[offset + 4], stream_id))
        offset += 9 + length
    return frames


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _connections(server: GracefulServer) -> list[Any]:
    deadline = time.monotonic() + 5
    while not server._protocols:
        assert time.monotonic() < deadline, "no connection"
        await asyncio.sleep(0.01)
    return list(server._protocols)


class _Writes:
    """A transport that records what is written to it, and passes it on."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.data: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.data.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


_HEADERS = [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip


def _answer(events: list[Any], stream_id: int) -> dict[str, str]:
    """A call's response headers and trailers, and its body as `data` (latin-1)."""
    found: dict[str, str] = {}
    body = b""
    for e in events:
        if getattr(e, "stream_id", None) != stream_id:
            continue
        if hasattr(e, "headers"):
            found.update(e.headers)
        if isinstance(e, h2.events.DataReceived):
            body += e.data
    return {**found, "data": body.decode("latin-1")} if body else found


def _ends(events: list[Any], stream_id: int) -> bool:
    return any(
        isinstance(e, h2.events.StreamEnded | h2.events.StreamReset) and e.stream_id == stream_id
        for e in events
    )


class _RawClient:
    """A blocking HTTP/2 client connection to hloserve's KServe service."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.h2.initiate_connection()
        self.events: list[Any] = []
        self.flush()

    def __enter__(self) -> _RawClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def start(self, rpc: str, flush: bool = True) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, [(":path", "/inference.GRPCInferenceService/" + rpc), *_HEADERS])
        if flush:
            self.flush()
        return stream_id

    def read_settings(self, timeout: float = 5) -> None:
        """Read until the server's SETTINGS arrive, sending nothing (not even their ack)."""
        deadline = time.monotonic() + timeout
        while not any(isinstance(e, h2.events.RemoteSettingsChanged) for e in self.events):
            assert time.monotonic() < deadline, "no SETTINGS from the server"
            self.events += self.h2.receive_data(self.sock.recv(1 << 20))

    def answer(self, stream_id: int, timeout: float = 5) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while not _ends(self.events, stream_id):
            assert time.monotonic() < deadline, f"no answer on stream {stream_id}"
            data = self.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            self.events += self.h2.receive_data(data)
            self.flush()
        return _answer(self.events, stream_id)


class _AsyncClient:
    """An asyncio HTTP/2 client connection making unary `/test.Test/` calls, keeping every event
    it receives in order until the server closes the connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.events: list[Any] = []
        self.closed = asyncio.Event()
        self.last_stream_id = 0
        self._changed = asyncio.Event()

    async def __aenter__(self) -> _AsyncClient:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.h2.initiate_connection()
        self.writer.write(self.h2.data_to_send())
        self._reading = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *_: object) -> None:
        self._reading.cancel()
        self.writer.close()

    async def _read(self) -> None:
        while data := await self.reader.read(1 << 20):
            try:
                self.events += self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                break
            self.writer.write(self.h2.data_to_send())
            self._changed.set()
        self.closed.set()
        self._changed.set()

    async def call(self, name: str) -> dict[str, str]:
        stream_id = self.last_stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, [(":path", f"/test.Test/{name}"), *_HEADERS])
        self.h2.send_data(stream_id, _framed(Request().SerializeToString()), end_stream=True)
        self.writer.write(self.h2.data_to_send())
        while not _ends(self.events, stream_id) and not self.closed.is_set():
            self._changed.clear()
            await self._changed.wait()
        return _answer(self.events, stream_id)


def test_a_connection_remembers_a_bounded_number_of_closed_streams() -> None:
    """h2 remembers the last 65,536 closed streams of a connection (~6 MB, issue 38's soak);
    hloserve's remember four times the streams a client may have open."""
    server = LimitedH2Connection(
        H2Configuration(client_side=False), TransportLimits(max_concurrent_streams=3)
    )
    server.initiate_connection()
    client = h2.connection.H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.receive_data(server.data_to_send())
    for stream in range(1, 101, 2):  # 50 requests, each answered
        client.send_headers(stream, [(":path", "/test.Test/say"), *_HEADERS], end_stream=True)
        server.receive_data(client.data_to_send())
        server.send_headers(stream, [(":status", "200")], end_stream=True)
        client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())  # closes the last
    assert len(server._closed_streams) == 12


def test_hloserve_s_channel_remembers_a_bounded_number_of_closed_streams() -> None:
    """`BigFrameChannel` (the node's channel to each worker, `hloserve.client`) lives for hours:
    h2's 65,536 remembered streams grew the node by ~12 MB an hour; it keeps the last 1,024."""

    async def say(stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(LIVE)

    async def main() -> int:
        stock = grpclib.server.Server([_Service(say=say)])
        await stock.start("127.0.0.1", 0)
        port = stock._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        channel = _grpclib_patches.BigFrameChannel("127.0.0.1", port)
        try:
            method = grpclib.client.UnaryUnaryMethod(channel, "/test.Test/say", Request, Reply)
            for _ in range(_grpclib_patches.CLIENT_CLOSED_STREAMS + 100):
                assert await method(Request()) == LIVE
            return len((await channel.__connect__()).connection._connection._closed_streams)
        finally:
            channel.close()
            stock.close()
            await stock.wait_closed()

    assert _run(main) == _grpclib_patches.CLIENT_CLOSED_STREAMS
