"""REST bodies answered as HTTP clients expect (issue 34, item 5), through a real worker and raw
sockets (a client library would hide the interim `100 Continue` and the framing):

- a body over its bound is 413 Content Too Large, from its declared Content-Length, and a client
  waiting with `Expect: 100-continue` gets the 413 instead of a `100 Continue`; a chunked body
  that grows past the bound is 413 too;
- a gzip body of several members (`cat a.gz b.gz`) is inflated, within the same bounds (size and
  ratio) as one member, counted over all its members;
- a JSON number a datatype cannot hold is 400 naming the tensor, the datatype and its range.
"""

from __future__ import annotations

import gzip
import json
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.clients import http_answer
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

JSON_LIMIT = 4 << 20
MESSAGE_LIMIT = 8 << 20
RATIO = 2
MLP_INPUT = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}
MLP_BODY = json.dumps({"inputs": [MLP_INPUT]}).encode()
INFER = "/v2/models/mlp/infer"


def _add_one(params: Any, x: Any) -> Any:
    return x + params["one"]


@pytest.fixture(scope="module", name="server")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The example MLP and `tiny`, INT8 [n, 2] + 1, with small body bounds."""
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    export_bundle(
        _add_one,
        {"one": np.ones(2, np.int8)},
        [InputSpec("X", (2,), np.int8)],
        repository / "tiny",
        outputs=[OutputSpec("Y")],
        verify=False,
    )
    config = make_config(
        repository,
        http_max_json_bytes=JSON_LIMIT,
        max_message_bytes=MESSAGE_LIMIT,
        http_max_inflation_ratio=RATIO,
    )
    with start_worker(config) as server:
        yield server


def _connect(server: ServerThread) -> socket.socket:
    host, _, port = server.http_url.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _post(server: ServerThread, path: str, body: bytes, headers: str = "") -> tuple[int, dict[str, Any]]:
    with _connect(server) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{headers}\r\n".encode() + body
        )
        status, _, answer = http_answer(sock)
    return status, json.loads(answer)


def _assert_serves(server: ServerThread) -> None:
    status, answer = _post(server, INFER, MLP_BODY)
    assert status == 200, answer


def _first_answer(sock: socket.socket) -> tuple[int, bytes]:
    """The first response the server sends, interim (`100 Continue`, no body) or final: its
    status and body."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        (int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of an answer"
        body += chunk
    return status, body


# -- 413 ----------------------------------------------------------------------------------------


def test_a_declared_body_over_the_bound_is_413_before_it_is_sent(server: ServerThread) -> None:
    with _connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nhost: x\r\ncontent-length: {JSON_LIMIT + 1}\r\n\r\n".encode())
        status, _, answer = http_answer(sock)  # no byte of the body sent
    assert status == 413
    assert json.loads(answer)["error"].startswith(
        f"request body of {JSON_LIMIT + 1} bytes exceeds the server's limit of {JSON_LIMIT} bytes "
        "(server.http_max_json_bytes)"
    )
    _assert_serves(server)


@pytest.mark.parametrize(
    ("path", "headers", "declared", "bound"),
    [
        (INFER, "", JSON_LIMIT + 1, "server.http_max_json_bytes"),
        (INFER, "inference-header-content-length: 100\r\n", MESSAGE_LIMIT + 1, "server.max_message_bytes"),
        ("/v2/repository/models/mlp/load", "", MESSAGE_LIMIT + 1, "server.max_message_bytes"),
        ("/v2/repository/index", "", JSON_LIMIT + 1, "server.http_max_json_bytes"),
    ],
    ids=["json infer", "binary infer", "load", "other json"],
)
def test_expect_100_continue_over_the_bound_gets_413_and_no_100(
    server: ServerThread, path: str, headers: str, declared: int, bound: str
) -> None:
    """The first thing the client reads is the 413 (never `100 Continue`), then the close."""
    with _connect(server) as sock:
        expect = f"content-length: {declared}\r\nexpect: 100-continue\r\n{headers}"
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\n{expect}\r\n".encode())
        status, body = _first_answer(sock)
        assert status == 413, body
        assert bound in json.loads(body)["error"]
        assert sock.recv(1) == b""  # closed: the body it did not send is never read
    _assert_serves(server)


