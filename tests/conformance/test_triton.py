"""The same calls against hloserve and Triton 2.51: statuses, response fields and shapes agree.

Message texts are not compared (hloserve's say more). Where hloserve differs on purpose, the
test says why and asserts hloserve's own answer instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from support.numerics import assert_close
from support.raw_grpc import frame, raw_call
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from benches.peers.models import MLP, reference, sample
from conformance.conftest import DOUBLED_SHAPE, DTYPES, IDENTITY

pytestmark = pytest.mark.slow


def both(clients: dict[str, Any], call: Callable[[Any], Any]) -> dict[str, tuple[str, Any]]:
    """`call(client)` on each server: ("OK", result) or (status, exception)."""
    outcomes = {}
    for name, client in clients.items():
        try:
            outcomes[name] = ("OK", call(client))
        except InferenceServerException as e:
            outcomes[name] = (str(e.status()).removeprefix("StatusCode."), e)
    return outcomes


def same_status(clients: dict[str, Any], call: Callable[[Any], Any]) -> dict[str, Any]:
    """Both servers answer `call` with the same status; the results by server."""
    outcomes = both(clients, call)
    statuses = {name: status for name, (status, _) in outcomes.items()}
    assert statuses["hloserve"] == statuses["triton"], outcomes
    return {name: result for name, (_, result) in outcomes.items()}


def raw_both(servers: dict[str, str], rpc: str, request: Any) -> dict[str, tuple[grpc.StatusCode, Any]]:
    """A raw gRPC call on each server: (code, reply or None)."""
    outcomes = {}
    for name, url in servers.items():
        with grpc.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                outcomes[name] = (grpc.StatusCode.OK, getattr(stub, rpc)(request, timeout=30))
            except grpc.RpcError as e:
                outcomes[name] = (e.code(), None)
    assert outcomes["hloserve"][0] == outcomes["triton"][0], outcomes
    return outcomes


def mlp_input(x: np.ndarray) -> Any:
    tensor = grpcclient.InferInput(MLP.input, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def mlp_request(rows: int = 2, raw: bool = True) -> Any:
    x = sample(MLP, batch=rows)
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name=MLP.input, datatype="FP32", shape=list(x.shape))
    if raw:
        request.raw_input_contents.append(x.tobytes())
    else:
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return request


# -- health, metadata, config -------------------------------------------------------------


def test_health(clients: dict[str, Any]) -> None:
    for call in (
        lambda c: c.is_server_live(),
        lambda c: c.is_server_ready(),
        lambda c: c.is_model_ready("mlp"),
        lambda c: c.is_model_ready("mlp", "1"),
        lambda c: c.is_model_ready("nope"),
        lambda c: c.is_model_ready("mlp", "2"),
    ):
        results = same_status(clients, call)
        assert results["hloserve"] == results["triton"]


def test_server_metadata_lists_only_extensions_triton_has(clients: dict[str, Any]) -> None:
    results = same_status(clients, lambda c: c.get_server_metadata())
    assert set(results["hloserve"].extensions) <= set(results["triton"].extensions)
    assert results["hloserve"].name == "hloserve"  # on purpose: its own name and version


def test_model_metadata(clients: dict[str, Any]) -> None:
    results = same_status(clients, lambda c: c.get_model_metadata("mlp"))

    def tensors(m: Any) -> list[Any]:
        return [(t.name, t.datatype, list(t.shape)) for t in (*m.inputs, *m.outputs)]

    assert tensors(results["hloserve"]) == tensors(results["triton"])
    assert list(results["hloserve"].versions) == list(results["triton"].versions) == ["1"]
    # platform differs on purpose: "stablehlo_cpu" names what runs, Triton's names its backend


@pytest.mark.parametrize("version", ["", "1", "2", "abc", "-1"])
@pytest.mark.parametrize("rpc", ["metadata", "config", "ready", "statistics", "infer"])
def test_versions(clients: dict[str, Any], rpc: str, version: str) -> None:
    calls = {
        "metadata": lambda c: c.get_model_metadata("mlp", version),
        "config": lambda c: c.get_model_config("mlp", version),
        "ready": lambda c: c.is_model_ready("mlp", version),
        "statistics": lambda c: c.get_inference_statistics("mlp", version),
        "infer": lambda c: c.infer("mlp", [mlp_input(sample(MLP))], model_version=version),
    }
    results = same_status(clients, calls[rpc])
    if rpc == "ready" and isinstance(results["triton"], bool):
        assert results["hloserve"] == results["triton"]
    if rpc == "infer" and not isinstance(results["hloserve"], Exception):
        assert (
            results["hloserve"].get_response().model_version == results["triton"].get_response().model_version
        )


@pytest.mark.parametrize("model", ["nope", ""])
@pytest.mark.parametrize("rpc", ["metadata", "config", "statistics", "infer"])
def test_unknown_model(clients: dict[str, Any], rpc: str, model: str) -> None:
    calls = {
        "metadata": lambda c: c.get_model_metadata(model),
        "config": lambda c: c.get_model_config(model),
        "statistics": lambda c: (
            c.get_inference_statistics(model) if model else c.get_inference_statistics("nope")
        ),
        "infer": lambda c: c.infer(model, [mlp_input(sample(MLP))]),
    }
    same_status(clients, calls[rpc])


def test_model_config(clients: dict[str, Any]) -> None:
    results = same_status(clients, lambda c: c.get_model_config("mlp"))
    ours, theirs = results["hloserve"].config, results["triton"].config
    assert (ours.name, ours.max_batch_size) == (theirs.name, theirs.max_batch_size)
    assert ours.version_policy == theirs.version_policy
    assert [t.format for t in ours.input] == [t.format for t in theirs.input]
    for a, b in ((ours.input, theirs.input), (ours.output, theirs.output)):
        assert [(t.name, t.data_type, list(t.dims)) for t in a] == [
            (t.name, t.data_type, list(t.dims)) for t in b
        ]


def test_a_model_without_a_batch_axis(clients: dict[str, Any]) -> None:
    """Triton's max_batch_size 0: config and metadata shapes are whole (no -1), a request is
    the whole tensor, and a request with a batch axis added is refused by both."""
    results = same_status(clients, lambda c: c.get_model_config("doubled"))
    ours, theirs = results["hloserve"].config, results["triton"].config
    assert ours.max_batch_size == theirs.max_batch_size == 0
    for a, b in ((ours.input, theirs.input), (ours.output, theirs.output)):
        assert [(t.name, t.data_type, list(t.dims)) for t in a] == [
            (t.name, t.data_type, list(t.dims)) for t in b
        ]
    results = same_status(clients, lambda c: c.get_model_metadata("doubled"))
    shapes = {n: [list(t.shape) for t in (*m.inputs, *m.outputs)] for n, m in results.items()}
    assert shapes["hloserve"] == shapes["triton"] == [list(DOUBLED_SHAPE)] * 2
    x = np.arange(8, dtype=np.float32).reshape(DOUBLED_SHAPE)

    def infer(shape: tuple[int, ...]) -> Callable[[Any], Any]:
        tensor = grpcclient.InferInput("INPUT", list(shape), "FP32")
        tensor.set_data_from_numpy(x.reshape(shape))
        return lambda c: c.infer("doubled", [tensor]).as_numpy("OUTPUT")

    for answer in same_status(clients, infer(DOUBLED_SHAPE)).values():
        np.testing.assert_array_equal(answer, 2 * x)
    same_status(clients, infer((1, *DOUBLED_SHAPE)))
    same_status(clients, infer(DOUBLED_SHAPE))


def test_statistics(clients: dict[str, Any]) -> None:
    same_status(clients, lambda c: c.infer("mlp", [mlp_input(sample(MLP))]))
    results = same_status(clients, lambda c: c.get_inference_statistics("mlp"))
    for name in results:
        (stats,) = results[name].model_stats
        assert (stats.name, stats.version) == ("mlp", "1")
        assert stats.inference_stats.success.count >= 1 and stats.inference_count >= 1


# -- repository -------------------------------------------------------------------------------


def test_index_load_and_unload(clients: dict[str, Any], servers: dict[str, str]) -> None:
    def index(c: Any) -> list[tuple[str, str]]:
        return sorted((m.name, m.state) for m in c.get_model_repository_index().models)

    results = same_status(clients, index)
    assert results["hloserve"] == results["triton"]
    try:
        same_status(clients, lambda c: c.unload_model("identity"))
        for _ in range(100):  # Triton unloads in the background (UNLOADING), hloserve at once
            if ("identity", "UNLOADING") not in index(clients["triton"]):
                break
            time.sleep(0.05)
        same_status(clients, lambda c: c.is_model_ready("identity"))
        results = same_status(clients, index)
        assert results["hloserve"] == results["triton"]  # the unloaded model is still listed
        ready = raw_both(servers, "RepositoryIndex", service_pb2.RepositoryIndexRequest(ready=True))
        assert [m.name for m in ready["hloserve"][1].models] == [m.name for m in ready["triton"][1].models]
    finally:
        same_status(clients, lambda c: c.load_model("identity"))
    assert same_status(clients, lambda c: c.is_model_ready("identity")) == {"hloserve": True, "triton": True}


@pytest.mark.parametrize(
    ("name", "config", "ours"),
    [
        ("no_such_model", None, "NOT_FOUND"),
        ("mlp", "{not json", "INVALID_ARGUMENT"),
        ("mlp", '{"input": [{"name": "EXTRA", "data_type": "TYPE_FP32", "dims": [1]}]}', "INVALID_ARGUMENT"),
    ],
    ids=["unknown model", "malformed config", "config changing the tensors"],
)
def test_load_refusals(clients: dict[str, Any], name: str, config: str | None, ours: str) -> None:
    """On purpose, hloserve's statuses say whose fault it is where Triton answers INTERNAL (no
    such model, malformed config); a config that changes the tensors is INVALID_ARGUMENT naming
    the field (a bundle's tensors are fixed by its manifest; Triton would rewrite its Python
    model's, so it is not sent to Triton)."""
    called = {"hloserve": clients["hloserve"]} if "EXTRA" in (config or "") else clients
    outcomes = both(called, lambda c: c.load_model(name, config=config))
    assert outcomes["hloserve"][0] == ours, outcomes
    if "triton" in outcomes:
        assert outcomes["triton"][0] == "INTERNAL", outcomes
    same_status(clients, lambda c: c.infer("mlp", [mlp_input(sample(MLP))]))


def test_unload_unknown_model(clients: dict[str, Any]) -> None:
    outcomes = both(clients, lambda c: c.unload_model("no_such_model"))
    # Triton answers OK (nothing to unload); hloserve on purpose says NOT_FOUND, naming the model,
    # so that a typo is not taken for success.
    assert outcomes["triton"][0] == "OK"
    assert outcomes["hloserve"][0] == "NOT_FOUND"


# -- shared memory ----------------------------------------------------------------------------


def test_system_shared_memory(clients: dict[str, Any]) -> None:
    x = sample(MLP, batch=2)
    handles = []
    try:
        for name, client in clients.items():
            client.unregister_system_shared_memory()
            region_in = shm.create_shared_memory_region(f"in_{name}", f"/conformance_in_{name}", x.nbytes)
            region_out = shm.create_shared_memory_region(f"out_{name}", f"/conformance_out_{name}", 2 * 4 * 4)
            handles += [region_in, region_out]
            shm.set_shared_memory_region(region_in, [x])
            client.register_system_shared_memory(f"in_{name}", f"/conformance_in_{name}", x.nbytes)
            client.register_system_shared_memory(f"out_{name}", f"/conformance_out_{name}", 32)
            tensor = grpcclient.InferInput(MLP.input, [2, 16], "FP32")
            tensor.set_shared_memory(f"in_{name}", x.nbytes)
            output = grpcclient.InferRequestedOutput(MLP.output)
            output.set_shared_memory(f"out_{name}", 32)
            result = client.infer("mlp", [tensor], outputs=[output])
            assert list(result.get_output(MLP.output).shape) == [2, 4]
            y = shm.get_contents_as_numpy(region_out, np.float32, [2, 4])
            assert_close(y, reference(MLP, x))
            status = client.get_system_shared_memory_status()
            assert sorted(status.regions) == [f"in_{name}", f"out_{name}"]
        outcomes = both(clients, lambda c: c.register_system_shared_memory("bad", "/conformance_none", 64))
        # On purpose: a key that does not exist is the client's error (INVALID_ARGUMENT), where
        # Triton answers INTERNAL.
        assert (outcomes["hloserve"][0], outcomes["triton"][0]) == ("INVALID_ARGUMENT", "INTERNAL")
        same_status(clients, lambda c: c.get_system_shared_memory_status("never_registered"))
    finally:
        for client in clients.values():
            client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
    results = same_status(clients, lambda c: c.get_system_shared_memory_status())
    assert not results["hloserve"].regions and not results["triton"].regions


def test_cuda_shared_memory_without_a_gpu(clients: dict[str, Any]) -> None:
    """Clients clean up first: status and unregister answer as Triton does with no region."""
    results = same_status(clients, lambda c: c.get_cuda_shared_memory_status())
    assert not results["hloserve"].regions and not results["triton"].regions
    same_status(clients, lambda c: c.unregister_cuda_shared_memory())
    # Register: both refuse (there is no GPU here); Triton's status depends on how it was built,
    # hloserve's is UNIMPLEMENTED: it has no CUDA shared memory at all.
    outcomes = both(clients, lambda c: c.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64))
    assert outcomes["hloserve"][0] == "UNIMPLEMENTED" and outcomes["triton"][0] != "OK", outcomes


