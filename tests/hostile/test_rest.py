"""Hostile HTTP/1.1, h2c and JSON against the REST port (issue 25): ambiguous framing (request
smuggling), one connection's exception, h2c on and off, client mistakes that used to be 5xx or
accepted, and bodies declared but never sent. Raw sockets wherever an HTTP client would
normalise the request. Each test asserts the status, that the message names the problem, and
that the next good request on a fresh connection is served."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import numpy as np
import pytest
from support.clients import assert_serves, http_answer
from support.servers import ServerThread, make_config, start_worker

from hloserve.api.rest import body as rest_body
from hloserve.api.rest.inflight import InFlight

MLP_INPUT = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}
MLP_BODY = json.dumps({"inputs": [MLP_INPUT]}).encode()
INFER = "/v2/models/mlp/infer"
MiB = 1 << 20


@pytest.fixture(scope="module", name="h2c", params=[0, 2], ids=["frontends0", "frontends2"])
def _h2c(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker with h2c on and 8 MiB of request bodies receivable at once."""
    config = make_config(http2=True, max_receiving_bytes=8 * MiB, max_receiving_bytes_per_connection=8 * MiB)
    with start_worker(config, frontends=request.param) as server:
        yield server


def _connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.worker.http_port), timeout=10)


def _strict_json(data: bytes) -> Any:
    """`data` as JSON as RFC 8259 has it: NaN and Infinity tokens fail."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in an answer is not JSON")

    return json.loads(data, parse_constant=refuse)


def _closed(sock: socket.socket, timeout: float = 5) -> bool:
    """Whether the server closes the connection (reading and dropping what it still sends)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _refused(server: ServerThread, raw: bytes) -> tuple[int, str]:
    """Send `raw` on a fresh connection: the status and JSON error of the answer, which must be
    a 4xx and close the connection."""
    with _connect(server) as sock:
        sock.sendall(raw)
        status, _, body = http_answer(sock)
        assert 400 <= status < 500, body[:300]
        assert _closed(sock), "the connection stayed open after a refused framing"
    return status, _strict_json(body)["error"]


def _post(
    server: ServerThread, path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, Any]:
    """A request through http.client on a fresh connection: the status and the strict JSON of the
    answer (of its JSON header when binary follows), or None when it has no body."""
    connection = http.client.HTTPConnection("127.0.0.1", server.worker.http_port, timeout=30)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        data = response.read()
        data = data[: int(response.getheader("inference-header-content-length", len(data)))]
        return response.status, _strict_json(data) if data else None
    finally:
        connection.close()


def _assert_rest_serves(server: ServerThread) -> None:
    """The next good REST request, on a fresh connection, is answered."""
    status, answer = _post(server, INFER, MLP_BODY)
    assert status == 200, answer
    assert len(answer["outputs"][0]["data"]) == 4


# -- framing (RFC 9112) ------------------------------------------------------------------------


def _binary_request(x: np.ndarray) -> tuple[bytes, bytes]:
    """An MLP request in Triton's binary extension: its JSON header and its tensor bytes."""
    header = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}
        ]
    }
    return json.dumps(header).encode(), x.astype(np.float32).tobytes()


