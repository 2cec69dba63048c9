"""The protocol definitions: generated code is current, and every field is at its public number."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
GENERATED = ROOT / "src" / "hloserve" / "_proto"


def _files(folder: Path) -> dict[str, str]:
    generated = (p for p in folder.rglob("*") if p.suffix in (".py", ".pyi"))  # code and type stubs
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(generated)}


def test_generated_code_is_current(tmp_path: Path) -> None:
    """Committed generated code equals a fresh `python proto/generate.py`."""
    subprocess.run(
        [sys.executable, str(PROTO / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    fresh, committed = _files(tmp_path), _files(GENERATED)
    assert sorted(fresh) == sorted(committed), "run `python proto/generate.py`: the file list changed"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `python proto/generate.py`: {stale} are stale"


def _descriptor_set(tmp_path: Path, *protos: str) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *protos,
        ],
        check=True,
    )
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return {f.name: f for f in files.file}


def _messages(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    found: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, messages: list[descriptor_pb2.DescriptorProto]) -> None:
        for m in messages:
            found[prefix + m.name] = m
            walk(prefix + m.name + ".", list(m.nested_type))

    walk("", list(fdp.message_type))
    return found


def _fields(message: descriptor_pb2.DescriptorProto) -> dict[str, tuple[int, int, int, str]]:
    # type names compared without their package: hot_infer.proto lives in another package
    return {
        f.name: (f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1] if f.type_name else "")
        for f in message.field
    }


def _tritonclient_file(module: object) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)  # type: ignore[attr-defined]
    return fdp


@pytest.mark.parametrize("name", ["grpc_service.proto", "model_config.proto"])
def test_messages_match_tritonclient_field_by_field(tmp_path: Path, name: str) -> None:
    """Every message and field tritonclient knows exists in ours with the same number and type."""
    from tritonclient.grpc import model_config_pb2, service_pb2

    ours = _messages(_descriptor_set(tmp_path, "grpc_service.proto")[name])
    theirs = _messages(_tritonclient_file(service_pb2 if name == "grpc_service.proto" else model_config_pb2))
    assert sorted(theirs) == sorted(ours)
    for message, descriptor in theirs.items():
        assert _fields(ours[message]) == _fields(descriptor), message


def test_rpcs_match_tritonclient(tmp_path: Path) -> None:
    from tritonclient.grpc import service_pb2

    def rpcs(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, tuple[str, str, bool, bool]]:
        (service,) = fdp.service
        return {
            m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for m in service.method
        }

    ours = _descriptor_set(tmp_path, "grpc_service.proto")["grpc_service.proto"]
    assert rpcs(ours) == rpcs(_tritonclient_file(service_pb2))
    assert ours.package == "inference" and ours.service[0].name == "GRPCInferenceService"


def test_hot_path_messages_match_the_inference_ones(tmp_path: Path) -> None:
    """hloserve_hot parses the same bytes as inference: same messages, same field numbers."""
    files = _descriptor_set(tmp_path, "grpc_service.proto", "hot_infer.proto")
    hot, full = _messages(files["hot_infer.proto"]), _messages(files["grpc_service.proto"])
    assert files["hot_infer.proto"].package == "hloserve_hot"
    assert set(hot) == {
        "InferParameter",
        "InferTensorContents",
        "ModelInferRequest",
        "ModelInferRequest.InferInputTensor",
        "ModelInferRequest.InferRequestedOutputTensor",
        "ModelInferRequest.ParametersEntry",
        "ModelInferRequest.InferInputTensor.ParametersEntry",
        "ModelInferRequest.InferRequestedOutputTensor.ParametersEntry",
        "ModelInferResponse",
        "ModelInferResponse.InferOutputTensor",
        "ModelInferResponse.ParametersEntry",
        "ModelInferResponse.InferOutputTensor.ParametersEntry",
    }
    for name, message in hot.items():
        assert _fields(message) == _fields(full[name]), name


def test_hot_messages_share_a_process_with_tritonclient() -> None:
    """Importing both does not clash in the descriptor pool, and bytes cross between them."""
    import tritonclient.grpc.service_pb2 as theirs

    from hloserve._proto import inference
    from hloserve._proto.hot import hot_infer_pb2 as hot

    request = theirs.ModelInferRequest(model_name="mlp", id="7")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(b"\0" * 64)
    request.parameters["timeout"].int64_param = 5
    parsed = hot.ModelInferRequest.FromString(request.SerializeToString())
    assert (parsed.model_name, parsed.inputs[0].name, list(parsed.inputs[0].shape)) == (
        "mlp",
        "INPUT0",
        [1, 16],
    )
    assert parsed.parameters["timeout"].int64_param == 5
    assert inference.ModelInferRequest.parse(request.SerializeToString()).id == "7"
    assert issubclass(inference.GrpcInferenceServiceBase, object)
