"""One descriptor budget for every listener (issue 25, item 3): at RLIMIT_NOFILE 512, 384 idle
REST and 216 idle gRPC connections used every descriptor and new clients on both ports hung,
`server.http_max_connections` and `server.max_connections` each defaulting to the limit less 128
and being counted apart. Now `server.max_open_connections` bounds them together."""

from __future__ import annotations

import json
import shutil
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.clients import assert_serves
from support.servers import EXAMPLES, ServerProcess, start_worker

from hostile.test_transport import Peer, framed, nofile

pytestmark = pytest.mark.serial  # a probe client's latency, or the descriptors: alone

MLP_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
).encode()
LIMIT = 256
BUDGET = LIMIT - 128


def _rest(server: ServerProcess) -> socket.socket:
    host, _, port = server.http_url.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _infer(sock: socket.socket) -> bytes:
    sock.sendall(
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\n"
        + f"content-length: {len(MLP_BODY)}\r\n\r\n".encode()
        + MLP_BODY
    )
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        data.partition(b"content-length: ")[2].split(b"\r\n")[0] or b"1" * 9
    ):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _refused(sock: socket.socket) -> bool:
    """Whether the server answered this idle REST connection 503 (past a connection cap)."""
    sock.setblocking(False)
    try:
        return sock.recv(65536).startswith(b"HTTP/1.1 503 ")
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


@pytest.mark.slow
def test_rest_and_grpc_connections_share_one_descriptor_budget(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    shutil.copytree(EXAMPLES / "mlp", repository / "mlp")
    with ExitStack() as stack:
        with nofile(LIMIT):
            server = stack.enter_context(
                start_worker(
                    process="subprocess", repository=repository, env={"HLOSERVE_SERVER_HTTP_PORT": "0"}
                )
            )
        assert isinstance(server, ServerProcess)
        existing = stack.enter_context(Peer(server.grpc_port))
        assert existing.call("ServerLive", framed(b"")).get("grpc-status") == "0"
        held = stack.enter_context(_rest(server))  # a REST client that keeps its connection
        assert _infer(held).startswith(b"HTTP/1.1 200 ")
        idle_rest = [stack.enter_context(_rest(server)) for _ in range(BUDGET - 2 - 20)]
        time.sleep(1)  # accepted, each holding its descriptor
        flood = [Peer(server.grpc_port) for _ in range(60)]  # 20 fit the budget, 40 do not
        try:
            time.sleep(1)
            assert server.process.poll() is None
            deadline = time.monotonic() + 10
            while True:
                refused = [p for p in flood if p.ended(timeout=0.01) and p.terminated is not None]
                if len(refused) >= 40 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            refused_rest = [sock for sock in idle_rest if _refused(sock)]  # if accepted after the flood
            assert len(refused) + len(refused_rest) >= 38, (len(refused), len(refused_rest))
            assert any(
                b"server.max_open_connections (128)" in (p.terminated.additional_data or b"")
                for p in refused
                if p.terminated is not None
            )
            with _rest(server) as late:  # REST past the shared budget: 503 naming it, not a hang
                late.settimeout(10)
                answer = late.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
            assert b"server.max_open_connections (128) reached; retry later" in answer
            # the connections held go on being served
            assert existing.call("ServerLive", framed(b"")).get("grpc-status") == "0"
            assert _infer(held).startswith(b"HTTP/1.1 200 ")
        finally:
            for peer in flood:
                peer.sock.close()
            for sock in idle_rest:
                sock.close()
        deadline = time.monotonic() + 15
        while True:  # once they have gone, new clients on both ports are served
            try:
                assert_serves(server.url, timeout=2)
                with _rest(server) as fresh:
                    assert _infer(fresh).startswith(b"HTTP/1.1 200 ")
                break
            except (AssertionError, OSError, Exception):
                assert time.monotonic() < deadline and server.process.poll() is None
                time.sleep(0.3)
        assert server.process.poll() is None
