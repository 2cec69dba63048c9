"""Restricted APIs (`server.grpc_restricted_protocol`, `server.http_restricted_api`), answered as
Triton answers them: gRPC UNAVAILABLE and REST 403, naming the header; the same call with the
header is served. One process and an engine with two frontends answer alike."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.clients import assert_good_request_served, infer
from support.servers import ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve._proto import hloserve_control as hc
from hloserve.config import load_config
from hloserve.errors import ConfigError
from hloserve.restricted import Restrictions, grpc_group, http_group

ADMIN = {"triton-grpc-protocol-admin-key": "admin-value"}
INFER = {"triton-grpc-protocol-infer-key": "infer-value"}
GRPC_RESTRICTED = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
HTTP_RESTRICTED = "This API is restricted, expecting header 'admin-key'"


@pytest.fixture(scope="module", name="restricted", params=[0, 2], ids=["frontends0", "frontends2"])
def _restricted(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker whose admin groups need an admin key, inference an inference key (both ports);
    health and metadata are open."""
    config = make_config(
        grpc_restricted_protocol=(
            "model-repository,model-config,statistics,shared-memory,control:admin-key=admin-value",
            "inference:infer-key=infer-value",
        ),
        http_restricted_api=(
            "model-repository,model-config,statistics,shared-memory:admin-key=admin-value",
            "inference:infer-key=infer-value",
        ),
    )
    with start_worker(config, frontends=request.param) as server:
        yield server


def test_grpc_restricted_groups_unavailable_naming_the_header(restricted: ServerThread) -> None:
    with closing(grpcclient.InferenceServerClient(restricted.url)) as client:
        assert client.is_server_live() and client.get_model_metadata("mlp").name == "mlp"  # open groups
        for call in (
            lambda h: client.get_model_repository_index(headers=h),
            lambda h: client.unload_model("no_such_model", headers=h),
            lambda h: client.get_model_config("mlp", headers=h),
            lambda h: client.get_inference_statistics("mlp", headers=h),
            lambda h: client.get_system_shared_memory_status(headers=h),
        ):
            for wrong in ({}, {"triton-grpc-protocol-admin-key": "wrong"}, INFER):
                with pytest.raises(InferenceServerException) as raised:
                    call(wrong)
                assert raised.value.status() == "StatusCode.UNAVAILABLE"
                assert raised.value.message() == GRPC_RESTRICTED
        assert client.get_model_config("mlp", headers=ADMIN).config.name == "mlp"
        assert [m.name for m in client.get_model_repository_index(headers=ADMIN).models]
        assert client.get_inference_statistics("mlp", headers=ADMIN).model_stats[0].name == "mlp"
        with pytest.raises(InferenceServerException) as raised:
            infer(client, "mlp", {"INPUT0": np.ones((1, 16), np.float32)}, headers=ADMIN)
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
        assert "'triton-grpc-protocol-infer-key'" in (raised.value.message() or "")
        x = np.ones((2, 16), np.float32)
        assert infer(client, "mlp", {"INPUT0": x}, headers=INFER).as_numpy("OUTPUT0").shape == (2, 4)


def test_grpc_restricted_control_service(restricted: ServerThread) -> None:
    async def status(metadata: dict[str, str] | None) -> hc.ModelControlStatusResponse:
        channel = Channel("127.0.0.1", restricted.grpc_port)
        try:
            stub = hc.ControlServiceStub(channel)
            return await stub.model_control_status(hc.ModelControlStatusRequest(), metadata=metadata)
        finally:
            channel.close()

    with pytest.raises(GRPCError) as raised:
        asyncio.run(status(None))
    assert raised.value.status == Status.UNAVAILABLE and raised.value.message == GRPC_RESTRICTED
    assert asyncio.run(status(ADMIN)) is not None


def test_http_restricted_groups_403_naming_the_header(restricted: ServerThread) -> None:
    client = httpclient.InferenceServerClient(restricted.http_url)
    try:
        assert client.is_server_ready() and client.get_model_metadata("mlp")["name"] == "mlp"
        for call in (
            lambda h: client.get_model_repository_index(headers=h),
            lambda h: client.get_model_config("mlp", headers=h),
            lambda h: client.get_inference_statistics("mlp", headers=h),
            lambda h: client.get_system_shared_memory_status(headers=h),
        ):
            for wrong in ({}, {"admin-key": "wrong"}, {"infer-key": "infer-value"}):
                with pytest.raises(InferenceServerException) as raised:
                    call(wrong)
                assert raised.value.status() == "403"
                assert raised.value.message() == HTTP_RESTRICTED
        assert client.get_model_config("mlp", headers={"Admin-Key": "admin-value"})["name"] == "mlp"
        assert client.get_inference_statistics("mlp", headers={"admin-key": "admin-value"})["model_stats"]
        x = np.ones((2, 16), np.float32)
        tensor = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as raised:
            client.infer("mlp", [tensor])
        assert raised.value.status() == "403"
        assert raised.value.message() == "This API is restricted, expecting header 'infer-key'"
        result = client.infer("mlp", [tensor], headers={"infer-key": "infer-value"})
        assert result.as_numpy("OUTPUT0").shape == (2, 4)
    finally:
        client.close()