@pytest.mark.parametrize(
    ("path", "declared"),
    [(INFER, len(MLP_BODY)), ("/v2/repository/models/mlp/load", JSON_LIMIT + 1)],
    ids=["small infer", "load past the JSON bound: its own is max_message_bytes"],
)
def test_expect_100_continue_within_the_bound_gets_100_then_its_answer(
    server: ServerThread, path: str, declared: int
) -> None:
    with _connect(server) as sock:
        expect = f"content-length: {declared}\r\nexpect: 100-continue\r\n"
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\n{expect}\r\n".encode())
        status, body = _first_answer(sock)
        assert (status, body) == (100, b"")
        if path == INFER:
            sock.sendall(MLP_BODY)
            status, _, answer = http_answer(sock)
            assert status == 200, answer
    _assert_serves(server)


def test_a_chunked_body_that_grows_past_the_bound_is_413(server: ServerThread) -> None:
    piece = b" " * (1 << 20)
    with _connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode())
        try:
            for _ in range(JSON_LIMIT // len(piece) + 1):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while sending: the answer is already there to read
        status, _, answer = http_answer(sock)
    assert status == 413
    assert json.loads(answer)["error"].startswith(
        f"request body of more than {JSON_LIMIT} bytes exceeds the server's limit of {JSON_LIMIT} bytes"
    )
    _assert_serves(server)


# -- gzip members -------------------------------------------------------------------------------


def test_a_gzip_body_of_two_members_is_inflated(server: ServerThread) -> None:
    """`cat a.gz b.gz` of one JSON body split in two answers as the body sent plain."""
    middle = len(MLP_BODY) // 2
    body = gzip.compress(MLP_BODY[:middle]) + gzip.compress(MLP_BODY[middle:])
    plain_status, plain = _post(server, INFER, MLP_BODY)
    status, answer = _post(server, INFER, body, "content-encoding: gzip\r\n")
    assert (status, plain_status) == (200, 200), answer
    assert answer["outputs"] == plain["outputs"]


def test_gzip_members_are_bounded_by_their_total_size(server: ServerThread) -> None:
    """Each member under the JSON bound (and within the ratio: hex digits halve), both together
    past it: 413 naming the bound."""
    rng = np.random.default_rng(34)
    member = gzip.compress(rng.bytes(JSON_LIMIT // 4 + 1).hex().encode(), 9)
    status, answer = _post(server, INFER, member * 2, "content-encoding: gzip\r\n")
    assert status == 413, answer
    assert answer["error"].startswith(
        f"gzip body that inflates to more than {JSON_LIMIT} bytes exceeds the server's limit of "
        f"{JSON_LIMIT} bytes (server.http_max_json_bytes)"
    )
    _assert_serves(server)


def test_gzip_members_are_bounded_by_the_ratio_over_the_whole_body(server: ServerThread) -> None:
    """Two members of 700 KB each inflate past `RATIO` times the body (and the 1 MiB floor)."""
    member = gzip.compress(b" " * 700_000, 9)
    body = member * 2
    status, answer = _post(server, INFER, body, "content-encoding: gzip\r\n")
    assert status == 400, answer
    assert answer["error"] == (
        f"the {len(body)}-byte gzip body inflates past {1 << 20} bytes, more than "
        f"server.http_max_inflation_ratio ({RATIO}) times its size"
    )
    _assert_serves(server)


def test_bytes_after_a_member_that_are_no_member_are_400(server: ServerThread) -> None:
    status, answer = _post(server, INFER, gzip.compress(MLP_BODY) + b"junk", "content-encoding: gzip\r\n")
    assert status == 400
    assert answer["error"] == "4 bytes follow the end of the gzip data and are not a gzip member"
    _assert_serves(server)


# -- numbers out of range -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [("300", "300"), ("-129", "-129"), ("1" + "0" * 40, "1000000000000000... (41 digits)")],
)
def test_a_json_number_out_of_the_datatype_s_range_names_the_range(
    server: ServerThread, value: str, shown: str
) -> None:
    body = b'{"inputs":[{"name":"X","datatype":"INT8","shape":[1,2],"data":[1,%s]}]}' % value.encode()
    status, answer = _post(server, "/v2/models/tiny/infer", body)
    assert status == 400
    assert answer["error"] == (
        f"model 'tiny', tensor 'X': 'data' value {shown} is out of range: INT8 holds -128..127"
    )
    status, answer = _post(
        server,
        "/v2/models/tiny/infer",
        b'{"inputs":[{"name":"X","datatype":"INT8","shape":[1,2],"data":[1,126]}]}',
    )
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == [2, 127]