# -- inference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_inference(servers: dict[str, str], raw: bool) -> None:
    outcomes = raw_both(servers, "ModelInfer", mlp_request(raw=raw))
    ours, theirs = outcomes["hloserve"][1], outcomes["triton"][1]
    assert [(t.name, t.datatype, list(t.shape)) for t in ours.outputs] == [
        (t.name, t.datatype, list(t.shape)) for t in theirs.outputs
    ]
    assert (ours.model_name, ours.model_version) == (theirs.model_name, theirs.model_version)
    a, b = (np.frombuffer(r.raw_output_contents[0], np.float32) for r in (ours, theirs))
    assert_close(a, b)


def _bad_requests() -> dict[str, Any]:
    mixed = mlp_request()
    mixed.inputs[0].contents.fp32_contents.extend([0.0] * 32)
    wrong_type = mlp_request()
    wrong_type.inputs[0].datatype = "FP64"
    wrong_shape = mlp_request()
    wrong_shape.inputs[0].shape[:] = [2, 15]
    unknown_input = mlp_request()
    unknown_input.inputs[0].name = "INPUT9"
    missing = service_pb2.ModelInferRequest(model_name="mlp")
    short_raw = mlp_request()
    short_raw.raw_input_contents[0] = short_raw.raw_input_contents[0][:-4]
    short_typed = mlp_request(raw=False)
    del short_typed.inputs[0].contents.fp32_contents[-1]
    unknown_output = mlp_request()
    unknown_output.outputs.add(name="LOGITS")
    too_many_rows = mlp_request(rows=17)
    return {
        "raw and typed contents": mixed,
        "wrong datatype": wrong_type,
        "wrong shape": wrong_shape,
        "unknown input": unknown_input,
        "missing input": missing,
        "raw contents short": short_raw,
        "typed contents short": short_typed,
        "unknown output": unknown_output,
        "more rows than max_batch_size": too_many_rows,
    }


