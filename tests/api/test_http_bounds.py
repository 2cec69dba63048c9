"""What a REST client can make the server hold, pushed past each bound with real sockets: the
connection cap, the request head's size, the idle time before a head, the time a body takes, the
bytes of bodies being received, an answer nobody reads; and a client that disconnects while its
request is queued, which withdraws it. After each, the next good request is served and the
server's descriptors come back."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import write_wide
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

from hloserve.config import ModelSettings

pytestmark = pytest.mark.serial  # asserts on timing, or floods the machine

CAP = 4
MLP_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
).encode()
WIDE = 1 << 20  # floats per row of the `wide` model: a 4 MiB answer


@pytest.fixture(scope="module", name="bounded")
def _bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A worker with small REST bounds, an MLP queue that holds a lone row for 500 ms, and a
    model with a 4 MiB answer."""
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    write_wide(repository / "wide", WIDE)
    config = make_config(
        repository,
        http_max_connections=CAP,
        http_max_header_bytes=4096,
        http_idle_timeout_s=2.0,
        http_body_timeout_s=0.5,
        max_receiving_bytes=8 << 20,
        max_receiving_bytes_per_connection=8 << 20,
        http_max_inflation_ratio=100_000,
        scheduler={"models": {"mlp": ModelSettings(max_queue_delay_us=500_000)}},
    )
    with start_worker(config) as server:
        yield server


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))  # the worker is a thread of this process


def _connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.worker.http_port), timeout=10)


def _infer(server: ServerThread) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.worker.http_port, timeout=10)
    try:
        connection.request("POST", "/v2/models/mlp/infer", MLP_BODY)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _until_closed(sock: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (bounded by `seconds`)."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _settled(server: ServerThread, descriptors: int) -> None:
    """The next good request is served, and the descriptor count comes back to `descriptors`."""
    status, answer = _infer(server)
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 4], answer
    deadline = time.monotonic() + 5
    while _descriptors() > descriptors:
        assert time.monotonic() < deadline, f"{_descriptors()} descriptors open, {descriptors} before"
        time.sleep(0.05)


def _response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read whole (the connection may stay open)."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_connections_past_the_cap_are_answered_503_and_closed(bounded: ServerThread) -> None:
    _infer(bounded)  # the connection pool and first-request state exist before counting
    _until_connections(bounded, 0)  # the server has seen that request's connection close
    before = _descriptors()
    held = [_connect(bounded) for _ in range(CAP)]
    try:
        _until_connections(bounded, CAP)
        with _connect(bounded) as extra:
            status, error = _status_and_error(_until_closed(extra, 5))
        assert status == 503 and f"server.http_max_connections ({CAP})" in error, error
        assert bounded.call(lambda: bounded.worker.rest.connections) == CAP
    finally:
        for sock in held:
            sock.close()
    _until_connections(bounded, 0)  # the server sees each close, and frees its slot
    _settled(bounded, before)


def _until_connections(server: ServerThread, count: int) -> None:
    deadline = time.monotonic() + 5
    while (now := server.call(lambda: server.worker.rest.connections)) != count:
        assert time.monotonic() < deadline, f"{now} REST connections open, expected {count}"
        time.sleep(0.01)


