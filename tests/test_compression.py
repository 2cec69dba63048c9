"""gRPC message compression (gzip, deflate) as Triton clients use it, on a real worker."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.raw_grpc import frame, raw_call
from support.servers import ServerThread, make_config
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

LIMIT = 1 << 20


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
    answer, body = raw_call(small.worker.grpc_port, "ServerLive", frame(pack(request), True), headers)
    assert (answer["grpc-status"], answer["grpc-encoding"]) == ("0", encoding)
    assert body[0] == 1
    reply = service_pb2.ServerLiveResponse.FromString(
        zlib.decompress(body[5:], 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    )
    assert reply.live
    plain, body = raw_call(small.worker.grpc_port, "ServerLive", frame(request, False), [])
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
    answer, _ = raw_call(small.worker.grpc_port, "ModelReady", frame(message, True), headers)
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
