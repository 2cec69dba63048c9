"""`parse_viewed`: a large ModelInferRequest parsed with its tensors left in the bytes received,
against upb's parse of the same bytes; and what the server answers for one that does not parse."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from support.numerics import close
from support.servers import ServerThread
from tritonclient.grpc import service_pb2

from hloserve.api.viewed_request import VIEW_FROM_BYTES, ViewedRequest, parse_viewed


def _request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="pool", model_version="1", id="r-1")
    request.parameters["timeout"].int64_param = 5_000_000
    for name in ("a", "b"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[2, 3])
        tensor.parameters["binary_data_size"].int64_param = 24
    request.outputs.add(name="y")
    request.raw_input_contents.extend([bytes(range(24)), b"\xff" * (VIEW_FROM_BYTES + 7)])
    return request


def test_every_field_and_each_tensor_in_order_as_upb_parses_them() -> None:
    data = _request().SerializeToString()
    viewed = parse_viewed(data)
    whole = service_pb2.ModelInferRequest.FromString(data)
    assert [bytes(r) for r in viewed.raw_input_contents] == list(whole.raw_input_contents)
    assert all(isinstance(r, memoryview) and r.obj is data for r in viewed.raw_input_contents)
    assert (viewed.model_name, viewed.model_version, viewed.id) == ("pool", "1", "r-1")
    assert viewed.parameters["timeout"].int64_param == 5_000_000
    assert [(t.name, list(t.shape)) for t in viewed.inputs] == [("a", [2, 3]), ("b", [2, 3])]
    assert [o.name for o in viewed.outputs] == ["y"]


def test_tensors_between_other_fields_keep_their_order_and_the_fields_theirs() -> None:
    """Protobuf allows fields in any order: tensors first, between inputs, and last."""
    request = _request()
    raw = list(request.raw_input_contents)
    del request.raw_input_contents[:]
    first = service_pb2.ModelInferRequest(raw_input_contents=[raw[0]]).SerializeToString()
    last = service_pb2.ModelInferRequest(raw_input_contents=[raw[1]]).SerializeToString()
    data = first + request.SerializeToString() + last
    viewed = parse_viewed(data)
    assert [bytes(r) for r in viewed.raw_input_contents] == raw
    assert [t.name for t in viewed.inputs] == ["a", "b"]


def test_serialized_again_it_is_the_same_request() -> None:
    """What a frontend forwards whole to the engine (a meta model's, a client region's)."""
    data = _request().SerializeToString()
    again = service_pb2.ModelInferRequest.FromString(parse_viewed(data).SerializeToString())
    assert again == service_pb2.ModelInferRequest.FromString(data)
    rest = ViewedRequest(service_pb2.ModelInferRequest(model_name="m"), [memoryview(b"abc"), b""])
    assert list(service_pb2.ModelInferRequest.FromString(rest.SerializeToString()).raw_input_contents) == [
        b"abc",
        b"",
    ]


@pytest.mark.parametrize(
    "cut",
    [
        lambda data: data[:-1],  # the last tensor runs past the end
        lambda data: data + b"\x80",  # a tag whose varint never ends
        lambda data: data + b"\x08" + b"\xff" * 10,  # a varint of 11 bytes
        lambda data: data + b"\x12\x05ab",  # model_version (a string) runs past the end
        lambda data: b"\x00" + data,  # field 0
    ],
    ids=["tensor past the end", "endless tag", "long varint", "string past the end", "field 0"],
)
def test_wire_data_that_does_not_parse_is_a_value_error(cut: object) -> None:
    data = cut(_request().SerializeToString())  # type: ignore[operator]
    with pytest.raises(ValueError, match="malformed protobuf wire data"):
        parse_viewed(data)


def test_a_large_request_cut_short_is_invalid_argument_and_the_next_is_served(server: ServerThread) -> None:
    """Through the server: a 4.8 MB request whose tensor is cut short is INVALID_ARGUMENT
    naming the RPC, and a whole one on the same connection is served."""
    request = service_pb2.ModelInferRequest(model_name="pool")
    request.inputs.add(name="IMAGE", datatype="FP32", shape=[8, 224, 224, 3])
    request.raw_input_contents.append(np.ones((8, 224, 224, 3), np.float32).tobytes())
    data = request.SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.worker.grpc_port}") as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda message: message,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as raised:
            infer(data[:-3], timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("ModelInfer: the request body does not decode")
        assert "malformed protobuf wire data" in raised.value.details()
        answer = infer(data, timeout=30)
    mean = np.frombuffer(answer.raw_output_contents[0], np.float32)
    assert mean.size == 8 * 3 and close(mean, 1.0)
