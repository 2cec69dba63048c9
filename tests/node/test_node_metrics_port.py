"""The node's metrics port (`NodeHttp`) on its own, without Envoy: bounded as a worker's is
(`server.metrics_max_connections`, `server.metrics_timeout_s`, TLS with
`server.metrics_use_ssl`), and a crowd of scrapers costs each worker one scrape at a time, not one
per scraper. The workers' endpoints are plain HTTP servers that count their scrapes and answer
slowly, which a real worker cannot be made to do; the node's own answers are real."""

from __future__ import annotations

import http.client
import http.server
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio
from support.certs import Certificates, make_certificates

from hloserve.config import NodeConfig, ServerConfig
from hloserve.fleet.controller import Controller, WorkerLink
from hloserve.fleet.http import NodeHttp

CAP, TIMEOUT_S, SCRAPE_S = 4, 1.0, 0.3
EXPOSITION = b'# TYPE hloserve_executions counter\nhloserve_executions_total{model="mlp"} 3.0\n'


class _SlowExposition(http.server.BaseHTTPRequestHandler):
    scrapes = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            type(self).scrapes += 1
        time.sleep(SCRAPE_S)
        self.send_response(200)
        self.send_header("content-length", str(len(EXPOSITION)))
        self.end_headers()
        self.wfile.write(EXPOSITION)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(name="workers")
def _workers() -> Iterator[list[str]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowExposition) for _ in range(2)]
    _SlowExposition.scrapes = 0
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class _Node:
    """NodeHttp on trio-asyncio in a thread, as the node runs it, for the given worker endpoints."""

    def __init__(self, metrics: list[str], server: ServerConfig) -> None:
        links = [WorkerLink(f"worker{i}", f"127.0.0.1:{1 + i}", address) for i, address in enumerate(metrics)]
        self._pages = NodeHttp(Controller(NodeConfig(), links, lambda routes: None), dict, None)
        self._server = server
        self._started, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._port = 0

    async def _main(self) -> None:
        async with trio_asyncio.open_loop():
            endpoint = await trio_asyncio.aio_as_trio(self._pages.serve)(self._server)
            self._port = endpoint.port
            self._started.set()
            try:
                await trio.to_thread.run_sync(self._stop.wait)
            finally:
                endpoint.close()

    def __enter__(self) -> int:
        self._thread.start()
        assert self._started.wait(10), "the node's metrics port did not start"
        return self._port

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _server(**changes: Any) -> ServerConfig:
    settings = {"metrics_port": 0, "metrics_max_connections": CAP, "metrics_timeout_s": TIMEOUT_S}
    server = ServerConfig(**(settings | changes))
    server.validate()
    return server


def _get(port: int, path: str = "/metrics", context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_scrapers_at_once_share_one_scrape_of_each_worker(workers: list[str]) -> None:
    with _Node(workers, _server(metrics_max_connections=64)) as port:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: _get(port), range(16)))
    assert all(status == 200 for status, _ in answers), answers
    for _, body in answers:
        assert b'hloserve_executions_total{model="mlp",worker="worker1"} 3.0' in body
        assert b"hloserve_node_worker_ready" in body  # the controller's own families
    # One scrape of each worker per exposition built; each took SCRAPE_S, so 16 scrapers arriving
    # together were served by a few expositions (one per scraper would be 32 worker scrapes).
    assert _SlowExposition.scrapes <= 2 * 4, _SlowExposition.scrapes


def test_connections_past_the_cap_are_refused_and_idle_ones_closed_at_the_timeout(workers: list[str]) -> None:
    with _Node(workers, _server()) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(CAP + 2)]
        try:
            for sock in idle[CAP:]:  # past the cap: 503 naming the key, closed
                answer = sock.recv(65536)
                assert answer.startswith(b"HTTP/1.1 503 "), answer
                assert b"server.metrics_max_connections (4) reached; retry later" in answer
            started = time.monotonic()
            for sock in idle[:CAP]:  # silent: closed at the timeout
                assert sock.recv(65536) == b""
            assert time.monotonic() - started < TIMEOUT_S + 5
        finally:
            for sock in idle:
                sock.close()
        assert _get(port)[0] == 200  # the port serves again
        status, body = _get(port, "/nope")
        assert status == 404 and b"/healthz" in body and b"/metrics" in body and b"/readyz" in body
        assert _get(port, "/healthz") == (200, b"ok\n")
        assert _get(port, "/readyz") == (503, b"not ready: no worker is ready\n")


def test_metrics_use_ssl_serves_the_node_port_over_tls(workers: list[str], tmp_path: Path) -> None:
    certs: Certificates = make_certificates(tmp_path)
    tls = _server(metrics_use_ssl=True, http_server_cert=certs.server_cert, http_server_key=certs.server_key)
    with _Node(workers, tls) as port:
        status, body = _get(port, context=ssl.create_default_context(cafile=str(certs.ca)))
        assert status == 200 and b'worker="worker0"' in body
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _get(port)  # plain text: the handshake fails, the connection is closed
        assert _get(port, context=ssl.create_default_context(cafile=str(certs.ca)))[0] == 200