def test_content_length_with_transfer_encoding_is_400_and_closed(server: ServerThread) -> None:
    """The smuggling leak: a chunked body holding only the JSON header of a binary request, with a
    Content-Length that counts the 64 tensor bytes too, was answered 200 from a recycled buffer
    (the previous client's tensor). Now it is refused before its body is read."""
    x = np.random.default_rng(25).random((1, 16), dtype=np.float32)
    header, tensor = _binary_request(x)
    good = (
        f"POST {INFER} HTTP/1.1\r\nhost: x\r\ninference-header-content-length: {len(header)}\r\n"
        f"content-length: {len(header) + len(tensor)}\r\n\r\n"
    ).encode()
    for _ in range(3):  # another client's tensor in the recycled buffers
        with _connect(server) as sock:
            sock.sendall(good + header + tensor)
            status, _, body = http_answer(sock)
            assert status == 200
            theirs = _strict_json(body)["outputs"][0]["data"]
    smuggled = (
        f"POST {INFER} HTTP/1.1\r\nhost: x\r\ninference-header-content-length: {len(header)}\r\n"
        f"content-length: {len(header) + len(tensor)}\r\ntransfer-encoding: chunked\r\n\r\n"
        f"{len(header):x}\r\n"
    ).encode()
    with _connect(server) as sock:
        sock.sendall(smuggled + header + b"\r\n0\r\n\r\n")
        status, _, body = http_answer(sock)
        if status == 200:
            answer = _strict_json(body)["outputs"][0]["data"]
            leaked = "the previous client's tensor" if answer == theirs else "bytes it never sent"
            raise AssertionError(f"served 200, computed from {leaked}: {answer}")
        assert _closed(sock), "the connection stayed open after a refused framing"
    error = _strict_json(body)["error"]
    assert status == 400, error
    assert "both Content-Length and Transfer-Encoding" in error, error
    _assert_rest_serves(server)


def test_a_longer_chunked_body_with_a_content_length_is_400(server: ServerThread) -> None:
    """The other face of it: a chunked body longer than its Content-Length (a 500 before)."""
    body = MLP_BODY
    raw = (
        (
            f"POST {INFER} HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\ntransfer-encoding: chunked\r\n\r\n"
            f"{len(body):x}\r\n"
        ).encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    status, error = _refused(server, raw)
    assert status == 400 and "Transfer-Encoding" in error, error
    _assert_rest_serves(server)


@pytest.mark.parametrize(
    "lengths",
    [
        pytest.param(b"content-length: 20\r\ncontent-length: 10\r\n", id="two-headers"),
        pytest.param(b"content-length: 20, 10\r\n", id="one-header-two-values"),
        pytest.param(b"content-length: 2\r\ncontent-length: 2\r\n", id="repeated"),
        pytest.param(b"content-length: 2, 2\r\n", id="repeated-in-one-header"),
    ],
)
def test_two_content_lengths_are_400_and_closed(server: ServerThread, lengths: bytes) -> None:
    """h11 refuses lengths that disagree and folded those that agree; both are refused now."""
    raw = b"POST " + INFER.encode() + b" HTTP/1.1\r\nhost: x\r\n" + lengths + b"\r\n{}"
    status, error = _refused(server, raw)
    assert status == 400 and "Content-Length" in error, error
    _assert_rest_serves(server)


@pytest.mark.parametrize(
    ("chunks", "says"),
    [
        ([b"{}", b""], r"^the body has 2 bytes, its Content-Length says 100$"),
        ([b"x" * 60, b"x" * 60], r"^the body has more than its Content-Length of 100 bytes$"),
    ],
)
def test_a_body_is_used_only_when_exactly_its_declared_bytes_arrived(chunks: list[bytes], says: str) -> None:
    """h11 and h2 hold a client to its Content-Length; `_receive` checks it again, so that no
    answer is ever computed from the unwritten tail of a recycled buffer."""
    config = make_config().server
    bodies = rest_body.BodyReader(config, InFlight(config.http_body_timeout_s, config.http_idle_timeout_s))
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    with pytest.raises(rest_body.HttpRefusal, match=says):
        asyncio.run(bodies._receive("100", receive, 1 << 20, "server.max_message_bytes"))
    assert bodies.receiving == 0


# -- one connection's exception; h2c off and on --------------------------------------------------

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def test_h2c_is_off_by_default_and_its_preface_refused(server: ServerThread) -> None:
    with _connect(server) as sock:
        sock.sendall(_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # and an empty SETTINGS
        status, _, body = http_answer(sock)
        assert _closed(sock)
    error = _strict_json(body)["error"]
    assert status == 505 and "server.http2" in error, error
    upgrade = (
        b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n"
    )
    with _connect(server) as sock:  # an upgrade is ignored: answered in HTTP/1.1
        sock.sendall(upgrade)
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    _assert_rest_serves(server)
    assert_serves(server.url)


def _streams_opened_and_reset(count: int) -> bytes:
    """An h2c preface and `count` HEADERS + RST_STREAM pairs, as one write."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    headers = [(":method", "GET"), (":scheme", "http"), (":path", "/v2/health/live"), (":authority", "x")]
    for i in range(count):
        client.send_headers(2 * i + 1, headers)
        client.reset_stream(2 * i + 1)
    return client.data_to_send()


def test_h2c_when_on_serves_and_a_stream_flood_closes_only_its_connection(h2c: ServerThread) -> None:
    """1001 HEADERS + RST_STREAM pairs in one write made hypercorn's H2 protocol raise
    TooManyStreamsError out of the connection's task, and the worker exited."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(
        1,
        [(":method", "GET"), (":scheme", "http"), (":path", "/v2/health/live"), (":authority", "x")],
        end_stream=True,
    )
    with _connect(h2c) as sock:  # h2c with prior knowledge is served
        sock.sendall(client.data_to_send())
        sock.settimeout(10)
        statuses: list[bytes] = []
        while not statuses:
            for event in client.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived):
                    statuses.append(dict(event.headers)[b":status"])
        assert statuses == [b"200"]
    with _connect(h2c) as sock:
        try:
            sock.sendall(_streams_opened_and_reset(1001))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed(sock, 10), "the flooding connection stayed open"
    _assert_rest_serves(h2c)
    assert_serves(h2c.url)