def test_http_restricted_answer_is_json_and_never_reads_the_body(restricted: ServerThread) -> None:
    """A refused request with a body is answered and its connection closed, its body unread; one
    without a body keeps the connection for the next request."""
    port = restricted.worker.http_port
    body = json.dumps({"ready": True}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v2/repository/index", body)
        response = connection.getresponse()
        assert (response.status, response.getheader("connection")) == (403, "close")
        assert json.loads(response.read()) == {"error": HTTP_RESTRICTED}
    finally:
        connection.close()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/v2/models/mlp/config")
        response = connection.getresponse()
        assert (response.status, response.getheader("connection")) == (403, None)
        assert json.loads(response.read()) == {"error": HTTP_RESTRICTED}
        connection.request("POST", "/v2/repository/index", body, {"admin-key": "admin-value"})
        response = connection.getresponse()
        assert response.status == 200 and any(m["name"] == "mlp" for m in json.loads(response.read()))
    finally:
        connection.close()


def test_unrestricted_worker_serves_without_headers(server: ServerThread) -> None:
    with closing(grpcclient.InferenceServerClient(server.url)) as client:
        assert_good_request_served(client)
        assert client.get_model_repository_index().models


def test_groups_of_calls() -> None:
    assert grpc_group("/inference.GRPCInferenceService/ModelInfer") == "inference"
    assert grpc_group("/inference.GRPCInferenceService/ModelReady") == "health"
    assert grpc_group("/inference.GRPCInferenceService/SystemSharedMemoryRegister") == "shared-memory"
    assert grpc_group("/inference.GRPCInferenceService/RepositoryModelLoad") == "model-repository"
    assert grpc_group("/grpc.health.v1.Health/Check") == "health"
    assert grpc_group("/hloserve_control.ControlService/CompactMemory") == "control"
    assert grpc_group("/hloserve_gateway.GatewayControlService/PlaceModel") == "control"
    assert http_group("/v2") == "metadata"
    assert http_group("/v2/health/ready") == "health"
    assert http_group("/v2/models/mlp/versions/1/ready") == "health"
    assert http_group("/v2/models/mlp") == "metadata"
    assert http_group("/v2/models/mlp/infer") == "inference"
    assert http_group("/v2/models/mlp/versions/1/config") == "model-config"
    assert http_group("/v2/models/stats") == "statistics"
    assert http_group("/v2/models/mlp/stats") == "statistics"
    assert http_group("/v2/repository/models/mlp/load") == "model-repository"
    assert http_group("/v2/cudasharedmemory/status") == "shared-memory"
    assert http_group("/v2/trace/setting") == "trace"
    assert http_group("/v2/logging") == "logging"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("inference", "expected <group>,<group>,...:<key>=<value>"),
        ("inference:key", "expected <group>,<group>,...:<key>=<value>"),
        ("inference:bad key=v", "expected <group>,<group>,...:<key>=<value>"),
        ("everything:key=v", "unknown group 'everything'"),
    ],
)
def test_bad_restriction_is_a_config_error(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.grpc_restricted_protocol") as raised:
        make_config(grpc_restricted_protocol=(spec,))
    assert says in str(raised.value)


def test_group_in_two_restrictions_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"group 'health' is in more than one restriction"):
        Restrictions.http(["health:a=1", "metadata,health:b=2"])


def test_restrictions_from_environment_separated_by_semicolons() -> None:
    config = load_config(environ={"HLOSERVE_SERVER_GRPC_RESTRICTED_PROTOCOL": "health:a=1;inference:b=2"})
    assert config.server.grpc_restricted_protocol == ("health:a=1", "inference:b=2")
    rules = Restrictions.grpc(config.server.grpc_restricted_protocol).rules
    assert rules["inference"].header == "triton-grpc-protocol-b" and rules["inference"].value == "2"


def test_flags_as_triton_names_them() -> None:
    from hloserve.cli import _apply_flags, _parser

    argv = [
        "serve",
        "--grpc-restricted-protocol=model-repository,control:admin-key=admin-value",
        "--grpc-restricted-protocol",
        "inference:infer-key=infer-value",
        "--http-restricted-api=model-repository:admin-key=admin-value",
    ]
    server = _apply_flags(load_config(environ={}), _parser().parse_args(argv)).server
    assert server.grpc_restricted_protocol == (
        "model-repository,control:admin-key=admin-value",
        "inference:infer-key=infer-value",
    )
    assert server.http_restricted_api == ("model-repository:admin-key=admin-value",)


