"""TLS on both ports (`server.grpc_use_ssl*`, `server.http_use_ssl*`) with certificates made by
the test, through the real tritonclient: served over TLS, plain-text clients refused, and with
mutual TLS a client without a certificate the server trusts refused; after each refusal the
next good client is served. One process and an engine with two frontends answer alike."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import gevent.ssl
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from geventhttpclient.response import HTTPConnectionClosed
from support.certs import Certificates, make_certificates
from support.clients import assert_good_request_served
from support.servers import ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import ServerConfig
from hloserve.errors import ConfigError
from hloserve.tls import server_context

_FRONTENDS = {"params": [0, 2], "ids": ["frontends0", "frontends2"]}


@pytest.fixture(scope="module", name="certs")
def _certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


HANDSHAKE_S = 2.0


def _tls_settings(certs: Certificates, mutual: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {"handshake_timeout_s": HANDSHAKE_S, "metrics_use_ssl": True}
    for proto in ("grpc", "http"):
        settings[f"{proto}_use_ssl_mutual" if mutual else f"{proto}_use_ssl"] = True
        settings[f"{proto}_server_cert"] = certs.server_cert
        settings[f"{proto}_server_key"] = certs.server_key
        if mutual:
            settings[f"{proto}_root_cert"] = certs.ca
    return settings


@pytest.fixture(scope="module", name="tls_server", **_FRONTENDS)
def _tls_server(request: pytest.FixtureRequest, certs: Certificates) -> Iterator[ServerThread]:
    with start_worker(make_config(**_tls_settings(certs, False)), frontends=request.param) as server:
        yield server


@pytest.fixture(scope="module", name="mutual_server", **_FRONTENDS)
def _mutual_server(request: pytest.FixtureRequest, certs: Certificates) -> Iterator[ServerThread]:
    with start_worker(make_config(**_tls_settings(certs, True)), frontends=request.param) as server:
        yield server


def _grpc(url: str, certs: Certificates, cert: Path | None = None, key: Path | None = None) -> Any:
    return grpcclient.InferenceServerClient(
        url,
        ssl=True,
        root_certificates=str(certs.ca),
        private_key=None if key is None else str(key),
        certificate_chain=None if cert is None else str(cert),
    )


def _http(url: str, certs: Certificates, cert: Path | None = None, key: Path | None = None) -> Any:
    def context(*args: Any, **kwargs: Any) -> gevent.ssl.SSLContext:
        made = gevent.ssl.create_default_context(cafile=str(certs.ca))
        if cert is not None:
            made.load_cert_chain(str(cert), str(key))
        return made

    return httpclient.InferenceServerClient(url, ssl=True, ssl_context_factory=context)


def _http_infer(client: Any) -> np.ndarray:
    x = np.ones((2, 16), np.float32)
    tensor = httpclient.InferInput("INPUT0", [2, 16], "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("mlp", [tensor]).as_numpy("OUTPUT0")


def _assert_grpc_refused(client: Any) -> None:
    try:
        with pytest.raises(InferenceServerException) as raised:
            client.is_server_live(client_timeout=10)
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        client.close()


def _assert_plain_http_refused(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, http.client.BadStatusLine)):
            connection.request("GET", "/v2/health/ready")
            connection.getresponse()
    finally:
        connection.close()


def test_grpc_over_tls_serves_tritonclient(tls_server: ServerThread, certs: Certificates) -> None:
    with closing(_grpc(tls_server.url, certs)) as client:
        assert client.is_server_ready()
        assert_good_request_served(client)
    # by name too: the certificate names localhost as well as 127.0.0.1
    with closing(_grpc(f"localhost:{tls_server.grpc_port}", certs)) as client:
        assert client.is_model_ready("mlp")


def test_grpc_plain_text_client_refused(tls_server: ServerThread, certs: Certificates) -> None:
    _assert_grpc_refused(grpcclient.InferenceServerClient(tls_server.url))
    with closing(_grpc(tls_server.url, certs)) as client:
        assert_good_request_served(client)


def test_grpc_client_that_does_not_trust_the_server_refused(
    tls_server: ServerThread, certs: Certificates
) -> None:
    _assert_grpc_refused(grpcclient.InferenceServerClient(tls_server.url, ssl=True))  # system CAs only
    with closing(_grpc(tls_server.url, certs)) as client:
        assert_good_request_served(client)


def test_http_over_tls_serves_tritonclient(tls_server: ServerThread, certs: Certificates) -> None:
    client = _http(tls_server.http_url, certs)
    try:
        assert client.is_server_ready()
        assert _http_infer(client).shape == (2, 4)
    finally:
        client.close()


def test_http_plain_text_client_refused(tls_server: ServerThread, certs: Certificates) -> None:
    _assert_plain_http_refused(tls_server.worker.http_port)
    client = _http(tls_server.http_url, certs)
    try:
        assert _http_infer(client).shape == (2, 4)
    finally:
        client.close()


def test_grpc_mutual_tls(mutual_server: ServerThread, certs: Certificates) -> None:
    _assert_grpc_refused(_grpc(mutual_server.url, certs))  # no client certificate
    _assert_grpc_refused(_grpc(mutual_server.url, certs, certs.stranger_cert, certs.stranger_key))
    _assert_grpc_refused(grpcclient.InferenceServerClient(mutual_server.url))  # plain text
    with closing(_grpc(mutual_server.url, certs, certs.client_cert, certs.client_key)) as client:
        assert_good_request_served(client)


def test_http_mutual_tls(mutual_server: ServerThread, certs: Certificates) -> None:
    for cert, key in ((None, None), (certs.stranger_cert, certs.stranger_key)):
        client = _http(mutual_server.http_url, certs, cert, key)
        try:
            with pytest.raises(
                (ssl.SSLError, ConnectionError, HTTPConnectionClosed, InferenceServerException)
            ):
                client.is_server_ready()
        finally:
            client.close()
    _assert_plain_http_refused(mutual_server.worker.http_port)
    client = _http(mutual_server.http_url, certs, certs.client_cert, certs.client_key)
    try:
        assert client.is_server_ready()
        assert _http_infer(client).shape == (2, 4)
    finally:
        client.close()


def _scrape(port: int, certs: Certificates, cert: Path | None = None, key: Path | None = None) -> str:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


def test_metrics_over_tls(tls_server: ServerThread, certs: Certificates) -> None:
    """`server.metrics_use_ssl`: the metrics port serves REST's certificate; plain text is refused."""
    assert "hloserve_models_loaded" in _scrape(tls_server.worker.metrics_port, certs)
    _assert_plain_http_refused(tls_server.worker.metrics_port)