# -- client mistakes: a 4xx that names them, valid JSON in every answer ------------------------

DEEP = b"[" * 100_000
SHM = "/v2/systemsharedmemory/region/r/register"


def _mlp(**changes: Any) -> bytes:
    return json.dumps({"inputs": [{**MLP_INPUT, **changes}]}).encode()


def _raw_mlp(data: bytes) -> bytes:
    """An MLP request whose `data` is the JSON text `data`, as sent (json.dumps writes no NaN)."""
    return b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": ' + data + b"}]}"


def _nested(depth: int) -> Any:
    data: Any = 0.5
    for _ in range(depth):
        data = [data]
    return data


_BOTH = json.dumps({"inputs": [{**MLP_INPUT, "parameters": {"binary_data_size": 64}}]}).encode()
_LENGTH = "Inference-Header-Content-Length"
_SURROGATE = b'"\\ud800"'
_LOAD_DEEP = json.dumps({"parameters": {"config": "[" * 60_000}}).encode()

MISTAKES = [
    ("deep infer", INFER, DEEP, {}, "holds 100000 arrays and objects, past the server's limit of 4096"),
    ("3000 deep infer", INFER, DEEP[:3000], {}, "too deeply"),
    ("deep index", "/v2/repository/index", DEEP, {}, "too deeply"),
    ("deep load", "/v2/repository/models/mlp/load", DEEP, {}, "too deeply"),
    ("deep shared memory", SHM, DEEP, {}, "too deeply"),
    ("surrogate id", INFER, b'{"id": ' + _SURROGATE + b', "inputs": []}', {}, "surrogate"),
    ("surrogate input name", INFER, _mlp(name="\ud800"), {}, "surrogate"),
    (
        "surrogate parameter key",
        INFER,
        b'{"parameters": {' + _SURROGATE + b': 1}, "inputs": []}',
        {},
        "surrogate",
    ),
    ("surrogate shared memory key", SHM, b'{"key": ' + _SURROGATE + b', "byte_size": 8}', {}, "surrogate"),
    ("superscript header length", INFER, MLP_BODY, {_LENGTH: "\u00b2"}, "byte count"),
    ("NaN", INFER, _raw_mlp(b"[NaN" + b", 0.5" * 15 + b"]"), {}, "NaN is not a JSON number"),
    ("Infinity", INFER, _raw_mlp(b"[Infinity" + b", 0.5" * 15 + b"]"), {}, "Infinity is not a JSON number"),
    ("-Infinity", INFER, _raw_mlp(b"[-Infinity" + b", 0.5" * 15 + b"]"), {}, "Infinity is not a JSON number"),
    ("1e400", INFER, _raw_mlp(b"[1e400" + b", 0.5" * 15 + b"]"), {}, "too large for a double"),
    ("1e39 for FP32", INFER, _raw_mlp(b"[1e39" + b", 0.5" * 15 + b"]"), {}, "out of range: FP32 holds"),
    ("1e400 parameter", INFER, b'{"parameters": {"p": 1e400}, "inputs": []}', {}, "not a finite number"),
    ("data and binary_data_size", INFER, _BOTH + b"\0" * 64, {_LENGTH: str(len(_BOTH))}, "both 'data' and"),
    (
        "bytes after gzip",
        INFER,
        gzip.compress(MLP_BODY) + b"junk",
        {"Content-Encoding": "gzip"},
        "follow the end",
    ),
    (
        "bytes after deflate",
        INFER,
        zlib.compress(MLP_BODY) + b"junk",
        {"Content-Encoding": "deflate"},
        "follow the end",
    ),
    ("101 dimensions", INFER, _mlp(shape=[1] * 101, data=_nested(101)), {}, "too many dimensions"),
    ("load config 60,000 [", "/v2/repository/models/mlp/load", _LOAD_DEEP, {}, "too deeply"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "says"), [pytest.param(*case[1:], id=case[0]) for case in MISTAKES]
)
def test_client_mistakes_are_4xx_naming_the_problem(
    server: ServerThread, path: str, body: bytes, headers: dict[str, str], says: str
) -> None:
    status, answer = _post(server, path, body, headers)
    assert 400 <= status < 500, answer
    assert says in answer["error"], answer
    _assert_rest_serves(server)


