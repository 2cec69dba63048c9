"""Restricted APIs and TLS through `hloserve node --cpu-workers 2`: Envoy terminates TLS on the
public gRPC (mutual: clients need a certificate of the node's CA) and REST ports with the node's
certificate; the workers behind it (plain text on
loopback) and the controller refuse a call without its restriction's header, which Envoy passes
through, as Triton would (gRPC UNAVAILABLE, REST 403), and serve the next one that has it."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from support.certs import Certificates, make_certificates
from support.clients import wait_until
from tritonclient.utils import InferenceServerException

from hloserve.fleet.workers import free_port

from .test_node import DIE_WITH_TEST

pytestmark = pytest.mark.slow

INFER = {"triton-grpc-protocol-infer-key": "infer-value"}
ADMIN = {"triton-grpc-protocol-admin-key": "admin-value"}


@dataclass
class SecureNode:
    process: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    certs: Certificates
    log: Path

    def client(self, certificate: bool = True) -> Any:
        return triton.InferenceServerClient(
            f"127.0.0.1:{self.grpc_port}",
            ssl=True,
            root_certificates=str(self.certs.ca),
            private_key=str(self.certs.client_key) if certificate else None,
            certificate_chain=str(self.certs.client_cert) if certificate else None,
        )

    def https(self, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, Any]:
        context = ssl.create_default_context(cafile=str(self.certs.ca))
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.http_port}{path}", body, headers, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as answer:
                data = answer.read()
                return answer.status, json.loads(data) if data else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def secure_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNode]:
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    log = tmp_path_factory.mktemp("node") / "node.log"
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.3"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*DIE_WITH_TEST, sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "2",
             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", "-1",
             "--grpc-restricted-protocol=model-repository,control:admin-key=admin-value",
             "--grpc-restricted-protocol=inference:infer-key=infer-value",
             "--http-restricted-api=model-repository:admin-key=admin-value",
             "--http-restricted-api=inference:infer-key=infer-value",
             "--grpc-use-ssl-mutual", f"--grpc-server-cert={certs.server_cert}",
             f"--grpc-server-key={certs.server_key}", f"--grpc-root-cert={certs.ca}",
             "--http-use-ssl", f"--http-server-cert={certs.server_cert}",
             f"--http-server-key={certs.server_key}"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    node = SecureNode(process, grpc_port, http_port, certs, log)

    def routable() -> bool:
        if process.poll() is not None:
            return True
        with closing(node.client()) as client:
            return bool(client.is_server_ready() and client.is_model_ready("mlp"))

    try:
        try:
            wait_until(routable, 120, "the node")
            assert process.poll() is None, "the node exited"
        except AssertionError as e:
            raise AssertionError(f"{e}; the node said:\n{log.read_text()[-4000:]}") from None
        yield node
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _mlp_inputs() -> list[triton.InferInput]:
    tensor = triton.InferInput("INPUT0", [2, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
    return [tensor]


def test_grpc_plain_text_and_clients_without_certificates_refused_by_envoy(secure_node: SecureNode) -> None:
    stranger = triton.InferenceServerClient(
        f"127.0.0.1:{secure_node.grpc_port}",
        ssl=True,
        root_certificates=str(secure_node.certs.ca),
        private_key=str(secure_node.certs.stranger_key),
        certificate_chain=str(secure_node.certs.stranger_cert),
    )
    plain = triton.InferenceServerClient(f"127.0.0.1:{secure_node.grpc_port}")
    for refused in (plain, secure_node.client(certificate=False), stranger):
        with closing(refused):
            with pytest.raises(InferenceServerException) as raised:
                refused.is_server_live(client_timeout=10)
            assert raised.value.status() == "StatusCode.UNAVAILABLE"
    with closing(secure_node.client()) as client:
        assert client.is_server_live()


def test_rest_plain_text_refused_by_envoy(secure_node: SecureNode) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", secure_node.http_port, timeout=10)
    try:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, http.client.BadStatusLine)):
            connection.request("GET", "/v2/health/ready")
            connection.getresponse()
    finally:
        connection.close()
    assert secure_node.https("GET", "/v2/health/ready")[0] == 200


def test_grpc_inference_restricted_at_the_worker_through_envoy(secure_node: SecureNode) -> None:
    with closing(secure_node.client()) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer("mlp", _mlp_inputs())
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
        assert raised.value.message() == (
            "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
        )
        assert client.infer("mlp", _mlp_inputs(), headers=INFER).as_numpy("OUTPUT0").shape == (2, 4)


def test_grpc_repository_restricted_at_the_controller(secure_node: SecureNode) -> None:
    with closing(secure_node.client()) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.get_model_repository_index()
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
        assert raised.value.message() == (
            "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
        )
        names = {m.name for m in client.get_model_repository_index(headers=ADMIN).models}
        assert "mlp" in names  # the controller's discovery passed the workers' restriction


def test_rest_over_tls_restricted_through_the_node(secure_node: SecureNode) -> None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
    )
    status, answer = secure_node.https("POST", "/v2/models/mlp/infer", body.encode())
    assert (status, answer) == (403, {"error": "This API is restricted, expecting header 'infer-key'"})
    status, answer = secure_node.https(
        "POST", "/v2/models/mlp/infer", body.encode(), **{"infer-key": "infer-value"}
    )
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 4]
    status, answer = secure_node.https("POST", "/v2/repository/index", b"{}")
    assert (status, answer) == (403, {"error": "This API is restricted, expecting header 'admin-key'"})
    status, answer = secure_node.https("POST", "/v2/repository/index", b"{}", **{"admin-key": "admin-value"})
    assert status == 200 and any(m["name"] == "mlp" for m in answer)


def test_workers_behind_envoy_get_the_restrictions_and_no_tls(tmp_path: Path) -> None:
    from hloserve.config import load_config
    from hloserve.fleet.workers import WorkerSpec, worker_child

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    config = load_config(environ={}).replace(
        "server",
        grpc_restricted_protocol=("inference:k=v", "health:h=1"),
        grpc_use_ssl=True,
        grpc_server_cert=cert,
        grpc_server_key=key,
    )
    spec = WorkerSpec("worker0", 9100, 9101, 9102, None)
    behind = worker_child(spec, config, None, public=False).env
    assert behind["HLOSERVE_SERVER_GRPC_RESTRICTED_PROTOCOL"] == "inference:k=v;health:h=1"
    assert behind["HLOSERVE_SERVER_GRPC_USE_SSL"] == "false"
    assert behind["HLOSERVE_SERVER_GRPC_SERVER_CERT"] == ""
    assert "HLOSERVE_SERVER_HTTP_USE_SSL" not in behind  # REST has no TLS: nothing to override
    alone = worker_child(spec, config, None, public=True).env
    assert alone["HLOSERVE_SERVER_GRPC_USE_SSL"] == "true" and alone[
        "HLOSERVE_SERVER_GRPC_SERVER_KEY"
    ] == str(key)
    assert "HLOSERVE_SERVER_HTTP_RESTRICTED_API" not in alone


def test_envoy_listeners_terminate_tls(tmp_path: Path) -> None:
    from hloserve.fleet import envoy

    grpc_tls = envoy.Tls(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem")
    config = envoy.bootstrap(tmp_path, "127.0.0.1", 1, 2, 3, 1 << 30, grpc_tls, None)
    public, public_http = config["static_resources"]["listeners"]
    socket = public["filter_chains"][0]["transport_socket"]["typed_config"]
    assert socket["require_client_certificate"] is True
    assert socket["common_tls_context"]["alpn_protocols"] == ["h2"]
    assert socket["common_tls_context"]["validation_context"]["trusted_ca"]["filename"] == str(
        tmp_path / "ca.pem"
    )
    assert "transport_socket" not in public_http["filter_chains"][0]


def test_gateway_restricted_as_control(secure_node: SecureNode) -> None:
    """The node's own GatewayControlService is in the `control` group (refused by Envoy, then
    by the controller); grpclib over mutual TLS as another client."""
    import asyncio

    from grpclib.client import Channel
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    from hloserve._proto import hloserve_gateway as gateway

    context = ssl.create_default_context(cafile=str(secure_node.certs.ca))
    context.load_cert_chain(str(secure_node.certs.client_cert), str(secure_node.certs.client_key))
    context.set_alpn_protocols(["h2"])

    async def status(metadata: dict[str, str] | None) -> gateway.GetSchedulingStatusResponse:
        channel = Channel("127.0.0.1", secure_node.grpc_port, ssl=context)
        try:
            stub = gateway.GatewayControlServiceStub(channel)
            return await stub.get_scheduling_status(gateway.GetSchedulingStatusRequest(), metadata=metadata)
        finally:
            channel.close()
            await asyncio.sleep(0.2)  # the TLS close_notify, then the socket's close, take loop turns

    with pytest.raises(GRPCError) as raised:
        asyncio.run(status(None))
    assert raised.value.status == Status.UNAVAILABLE
    assert (
        raised.value.message
        == "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
    )
    assert len(asyncio.run(status(ADMIN)).workers) == 2