def test_metrics_mutual_tls(mutual_server: ServerThread, certs: Certificates) -> None:
    port = mutual_server.worker.metrics_port
    for cert, key in ((None, None), (certs.stranger_cert, certs.stranger_key)):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _scrape(port, certs, cert, key)
    assert "hloserve_models_loaded" in _scrape(port, certs, certs.client_cert, certs.client_key)


def test_tls_needs_certificate_and_key() -> None:
    with pytest.raises(ConfigError, match=r"^config server\.grpc_server_cert: must name a PEM file"):
        make_config(grpc_use_ssl=True)
    with pytest.raises(ConfigError, match=r"^config server\.http_root_cert: must name a PEM file of CAs"):
        make_config(http_use_ssl_mutual=True, http_server_cert=Path("c"), http_server_key=Path("k"))


def test_unreadable_certificate_is_a_config_error(tmp_path: Path, certs: Certificates) -> None:
    config = ServerConfig(
        grpc_use_ssl=True, grpc_server_cert=tmp_path / "none.pem", grpc_server_key=certs.server_key
    )
    with pytest.raises(ConfigError, match=r"^config server\.grpc_server_cert: cannot load"):
        server_context(config, "grpc")
    mismatched = ServerConfig(
        http_use_ssl=True, http_server_cert=certs.server_cert, http_server_key=certs.client_key
    )
    with pytest.raises(ConfigError, match=r"^config server\.http_server_cert: cannot load"):
        server_context(mismatched, "http")
    assert server_context(ServerConfig(), "grpc") is None


def test_flags_as_triton_names_them(certs: Certificates) -> None:
    from hloserve.cli import _apply_flags, _parser
    from hloserve.config import load_config

    argv = [
        "serve",
        "--grpc-use-ssl=true",
        f"--grpc-server-cert={certs.server_cert}",
        f"--grpc-server-key={certs.server_key}",
        "--grpc-use-ssl-mutual",
        f"--grpc-root-cert={certs.ca}",
        "--http-use-ssl",
        f"--http-server-cert={certs.server_cert}",
        f"--http-server-key={certs.server_key}",
    ]
    server = _apply_flags(load_config(environ={}), _parser().parse_args(argv)).server
    assert server.grpc_use_ssl and server.grpc_use_ssl_mutual and server.grpc_root_cert == certs.ca
    assert server.http_tls and not server.http_use_ssl_mutual and server.http_server_key == certs.server_key
    off = _parser().parse_args(["serve", "--grpc-use-ssl=false"])
    assert not _apply_flags(load_config(environ={}), off).server.grpc_tls


def test_a_client_that_never_finishes_the_handshake_is_closed(
    tls_server: ServerThread, certs: Certificates
) -> None:
    """A connection stuck before its TLS handshake is not counted as a connection yet: it is
    closed after `server.handshake_timeout_s`, on both ports."""
    for port in (tls_server.grpc_port, tls_server.worker.http_port):
        with socket.create_connection(("127.0.0.1", port), timeout=HANDSHAKE_S + 10) as idle:
            started = time.monotonic()
            try:
                assert idle.recv(1024) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < HANDSHAKE_S + 5
    with closing(_grpc(tls_server.url, certs)) as client:
        assert_good_request_served(client)