def test_a_query_string_past_the_head_bound_is_431(server: ServerThread) -> None:
    status, answer = _post(server, "/v2/health/live?x=" + "a" * 40_000, b"", method="GET")
    assert status == 431 and "server.http_max_header_bytes" in answer["error"], answer
    _assert_rest_serves(server)


def test_two_to_the_64_is_a_valid_fp32_value(server: ServerThread) -> None:
    status, answer = _post(server, INFER, _mlp(data=[2**64] + [0.5] * 15))
    assert status == 200, answer


def test_non_finite_outputs_are_valid_json(server: ServerThread) -> None:
    """Outputs that are NaN or infinite come back as the strings "NaN", "Infinity" and
    "-Infinity" (protobuf's JSON mapping), never as tokens that are not JSON."""
    status, answer = _post(server, INFER, _mlp(data=[3e38] * 8 + [-3e38] * 8))
    assert status == 200, answer
    values = answer["outputs"][0]["data"]
    assert len(values) == 4
    assert all(isinstance(v, float) or v in ("NaN", "Infinity", "-Infinity") for v in values), values
    assert any(isinstance(v, str) for v in values), f"the MLP gave finite outputs: {values}"


# -- budgets count the bytes received ----------------------------------------------------------


def test_bodies_declared_but_not_sent_hold_no_receiving_budget(h2c: ServerThread) -> None:
    """Two connections declaring 8 MiB bodies (the whole `server.max_receiving_bytes`) and sending
    nothing used to get every other body a 503 until their 408s."""
    head = f"POST {INFER} HTTP/1.1\r\nhost: x\r\ncontent-length: {8 * MiB}\r\n\r\n".encode()
    with _connect(h2c) as first, _connect(h2c) as second:
        first.sendall(head)
        second.sendall(head + b"{")
        time.sleep(0.2)  # the server has both heads
        for _ in range(3):
            _assert_rest_serves(h2c)