@pytest.mark.parametrize("case", [c for c in _bad_requests() if c != "more rows than max_batch_size"])
def test_bad_inference(servers: dict[str, str], case: str) -> None:
    raw_both(servers, "ModelInfer", _bad_requests()[case])
    raw_both(servers, "ModelInfer", mlp_request())


def test_more_rows_than_max_batch_size(servers: dict[str, str]) -> None:
    """On purpose: hloserve splits a request larger than its largest compiled batch into
    executions (ModelConfig's max_batch_size is what one execution takes); Triton refuses it."""
    request = _bad_requests()["more rows than max_batch_size"]
    for name, url in servers.items():
        with grpc.insecure_channel(url) as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            if name == "triton":
                with pytest.raises(grpc.RpcError) as raised:
                    call(request, timeout=30)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            else:
                assert list(call(request, timeout=30).outputs[0].shape) == [17, 4]


_TYPED = {
    "BOOL": "bool_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "UINT64": "uint64_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
}  # fmt: skip


def _identity_request(model: str, raw: bool, rows: int = 2) -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    request = service_pb2.ModelInferRequest(model_name=model)
    arrays = {}
    for wire in IDENTITY[model]:
        array = (rng.random((rows, 4)) * 100).astype(DTYPES[wire])
        arrays[wire] = array
        tensor = request.inputs.add(name=f"INPUT_{wire}", datatype=wire, shape=[rows, 4])
        if raw:
            request.raw_input_contents.append(array.tobytes())
        else:
            getattr(tensor.contents, _TYPED[wire]).extend(array.ravel().tolist())
    return request, arrays


