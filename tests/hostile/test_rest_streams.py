"""Per-stream deadlines and idle timers on the REST port over h2c (issue 25, item 3): twelve
streams whose 3 MB answers the client never reads beside one small stream it does read; an h2c
connection that sends its preface and nothing else."""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
from support.bundles import write_wide
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

pytestmark = pytest.mark.serial  # a probe client's latency, or the descriptors: alone

WIDE = 3 << 18  # floats per row of the `wide` model: a 3 MiB answer
BODY_TIMEOUT_S = 4.0
IDLE_TIMEOUT_S = 1.0
MLP_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
).encode()


@pytest.fixture(scope="module", name="server")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    write_wide(repository / "wide", WIDE)
    config = make_config(
        repository,
        http2=True,
        http_body_timeout_s=BODY_TIMEOUT_S,
        http_idle_timeout_s=IDLE_TIMEOUT_S,
        max_receiving_bytes=64 << 20,
        max_receiving_bytes_per_connection=64 << 20,
    )
    with start_worker(config) as server:
        yield server


def _h2c(server: ServerThread) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", server.worker.http_port), timeout=10)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.increment_flow_control_window(1 << 30)  # the connection's window: streams block on their own
    sock.sendall(client.data_to_send())
    return sock, client


_ANSWERED: set[int] = set()
"""The streams whose answer began (HEADERS) on the connection `_post` sends on."""


def _post(
    sock: socket.socket,
    client: h2.connection.H2Connection,
    stream: int,
    path: str,
    body: bytes,
    **headers: str,
) -> None:
    """A request on `stream`, its body sent as the server's windows let it (what arrives for other
    streams meanwhile is left unread: their windows stay shut)."""
    client.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "x"),
            ("content-length", str(len(body))),
            *headers.items(),
        ],
    )
    offset = 0
    while offset < len(body):
        room = min(
            client.local_flow_control_window(stream), client.max_outbound_frame_size, len(body) - offset
        )
        if room > 0:
            client.send_data(stream, body[offset : offset + room], end_stream=offset + room == len(body))
            offset += room
        else:
            sock.sendall(client.data_to_send())
            data = sock.recv(1 << 20)
            assert data, "the connection closed while a request was sent"
            for event in client.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    _ANSWERED.add(event.stream_id)
    sock.sendall(client.data_to_send())


def _wide_request() -> tuple[bytes, str]:
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
    return header + np.ones(WIDE, np.float32).tobytes(), str(len(header))


def _open_connections(server: ServerThread) -> int:
    return int(server.call(lambda: server.worker.rest.connections))


def _until(condition: Any, timeout: float) -> float:
    """Seconds until `condition()` held; fails past `timeout`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout
        time.sleep(0.02)
    return time.monotonic() - started


def test_twelve_unread_answers_are_aborted_at_their_deadline_beside_a_read_one(server: ServerThread) -> None:
    """The small stream's completion popped the connection's deadline (`InFlight.sending` was
    keyed by the client's address), and the twelve 3 MiB answers stayed buffered for good."""
    before = _open_connections(server)
    body, header_length = _wide_request()
    _ANSWERED.clear()
    sock, client = _h2c(server)
    try:
        for i in range(12):
            _post(
                sock,
                client,
                2 * i + 1,
                "/v2/models/wide/infer",
                body,
                **{"inference-header-content-length": header_length},
            )
        started_answers = _ANSWERED
        while len(started_answers) < 12:  # every answer under way, each stopped by its window
            data = sock.recv(1 << 20)
            assert data, "the connection closed before the answers began"
            for event in client.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    started_answers.add(event.stream_id)
        _post(sock, client, 25, "/v2/models/mlp/infer", MLP_BODY)
        answered: dict[int, bytes] = {}
        ended = False
        started = time.monotonic()
        while not ended and time.monotonic() - started < 10:
            data = sock.recv(1 << 20)
            assert data, "the connection closed before the small answer came"
            for event in client.receive_data(data):
                if isinstance(event, h2.events.DataReceived) and event.stream_id == 25:
                    answered[25] = answered.get(25, b"") + event.data
                    client.acknowledge_received_data(event.flow_controlled_length, 25)
                if isinstance(event, h2.events.StreamEnded) and event.stream_id == 25:
                    ended = True
            sock.sendall(client.data_to_send())
        assert ended, "the read stream was not answered"
        assert len(json.loads(answered[25])["outputs"][0]["data"]) == 4
        # the twelve unread answers: the connection is dropped at their deadline
        sock.settimeout(BODY_TIMEOUT_S + 5)
        waited = time.monotonic()
        try:
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
        waited = time.monotonic() - waited
        assert waited < BODY_TIMEOUT_S + 2, waited
    finally:
        sock.close()
    _until(lambda: _open_connections(server) <= before, 5)
    _assert_serves(server)


def _seconds_until_closed(sock: socket.socket) -> float:
    """Read and drop whatever the server sends until it closes the connection."""
    started = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_an_h2c_connection_with_no_stream_is_closed_when_idle(server: ServerThread) -> None:
    """hypercorn stops its idle timer at the `PRI` preface; an h2c connection that opened no
    stream was never timed out (16 of them past the cap turned everyone else away)."""
    sock, _ = _h2c(server)
    try:
        sock.settimeout(IDLE_TIMEOUT_S + 5)
        waited = _seconds_until_closed(sock)
    finally:
        sock.close()
    assert IDLE_TIMEOUT_S * 0.9 < waited < IDLE_TIMEOUT_S + 2, waited
    _assert_serves(server)


def test_an_h2c_connection_idle_after_its_streams_is_closed_too(server: ServerThread) -> None:
    sock, client = _h2c(server)
    try:
        _post(sock, client, 1, "/v2/models/mlp/infer", MLP_BODY)
        sock.settimeout(IDLE_TIMEOUT_S + 5)
        ended = False
        while not ended:
            data = sock.recv(65536)
            assert data
            ended = any(isinstance(e, h2.events.StreamEnded) for e in client.receive_data(data))
        waited = _seconds_until_closed(sock)
    finally:
        sock.close()
    assert waited < IDLE_TIMEOUT_S + 2, waited


def _assert_serves(server: ServerThread) -> None:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.worker.http_port, timeout=10)
    try:
        connection.request("POST", "/v2/models/mlp/infer", MLP_BODY)
        response = connection.getresponse()
        assert response.status == 200
        assert len(json.loads(response.read())["outputs"][0]["data"]) == 4
    finally:
        connection.close()
