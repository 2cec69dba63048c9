"""gRPC message compression (gzip, deflate) as Triton clients use it, on a real worker."""

from __future__ import annotations

import gzip
import socket
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import ServerThread, make_config
from export_examples import reference
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

LIMIT = 1 << 20
SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module", name="small")
def _small() -> Iterator[ServerThread]:
    """A worker whose messages are limited to 1 MiB."""
    server = ServerThread(make_config(max_message_bytes=LIMIT)).start()
    yield server
    server.stop()


def _infer(url: str, compression: str | None) -> np.ndarray:
    x = np.random.default_rng(1).random((3, 16), dtype=np.float32)
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [3, 16], "FP32")
        tensor.set_data_from_numpy(x)
        y = client.infer("mlp", [tensor], compression_algorithm=compression).as_numpy("OUTPUT0")
    finally:
        client.close()
    np.testing.assert_allclose(y, reference("mlp", x), rtol=1e-5, atol=1e-6)
    return y


def _call(
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
        for _ in range(1000):  # bounded: a reply is a few frames
            data = sock.recv(1 << 20)
            assert data, "connection closed before the call ended"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    found.update(dict(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    return found, body
                elif isinstance(event, h2.events.StreamReset):  # no status: the reset's code
                    return {**found, "reset": str(event.error_code)}, body
            sock.sendall(conn.data_to_send())
        raise AssertionError("the call never ended")


def _frame(message: bytes, compressed: bool) -> bytes:
    return struct.pack(">?I", compressed, len(message)) + message


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_calls_are_served(small: ServerThread, compression: str) -> None:
    _infer(small.url, compression)
    _infer(small.url, None)


@pytest.mark.parametrize(
    ("encoding", "pack"),
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
)
def test_a_compressed_request_gets_a_compressed_reply(small: ServerThread, encoding: str, pack: Any) -> None:
    request = service_pb2.ServerLiveRequest().SerializeToString()
    headers = [("grpc-encoding", encoding), ("grpc-accept-encoding", f"identity,{encoding}")]
    answer, body = _call(small.worker.grpc_port, "ServerLive", _frame(pack(request), True), headers)
    assert (answer["grpc-status"], answer["grpc-encoding"]) == ("0", encoding)
    assert body[0] == 1
    reply = service_pb2.ServerLiveResponse.FromString(
        zlib.decompress(body[5:], 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    )
    assert reply.live
    plain, body = _call(small.worker.grpc_port, "ServerLive", _frame(request, False), [])
    assert plain["grpc-status"] == "0" and "grpc-encoding" not in plain and body[0] == 0
    assert "gzip" in plain["grpc-accept-encoding"]


@pytest.mark.parametrize(
    ("message", "headers", "status", "says"),
    [
        (
            gzip.compress(b"\0" * (LIMIT + 1)),
            [("grpc-encoding", "gzip")],
            "8",
            "inflates past server.max_message_bytes",
        ),
        (
            zlib.compress(b"\0" * (4 * LIMIT)),
            [("grpc-encoding", "deflate")],
            "8",
            "inflates past server.max_message_bytes",
        ),
        (b"not gzip at all", [("grpc-encoding", "gzip")], "3", "the gzip message does not inflate"),
        (
            gzip.compress(b"\x0a\x03mlp")[:-6],
            [("grpc-encoding", "gzip")],
            "3",
            "the gzip message is truncated",
        ),
        (
            b"\0",
            [("grpc-encoding", "br")],
            "12",
            "grpc-encoding 'br'; hloserve accepts identity,deflate,gzip",
        ),
    ],
    ids=["gzip bomb", "deflate bomb", "not gzip", "truncated", "unknown encoding"],
)
def test_a_bad_compressed_message_is_refused(
    small: ServerThread, message: bytes, headers: list[tuple[str, str]], status: str, says: str
) -> None:
    """A bomb is refused once the inflated bytes pass the limit (never held whole)."""
    answer, _ = _call(small.worker.grpc_port, "ModelReady", _frame(message, True), headers)
    assert answer["grpc-status"] == status, answer
    assert says in answer["grpc-message"].replace("%20", " ").replace("%27", "'"), answer
    _infer(small.url, "gzip")


def test_compressed_inference_of_a_large_request_is_refused_by_its_inflated_size(small: ServerThread) -> None:
    """tritonclient compresses a request of 2 MiB of zeros to kilobytes: the inflated size counts."""
    client = grpcclient.InferenceServerClient(small.url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [32768, 16], "FP32")
        tensor.set_data_from_numpy(np.zeros((32768, 16), np.float32))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("mlp", [tensor], compression_algorithm="gzip")
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    finally:
        client.close()
    _infer(small.url, None)
