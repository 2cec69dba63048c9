"""gRPC message compression (gzip, deflate) as Triton clients use it, on a real worker."""

from __future__ import annotations

import gzip
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.numerics import assert_close
from support.raw_grpc import frame, raw_call
from support.servers import ServerThread, make_config, start_worker
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

LIMIT = 1 << 20


@pytest.fixture(scope="module", name="small", params=[0, 2], ids=["frontends0", "frontends2"])
def _small(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker whose messages are limited to 1 MiB (one process, and two frontends)."""
    with start_worker(make_config(max_message_bytes=LIMIT), frontends=request.param) as server:
        yield server


def _infer(url: str, compression: str | None) -> np.ndarray:
    x = np.random.default_rng(1).random((3, 16), dtype=np.float32)
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [3, 16], "FP32")
        tensor.set_data_from_numpy(x)
        y = client.infer("mlp", [tensor], compression_algorithm=compression).as_numpy("OUTPUT0")
    finally:
        client.close()
    assert_close(y, reference("mlp", x))
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


MiB = 1 << 20


@pytest.fixture(name="budgeted", params=[0, 2], ids=["frontends0", "frontends2"])
def _budgeted(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """Messages up to 8 MiB, but 2 MiB of messages being received at once (per connection and
    in all): the budgets, not the message limit, are what a compressed request meets. With
    frontends each applies them to the connections it holds (docs/frontends.md)."""
    config = make_config(
        max_message_bytes=8 * MiB, max_receiving_bytes=2 * MiB, max_receiving_bytes_per_connection=2 * MiB
    )
    with start_worker(config, frontends=request.param) as server:
        yield server


def _mlp_request(rows: int) -> service_pb2.ModelInferRequest:
    """An mlp request of `rows` rows of zeros: 64 bytes a row, all but nothing once gzipped."""
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 16])
    request.raw_input_contents.append(bytes(64 * rows))
    return request


def _grpcio_infer(
    url: str, request: service_pb2.ModelInferRequest, gzip: bool
) -> tuple[grpc.StatusCode, str]:
    """grpcio's ModelInfer, gzip-compressed or not: the status and its message."""
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 16 * MiB)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
        try:
            stub.ModelInfer(request, timeout=60, compression=compression)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_inflated_bytes_count_against_the_connection_s_receiving_budget(budgeted: ServerThread) -> None:
    """3 MiB inflated from a few kilobytes is refused as the same 3 MiB sent plainly is."""
    request = _mlp_request(3 * MiB // 64)
    for gzip_it in (False, True):
        status, details = _grpcio_infer(budgeted.url, request, gzip_it)
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "server.max_receiving_bytes_per_connection" in details
    assert _grpcio_infer(budgeted.url, _mlp_request(MiB // 64), True)[0] == grpc.StatusCode.OK


def test_inflated_bytes_count_against_the_server_s_receiving_budget(budgeted: ServerThread) -> None:
    """With 1.5 MiB of a message being received on another connection, 1 MiB inflated from a
    small gzip message would pass the server's 2 MiB: UNAVAILABLE, served once it is gone.
    With frontends the budget is the holder's frontend's: each try's fresh connection may land on
    the other one, so the loop goes on until one lands beside the holder."""
    request = _mlp_request(MiB // 64)
    with socket.create_connection(("127.0.0.1", budgeted.worker.grpc_port), timeout=10) as holder:
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        peer.send_headers(
            1,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/inference.GRPCInferenceService/ModelInfer"),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        peer.send_data(1, struct.pack(">?I", False, 3 * MiB // 2))  # announced, never sent
        holder.sendall(peer.data_to_send())
        deadline = time.monotonic() + 10
        status, details = grpc.StatusCode.OK, ""
        while time.monotonic() < deadline and status != grpc.StatusCode.UNAVAILABLE:
            time.sleep(0.05)  # until the server holds the announced bytes
            status, details = _grpcio_infer(budgeted.url, request, True)
        assert status == grpc.StatusCode.UNAVAILABLE, details
        assert "server.max_receiving_bytes" in details and "inflating past" in details
    for _ in range(100):  # the holder gone, its bytes are freed
        if _grpcio_infer(budgeted.url, request, True)[0] == grpc.StatusCode.OK:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the compressed request was not served once the budget was free")


def test_a_compressed_request_with_a_large_reply_is_answered_compressed(small: ServerThread) -> None:
    """8192 rows: a request and a reply over what is inflated and compressed on the loop, both
    done in a worker thread, the answer exact."""
    x = np.random.default_rng(2).random((8192, 16), dtype=np.float32)
    client = grpcclient.InferenceServerClient(small.url)
    try:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        y = client.infer("mlp", [tensor], compression_algorithm="gzip").as_numpy("OUTPUT0")
    finally:
        client.close()
    assert_close(y, reference("mlp", x))


PROBE_BOUND_S = 0.1
"""What a large compressed request may cost another client's call."""


_PROBE = """
import sys, time
import tritonclient.grpc as grpcclient
client = grpcclient.InferenceServerClient(sys.argv[1])
assert client.is_server_ready()
print("probing", flush=True)
worst, answers = 0.0, 0
while not sys.stdin.readline().strip() == "stop":
    started = time.perf_counter()
    assert client.is_server_ready()
    worst, answers = max(worst, time.perf_counter() - started), answers + 1
print(worst, answers, flush=True)
"""
"""A good client in a process of its own (the test's own threads would share its interpreter):
it calls ServerReady each time a line arrives, until `stop`, then prints its worst wait."""


@pytest.mark.serial  # a probe client's latency: alone
def test_a_large_compressed_request_costs_others_under_the_bound() -> None:
    """300 MiB of zeros that grpcio gzips to a few hundred kilobytes inflate, up to the limit of
    256 MiB, in a worker thread: a probe client calling ServerReady every 20 ms never waits past
    100 ms. On the loop the inflation held every client for 0.8 s; in one zlib call in a thread,
    0.2 to 0.8 s (the call gathers its output holding the interpreter); 4 MiB at a time, under
    the bound."""
    limit = 256 * MiB
    env = {"HLOSERVE_SERVER_MAX_MESSAGE_BYTES": str(limit), "HLOSERVE_SERVER_HTTP_PORT": "-1"}
    with start_worker(process="subprocess", env=env) as server:
        bomb = _mlp_request(300 * MiB // 64).SerializeToString()
        probe = subprocess.Popen(
            [sys.executable, "-c", _PROBE, server.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert probe.stdin is not None and probe.stdout is not None
        try:
            assert probe.stdout.readline() == "probing\n"
            ticks = threading.Event()

            def tick() -> None:
                assert probe.stdin is not None
                while not ticks.wait(0.02):
                    probe.stdin.write("go\n")
                    probe.stdin.flush()

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
            options = [("grpc.max_send_message_length", 512 * MiB)]
            with grpc.insecure_channel(server.url, options=options) as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
                try:
                    call(bomb, timeout=60, compression=grpc.Compression.Gzip)
                    status, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as e:
                    status, details = e.code(), e.details() or ""
            time.sleep(0.1)  # a few more probes after it
            ticks.set()
            ticker.join(10)
            worst, answers = probe.communicate("stop\n", timeout=30)[0].split()
        finally:
            probe.kill()
            probe.wait()
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "inflates past server.max_message_bytes" in details
        assert int(answers) > 0 and float(worst) < PROBE_BOUND_S, worst
        assert _grpcio_infer(server.url, _mlp_request(4), True)[0] == grpc.StatusCode.OK