def test_restricted_by_flags_in_a_subprocess() -> None:
    """As an operator starts it: the flags reach the listening process."""
    args = ["--grpc-restricted-protocol=model-repository:admin-key=admin-value"]
    with start_worker(process="subprocess", args=args) as worker:
        with closing(grpcclient.InferenceServerClient(worker.url)) as client:
            with pytest.raises(InferenceServerException, match=GRPC_RESTRICTED):
                client.get_model_repository_index()
            assert client.get_model_repository_index(headers=ADMIN).models
            assert_good_request_served(client)


@pytest.mark.parametrize(
    "path",
    [
        "/v2",
        "/v2/health/live",
        "/v2/models/mlp/ready",
        "/v2/models/mlp/versions/1",
        "/v2/models/mlp/infer",
        "/v2/models/mlp/versions/2/config",
        "/v2/models/stats",
        "/v2/models/mlp/stats",
        "/v2/repository/index",
        "/v2/repository/models/mlp/unload",
        "/v2/systemsharedmemory/region/r/register",
        "/v2/cudasharedmemory/status",
        "/v2/trace/setting",
        "/v2/models/mlp/trace/setting",
        "/v2/logging",
        "/v2/unknown/thing",
    ],
)
def test_envoy_http_paths_sort_as_the_worker_does(path: str) -> None:
    """The regular expressions Envoy's refusal routes match name the group `http_group` does."""
    import re

    from hloserve.restricted import HTTP_PATHS

    order = ["statistics", *(g for g in HTTP_PATHS if g != "statistics")]  # as Envoy's routes
    matched = [g for g in order if re.fullmatch(HTTP_PATHS[g], path)]
    assert matched[:1] == ([] if http_group(path) is None else [http_group(path)])


@pytest.mark.parametrize(
    "method",
    [
        *(
            f"/inference.GRPCInferenceService/{m}"
            for m in (
                "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                "ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex",
                "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
                "CudaSharedMemoryRegister", "TraceSetting", "LogSettings",
            )
        ),
        "/grpc.health.v1.Health/Watch",
        "/hloserve_control.ControlService/SetModelPolicy",
        "/hloserve_gateway.GatewayControlService/GetSchedulingStatus",
    ],
)  # fmt: skip
def test_envoy_grpc_paths_sort_as_the_worker_does(method: str) -> None:
    import re

    from hloserve.restricted import GRPC_PATHS

    matched = [g for g, regex in GRPC_PATHS.items() if re.fullmatch(regex, method)]
    assert matched == [grpc_group(method)]


def test_restricted_health_covers_grpc_health_checking(worker_factory: Any) -> None:
    """Triton puts the gRPC health protocol in `health` too: a probe must send the header."""
    from hloserve._proto.grpc.health import v1 as health

    worker = worker_factory(
        make_config(grpc_restricted_protocol=("health:probe=p",), http_restricted_api=("health:probe=p",))
    )

    async def check(metadata: dict[str, str] | None) -> health.HealthCheckResponse:
        channel = Channel("127.0.0.1", worker.grpc_port)
        try:
            return await health.HealthStub(channel).check(health.HealthCheckRequest(), metadata=metadata)
        finally:
            channel.close()

    with pytest.raises(GRPCError) as raised:
        asyncio.run(check(None))
    assert raised.value.status == Status.UNAVAILABLE
    assert (
        raised.value.message == "This protocol is restricted, expecting header 'triton-grpc-protocol-probe'"
    )
    assert (
        asyncio.run(check({"triton-grpc-protocol-probe": "p"})).status
        == health.HealthCheckResponseServingStatus.SERVING
    )
    with closing(grpcclient.InferenceServerClient(worker.url)) as client:
        with pytest.raises(InferenceServerException, match="expecting header 'triton-grpc-protocol-probe'"):
            client.is_server_ready()
        assert client.is_server_ready(headers={"triton-grpc-protocol-probe": "p"})
        assert_good_request_served(client)  # inference is not restricted
    rest = httpclient.InferenceServerClient(worker.http_url)
    try:
        assert not rest.is_server_ready()  # tritonclient reads only the status of a health call
        assert rest.is_server_ready(headers={"probe": "p"})
    finally:
        rest.close()

    connection = http.client.HTTPConnection("127.0.0.1", worker.worker.http_port, timeout=30)
    try:
        connection.request("GET", "/v2/health/live")
        response = connection.getresponse()
        assert response.status == 403
        assert json.loads(response.read()) == {"error": "This API is restricted, expecting header 'probe'"}
    finally:
        connection.close()