@pytest.mark.parametrize(
    ("model", "raw"),
    [("identity", True), ("identity", False), ("identity_fp16", True)],
    ids=["raw", "typed", "fp16 raw (no typed field)"],
)
def test_every_datatype(servers: dict[str, str], model: str, raw: bool) -> None:
    request, arrays = _identity_request(model, raw)
    outcomes = raw_both(servers, "ModelInfer", request)
    for name, (_, reply) in outcomes.items():
        contents = reply.raw_output_contents
        got = {
            t.name: (t.datatype, list(t.shape), data) for t, data in zip(reply.outputs, contents, strict=True)
        }
        for wire, array in arrays.items():
            datatype, shape, data = got[f"OUTPUT_{wire}"]
            assert (datatype, shape) == (wire, [2, 4]), name
            np.testing.assert_array_equal(np.frombuffer(data, DTYPES[wire]).reshape(2, 4), array)


@pytest.mark.parametrize("wire", list(DTYPES))
def test_a_wrong_datatype_per_datatype(servers: dict[str, str], wire: str) -> None:
    model = "identity_fp16" if wire == "FP16" else "identity"
    request, _ = _identity_request(model, raw=True)
    request.inputs[IDENTITY[model].index(wire)].datatype = "FP64" if wire != "FP64" else "FP32"
    raw_both(servers, "ModelInfer", request)