def test_a_request_head_past_the_bound_is_431(bounded: ServerThread) -> None:
    """Whole in one read, the head is counted by the app (431 with a JSON error); still
    arriving, h11 stops buffering it at the bound (431, and the connection is closed)."""
    before = _descriptors()
    padding = b"x-padding: " + b"a" * 8192 + b"\r\n"
    with _connect(bounded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + padding + b"\r\n")
        status, error = _status_and_error(_until_closed(sock, 5))
    assert status == 431 and "server.http_max_header_bytes" in error and "4096" in error, error
    with _connect(bounded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n")
        time.sleep(0.1)  # the server has the start of the head, then 5 KiB more without its end
        sock.sendall(b"x-padding: " + b"a" * 5000 + b"\r\n")
        answer = _until_closed(sock, 5)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    _settled(bounded, before)


def test_a_head_that_never_completes_is_closed_after_the_idle_timeout(bounded: ServerThread) -> None:
    before = _descriptors()
    with _connect(bounded) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\n")
        closed = False
        for _ in range(50):  # a header byte every 0.1 s: the head never completes
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
            sock.settimeout(0)
            try:
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed = True
                break
    assert closed, "a never-ending head held its connection for 5 s"
    assert 1.9 < time.monotonic() - started < 5
    _settled(bounded, before)


def test_a_trickled_body_is_408_and_closed(bounded: ServerThread) -> None:
    before = _descriptors()
    with _connect(bounded) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
        sock.settimeout(0.1)
        answer = b""
        for _ in range(50):  # a byte every 0.1 s: the body would take 100 s
            try:
                sock.sendall(b" ")
                answer += sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if answer.endswith(b"}"):
                break
        answer += _until_closed(sock, 5)
    status, error = _status_and_error(answer)
    assert status == 408 and "server.http_body_timeout_s" in error, error
    assert time.monotonic() - started < 3
    _settled(bounded, before)


def test_bodies_past_the_bytes_being_received_are_503(bounded: ServerThread) -> None:
    """The bytes of bodies that have arrived, not their Content-Lengths, count against
    `server.max_receiving_bytes` (8 MiB here): a body that would pass it is refused, and the
    bytes come back."""
    before = _descriptors()
    declared = 8 << 20
    arrived = declared - 100  # all but 100 bytes of the budget
    head = f"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {declared}\r\n\r\n"
    with _connect(bounded) as slow, _connect(bounded) as second:
        slow.sendall(head.encode() + b" " * arrived)
        deadline = time.monotonic() + 5
        while bounded.call(lambda: bounded.worker.rest.receiving_bytes) < arrived:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        good = f"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-length: {len(MLP_BODY)}\r\n\r\n"
        second.sendall(good.encode() + MLP_BODY)
        status, error = _status_and_error(_response(second))
        assert status == 503 and "server.max_receiving_bytes (8388608)" in error, error
        status, error = _status_and_error(_until_closed(slow, 5))  # the slow one runs out of time
        assert status == 408, error
    assert bounded.call(lambda: bounded.worker.rest.receiving_bytes) == 0
    _settled(bounded, before)


def _gzip_infer(sock: socket.socket, tensor_bytes: int) -> tuple[int, dict[str, Any]]:
    """A gzip body for `wide` whose binary input is `tensor_bytes` of zeros (its shape says 4 MiB)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "datatype": "FP32",
                    "shape": [1, WIDE],
                    "parameters": {"binary_data_size": tensor_bytes},
                }
            ]
        }
    ).encode()
    body = gzip.compress(header + bytes(tensor_bytes), 9)
    sock.sendall(
        f"POST /v2/models/wide/infer HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\n"
        f"inference-header-content-length: {len(header)}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    answer = _response(sock)
    head, _, content = answer.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"inference-header")
        ),
        None,
    )
    return int(head.split()[1]), json.loads(content[:length])


def test_inflated_bytes_count_as_bytes_being_received(bounded: ServerThread) -> None:
    """A gzip body's inflated bytes count against `server.max_receiving_bytes` (8 MiB here) while
    it inflates: 9 MiB from 9 KiB is refused 503, where it was inflated whole; 4 MiB is served;
    the budget comes back either way."""
    before = _descriptors()
    with _connect(bounded) as sock:
        status, answer = _gzip_infer(sock, 9 << 20)
        assert status == 503 and "server.max_receiving_bytes (8388608)" in answer["error"], answer
    assert bounded.call(lambda: bounded.worker.rest.receiving_bytes) == 0
    with _connect(bounded) as sock:
        status, answer = _gzip_infer(sock, WIDE * 4)
        assert status == 200 and answer["outputs"][0]["shape"] == [1, WIDE], answer
    assert bounded.call(lambda: bounded.worker.rest.receiving_bytes) == 0
    _settled(bounded, before)


def test_a_client_that_reads_no_answer_is_dropped(bounded: ServerThread) -> None:
    """A 4 MiB answer to a client that never reads: past `server.http_body_timeout_s` its
    connection is dropped, with what was left to send."""
    _until_connections(bounded, 0)
    before = _descriptors()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "datatype": "FP32",
                    "shape": [1, WIDE],
                    "parameters": {"binary_data_size": WIDE * 4},
                }
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + np.ones(WIDE, np.float32).tobytes()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # little room for the answer
        sock.connect(("127.0.0.1", bounded.worker.http_port))
        lengths = f"inference-header-content-length: {len(header)}\r\ncontent-length: {len(body)}\r\n\r\n"
        sock.sendall(b"POST /v2/models/wide/infer HTTP/1.1\r\nhost: x\r\n" + lengths.encode() + body)
        _until_connections(bounded, 0)  # dropped while this socket is open and unread
    _settled(bounded, before)


def test_a_client_that_disconnects_while_queued_withdraws_its_request(bounded: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(bounded.url)
    try:
        executed = client.get_inference_statistics("mlp").model_stats[0].execution_count
        drops = bounded.call(lambda: bounded.worker.statistics["mlp"].drops["cancelled"])
        with _connect(bounded) as sock:
            sock.sendall(
                b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\n"
                + f"content-length: {len(MLP_BODY)}\r\n\r\n".encode()
                + MLP_BODY
            )
            deadline = time.monotonic() + 5  # queued: the lone row waits 500 ms for company
            while bounded.call(lambda: bounded.worker.rest.inferring) == 0:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        deadline = time.monotonic() + 5
        while bounded.call(lambda: bounded.worker.statistics["mlp"].drops["cancelled"]) == drops:
            assert time.monotonic() < deadline, "the disconnected request was not withdrawn"
            time.sleep(0.01)
        time.sleep(0.6)  # past the 500 ms hold: it would have run by now
        assert client.get_inference_statistics("mlp").model_stats[0].execution_count == executed
    finally:
        client.close()
    status, answer = _infer(bounded)
    assert status == 200, answer
    expected = np.asarray(answer["outputs"][0]["data"])
    assert expected.shape == (4,) and np.isfinite(expected).all()
