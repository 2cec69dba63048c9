"""Inputs the server used to accept silently (or fail on as INTERNAL) are INVALID_ARGUMENT.

A timeout parameter of the wrong kind was ignored and a negative one read as "already late"; an
output requested twice was computed twice; an infinite policy weight was taken; a typed value
too wide for its tensor's type raised OverflowError. Each case asserts the status, that the
message names the problem, and that the next good request is served.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.clients import assert_serves, control
from support.servers import ServerThread
from tritonclient.grpc import service_pb2, service_pb2_grpc

from hloserve._proto import hloserve_control as hc

from .test_strings import _settle


@pytest.fixture(name="stub")
def _stub(server: ServerThread) -> Iterator[Any]:
    channel = _settle(grpc.insecure_channel(server.url))  # a typed image is a 200 KB message
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _mlp_request() -> Any:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16])
    request.raw_input_contents.append(np.ones((2, 16), np.float32).tobytes())
    return request


def _refused(stub: Any, request: Any, says: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert says in (raised.value.details() or "")


TIMEOUTS: dict[str, tuple[str, Callable[[Any], None], str]] = {
    "timeout as a string": ("timeout", lambda p: setattr(p, "string_param", "5s"), "got string_param"),
    "timeout as a bool": ("timeout", lambda p: setattr(p, "bool_param", True), "got bool_param"),
    "timeout as a double": ("timeout", lambda p: setattr(p, "double_param", 1e6), "got double_param"),
    "timeout negative": ("timeout", lambda p: setattr(p, "int64_param", -5), "got -5"),
    "ns budget as a string": (
        "hloserve_timeout_ns",
        lambda p: setattr(p, "string_param", "1000"),
        "got string_param",
    ),
    "ns budget as a double": (
        "hloserve_timeout_ns",
        lambda p: setattr(p, "double_param", 1e9),
        "got double_param",
    ),
    "ns budget negative": ("hloserve_timeout_ns", lambda p: setattr(p, "int64_param", -1), "got -1"),
    "upstream ns budget negative": ("reactant_timeout_ns", lambda p: setattr(p, "int64_param", -1), "got -1"),
}


@pytest.mark.parametrize("case", TIMEOUTS)
def test_a_timeout_parameter_must_be_a_non_negative_integer(
    case: str, stub: Any, server: ServerThread
) -> None:
    name, set_value, got = TIMEOUTS[case]
    request = _mlp_request()
    set_value(request.parameters[name])
    _refused(stub, request, f"request parameter {name!r} must be a non-negative integer")
    _refused(stub, request, got)
    assert_serves(server.url)


@pytest.mark.parametrize(
    ("name", "kind", "value"),
    [
        ("timeout", "int64_param", 0),
        ("timeout", "uint64_param", 10**7),
        ("hloserve_timeout_ns", "int64_param", 10**10),
    ],
)
def test_a_timeout_parameter_that_is_an_integer_is_served(
    stub: Any, name: str, kind: str, value: int
) -> None:
    """0 means no timeout (Triton's default); a generous budget is met."""
    request = _mlp_request()
    setattr(request.parameters[name], kind, value)
    response = stub.ModelInfer(request, timeout=10)
    assert list(response.outputs[0].shape) == [2, 4]


def test_an_output_requested_twice(stub: Any, server: ServerThread) -> None:
    request = _mlp_request()
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT0")
    _refused(stub, request, "tensor 'OUTPUT0': output requested more than once")
    assert_serves(server.url)


def test_a_typed_value_out_of_range_for_its_datatype(stub: Any, server: ServerThread) -> None:
    """uint_contents carries uint32: 300 does not fit the UINT8 image (it raised OverflowError,
    INTERNAL)."""
    request = service_pb2.ModelInferRequest(model_name="severity_grader")
    image = request.inputs.add(name="INPUT__0", datatype="UINT8", shape=[1, 224, 224])
    image.contents.uint_contents.extend([300] + [0] * (224 * 224 - 1))
    _refused(stub, request, "contents.uint_contents holds a value out of range for UINT8")
    assert_serves(server.url)


@pytest.mark.parametrize("weight", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_policy_weight_must_be_finite(weight: float, server: ServerThread) -> None:
    with pytest.raises(GRPCError) as raised:
        control(
            server,
            lambda stub: stub.set_model_policy(
                hc.SetModelPolicyRequest(name="mlp", has_weight=True, weight=weight)
            ),
        )
    assert raised.value.status == Status.INVALID_ARGUMENT
    assert f"weight must be > 0 and finite, got {weight}" in (raised.value.message or "")
    control(
        server,
        lambda stub: stub.set_model_policy(hc.SetModelPolicyRequest(name="mlp", has_weight=True, weight=1.0)),
    )
    assert_serves(server.url)