@pytest.mark.parametrize("k", [1, 3, 9])
def test_class_count(clients: dict[str, Any], k: int) -> None:
    x = sample(MLP, batch=2)
    results = same_status(
        clients,
        lambda c: c.infer(
            "mlp", [mlp_input(x)], outputs=[grpcclient.InferRequestedOutput(MLP.output, class_count=k)]
        ),
    )
    answers = {}
    for name, result in results.items():
        output = result.get_output(MLP.output)
        assert output.datatype == "BYTES", name
        answers[name] = [[item.decode().split(":") for item in row] for row in result.as_numpy(MLP.output)]
    assert [[int(i) for _, i, *_ in row] for row in answers["hloserve"]] == [
        [int(i) for _, i, *_ in row] for row in answers["triton"]
    ]
    assert_close(
        [[float(s) for s, *_ in row] for row in answers["hloserve"]],
        [[float(s) for s, *_ in row] for row in answers["triton"]],
    )


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compression(clients: dict[str, Any], compression: str) -> None:
    x = sample(MLP, batch=3)
    results = same_status(
        clients, lambda c: c.infer("mlp", [mlp_input(x)], compression_algorithm=compression)
    )
    for result in results.values():
        assert_close(result.as_numpy(MLP.output), reference(MLP, x))


def test_deadline(servers: dict[str, str]) -> None:
    """A call whose gRPC deadline passed before it arrived (grpc-timeout of 1 ns), and one with
    a generous deadline, sent over raw HTTP/2 so that the client's clock plays no part."""
    answers = {}
    for name, url in servers.items():
        port = int(url.rpartition(":")[2])
        expired, _ = raw_call(port, "ServerLive", frame(b"", False), [("grpc-timeout", "1n")])
        served, _ = raw_call(port, "ServerLive", frame(b"", False), [("grpc-timeout", "10S")])
        answers[name] = (expired.get("grpc-status", "reset"), served["grpc-status"])
    # On purpose hloserve drops work nobody waits for (DEADLINE_EXCEEDED, 4); Triton runs it.
    assert answers["hloserve"] == ("4", "0"), answers
    assert answers["triton"][1] == "0", answers


def test_messages_clients_match_on_begin_as_triton_s(servers: dict[str, str]) -> None:
    """Triton's clients match on a few messages (unknown model, version, input, output): ours
    begin with Triton's whole message, then say more."""
    unknown_model = mlp_request()
    unknown_model.model_name = "nope"
    unknown_version = mlp_request()
    unknown_version.model_version = "2"
    unknown_input = mlp_request()
    unknown_input.inputs[0].name = "INPUT9"
    unknown_output = mlp_request()
    unknown_output.outputs.add(name="LOGITS")
    for request in (unknown_model, unknown_version, unknown_input, unknown_output):
        details = {}
        for name, url in servers.items():
            with grpc.insecure_channel(url) as channel, pytest.raises(grpc.RpcError) as raised:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
            details[name] = raised.value.details()
        assert details["hloserve"].startswith(details["triton"]), details
