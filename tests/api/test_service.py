"""Every built RPC through the real tritonclient against a real worker on loopback.

Tests on the `server` fixture run with 0 and 2 frontends; those starting their own worker (a bundle
made for one check) run with one process, for the suite's time: the frontends run the same service code.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.bundles import edit_manifest, write_total
from support.clients import assert_good_request_served, infer
from support.numerics import assert_close
from support.servers import EXAMPLES, ServerThread, make_config, start_worker
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from hloserve.export.jax import InputSpec, export_bundle

MLP_SIZES = (1, 2, 3, 4, 8, 13, 16, 17, 37, 100)  # compiled sizes, rows padded up to one, and split


@pytest.fixture(name="stub")
def _stub(server: ServerThread) -> Iterator[Any]:
    channel = grpc.insecure_channel(server.url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


class TestHealthAndMetadata:
    def test_live_and_ready(self, triton: Any) -> None:
        assert triton.is_server_live()
        assert triton.is_server_ready()
        assert triton.is_model_ready("mlp") and triton.is_model_ready("cnn")
        assert triton.is_model_ready("mlp", "1")
        assert not triton.is_model_ready("nope")
        assert not triton.is_model_ready("mlp", "2")

    def test_server_metadata_lists_the_extensions(self, triton: Any) -> None:
        metadata = triton.get_server_metadata()
        assert metadata.name == "hloserve"
        assert list(metadata.extensions) == [
            "model_configuration",
            "model_repository",
            "statistics",
            "system_shared_memory",
        ]

    def test_model_metadata_is_row_major_with_minus_one_for_the_batch(self, triton: Any) -> None:
        mlp = triton.get_model_metadata("mlp")
        assert (mlp.name, list(mlp.versions), mlp.platform) == ("mlp", ["1"], "stablehlo_cpu")
        assert [(t.name, t.datatype, list(t.shape)) for t in mlp.inputs] == [("INPUT0", "FP32", [-1, 16])]
        assert [(t.name, t.datatype, list(t.shape)) for t in mlp.outputs] == [("OUTPUT0", "FP32", [-1, 4])]
        cnn = triton.get_model_metadata("cnn")
        assert list(cnn.inputs[0].shape) == [-1, 16, 16, 3]

    def test_model_config_is_triton_shaped(self, triton: Any) -> None:
        config = triton.get_model_config("mlp").config
        assert config.max_batch_size == 16
        assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
            ("INPUT0", 11, [16])
        ]  # 11 = TYPE_FP32
        assert [(o.name, list(o.dims)) for o in config.output] == [("OUTPUT0", [4])]
        assert list(config.dynamic_batching.preferred_batch_size) == [1, 4, 8, 16]
        assert config.version_policy.latest.num_versions == 1  # as Triton: one version, the latest
        assert config.input[0].format == 0  # FORMAT_NONE: not an image

    def test_an_image_input_reports_its_format(self, tmp_path: Path) -> None:
        shutil.copytree(EXAMPLES / "cnn", tmp_path / "cnn")

        def nhwc(manifest: dict[str, Any]) -> None:
            manifest["executable_inputs"][0]["format"] = "NHWC"

        edit_manifest(tmp_path / "cnn", nhwc)
        server = ServerThread(make_config(tmp_path)).start()
        client = grpcclient.InferenceServerClient(server.url)
        try:
            config = client.get_model_config("cnn", as_json=True)["config"]
            assert config["input"][0]["format"] == "FORMAT_NHWC"
        finally:
            client.close()
            server.stop()

    def test_repository_index(self, triton: Any) -> None:
        index = triton.get_model_repository_index()
        assert [(m.name, m.version, m.state) for m in index.models] == [
            ("cnn", "1", "READY"),
            ("mlp", "1", "READY"),
            ("pool", "1", "READY"),
            ("severity_grader", "1", "READY"),
        ]

    def test_statistics_count_requests_rows_and_batches(self, triton: Any) -> None:
        before = triton.get_inference_statistics("mlp").model_stats[0]
        infer(triton, "mlp", {"INPUT0": np.zeros((3, 16), np.float32)})
        after = triton.get_inference_statistics("mlp").model_stats[0]
        assert after.inference_count == before.inference_count + 3
        assert after.execution_count == before.execution_count + 1
        assert after.inference_stats.success.count == before.inference_stats.success.count + 1
        assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
        assert 4 in {b.batch_size for b in after.batch_stats}  # 3 rows ran padded at size 4
        every = triton.get_inference_statistics()
        assert {s.name for s in every.model_stats} == {"cnn", "mlp", "pool", "severity_grader"}


class TestInference:
    @pytest.mark.parametrize("rows", MLP_SIZES)
    def test_mlp_equals_jax_in_process(self, triton: Any, rows: int) -> None:
        x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
        result = infer(triton, "mlp", {"INPUT0": x})
        assert_close(result.as_numpy("OUTPUT0"), reference("mlp", x))

    @pytest.mark.parametrize("rows", (1, 3, 4))
    def test_cnn_equals_jax_in_process(self, triton: Any, rows: int) -> None:
        x = np.random.default_rng(rows).random((rows, 16, 16, 3), dtype=np.float32)
        result = infer(triton, "cnn", {"IMAGE": x})
        assert_close(result.as_numpy("LOGITS"), reference("cnn", x))

    @pytest.mark.parametrize("rows", (1, 8))
    def test_pool_on_a_large_input(self, triton: Any, rows: int) -> None:
        x = np.random.default_rng(rows).random((rows, 224, 224, 3), dtype=np.float32)
        result = infer(triton, "pool", {"IMAGE": x})
        assert_close(result.as_numpy("MEAN"), x.mean(axis=(1, 2)))

    def test_typed_contents_equal_raw_contents(self, triton: Any, stub: Any) -> None:
        x = np.random.default_rng(7).random((2, 16), dtype=np.float32)
        request = service_pb2.ModelInferRequest(model_name="mlp", id="typed-1")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16])
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
        response = stub.ModelInfer(request)
        assert response.id == "typed-1"
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
            ("OUTPUT0", "FP32", [2, 4])
        ]
        typed = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 4)
        np.testing.assert_array_equal(typed, infer(triton, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0"))

    def test_requested_output_by_name(self, triton: Any) -> None:
        x = np.ones((1, 16), np.float32)
        result = infer(triton, "mlp", {"INPUT0": x}, outputs=["OUTPUT0"])
        assert result.as_numpy("OUTPUT0").shape == (1, 4)

    def test_concurrent_requests_all_answered_correctly(self, server: ServerThread) -> None:
        rng = np.random.default_rng(3)
        inputs = [rng.random((1 + i % 4, 16), dtype=np.float32) for i in range(24)]
        clients = [grpcclient.InferenceServerClient(server.url) for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(lambda i: infer(clients[i % 8], "mlp", {"INPUT0": inputs[i]}), range(len(inputs)))
            )
        for client in clients:
            client.close()
        for x, result in zip(inputs, results, strict=True):
            assert_close(result.as_numpy("OUTPUT0"), reference("mlp", x))


def _raw_request(shape: list[int], raw: bytes, datatype: str = "FP32", name: str = "INPUT0") -> Any:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


def assert_refused(triton: Any, call: Any, request: Any, code: grpc.StatusCode, says: str) -> None:
    """A raw gRPC call fails with `code` and a message containing `says`; the next request is served."""
    with pytest.raises(grpc.RpcError) as raised:
        call(request)
    assert raised.value.code() == code
    assert says in raised.value.details()
    assert_good_request_served(triton)


def assert_infer_refused(triton: Any, stub: Any, request: Any, says: str) -> None:
    """A raw ModelInfer is INVALID_ARGUMENT, saying `says`; the next request is served."""
    assert_refused(triton, stub.ModelInfer, request, grpc.StatusCode.INVALID_ARGUMENT, says)


class TestBadInput:
    """Each bad request gets its status and a message naming what was wrong; the next one is served."""

    @pytest.mark.parametrize(
        ("model", "name", "array", "status", "says"),
        [
            ("nope", "INPUT0", np.zeros((1, 16), np.float32), "NOT_FOUND", "unknown model: 'nope'"),
            (
                "mlp",
                "INPUT9",
                np.zeros((1, 16), np.float32),
                "INVALID_ARGUMENT",
                "unexpected inference input 'INPUT9' for model 'mlp': expected one of ['INPUT0']",
            ),
            ("mlp", "INPUT0", np.zeros((1, 15), np.float32), "INVALID_ARGUMENT", "axis 1 must be 16"),
            (
                "mlp",
                "INPUT0",
                np.zeros((16,), np.float32),
                "INVALID_ARGUMENT",
                "rank 1, expected [-1, 16] (rank 2)",
            ),
            ("mlp", "INPUT0", np.zeros((0, 16), np.float32), "INVALID_ARGUMENT", "batch of 0 rows"),
        ],
    )
    def test_bad_tensor(
        self, triton: Any, model: str, name: str, array: np.ndarray, status: str, says: str
    ) -> None:
        with pytest.raises(InferenceServerException) as raised:
            infer(triton, model, {name: array})
        assert raised.value.status() == f"StatusCode.{status}"
        assert says in raised.value.message()
        assert_good_request_served(triton)

    def test_wrong_datatype(self, triton: Any) -> None:
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP64")
        tensor.set_data_from_numpy(np.zeros((1, 16), np.float64))
        with pytest.raises(InferenceServerException, match="datatype 'FP64', expected 'FP32'") as raised:
            triton.infer("mlp", [tensor])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert_good_request_served(triton)

    def test_requested_output_that_does_not_exist(self, triton: Any) -> None:
        with pytest.raises(
            InferenceServerException, match=r"\] unexpected inference output 'LOGITS' for model 'mlp'"
        ) as raised:
            infer(
                triton,
                "mlp",
                {"INPUT0": np.zeros((1, 16), np.float32)},
                outputs=["LOGITS"],
            )
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert_good_request_served(triton)

    @pytest.mark.parametrize("version", ["latest", "1.0", "-1", "0", " 1", "\u0661"])
    def test_a_version_that_is_not_an_integer_above_zero_is_invalid(
        self, triton: Any, stub: Any, version: str
    ) -> None:
        """As Triton: INVALID_ARGUMENT (not NOT_FOUND), for inference, metadata and readiness."""
        request = _raw_request([1, 16], b"\0" * 64)
        request.model_version = version
        says = f"failed to get model version from specified version string {version!r}"
        assert_refused(triton, stub.ModelInfer, request, grpc.StatusCode.INVALID_ARGUMENT, says)
        metadata = service_pb2.ModelMetadataRequest(name="mlp", version=version)
        assert_refused(triton, stub.ModelMetadata, metadata, grpc.StatusCode.INVALID_ARGUMENT, says)
        ready = service_pb2.ModelReadyRequest(name="mlp", version=version)
        assert_refused(triton, stub.ModelReady, ready, grpc.StatusCode.INVALID_ARGUMENT, says)

    def test_raw_and_typed_contents_together_are_refused_for_every_input(
        self, triton: Any, stub: Any
    ) -> None:
        """The KServe V2 proto forbids the mix; accepting it silently ignored `contents`."""
        request = _raw_request([1, 16], b"\0" * 64)
        request.inputs[0].contents.fp32_contents.extend([1.0] * 16)
        assert_refused(
            triton,
            stub.ModelInfer,
            request,
            grpc.StatusCode.INVALID_ARGUMENT,
            "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'mlp'",
        )
        # an input with typed contents has no raw entry: the mix is named, not the entry count
        request.inputs.add(name="INPUT1", datatype="FP32", shape=[1, 16])
        assert_refused(
            triton,
            stub.ModelInfer,
            request,
            grpc.StatusCode.INVALID_ARGUMENT,
            "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'mlp'",
        )

    def test_responses_carry_the_served_version(self, stub: Any) -> None:
        response = stub.ModelInfer(_raw_request([1, 16], b"\0" * 64))
        assert (response.model_name, response.model_version) == ("mlp", "1")

    @pytest.mark.parametrize(("name", "version"), [("nope", ""), ("mlp", "2")])
    def test_statistics_of_an_unknown_model_or_version_are_invalid_argument(
        self, triton: Any, stub: Any, name: str, version: str
    ) -> None:
        """As Triton: the statistics asked for are not available (INVALID_ARGUMENT)."""
        request = service_pb2.ModelStatisticsRequest(name=name, version=version)
        code, says = grpc.StatusCode.INVALID_ARGUMENT, "requested statistics are not available"
        assert_refused(triton, stub.ModelStatistics, request, code, says)

    def test_unknown_version(self, triton: Any) -> None:
        with pytest.raises(InferenceServerException, match="'mlp' version 2 is not found") as raised:
            infer(triton, "mlp", {"INPUT0": np.zeros((1, 16), np.float32)}, model_version="2")
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert_good_request_served(triton)

    @pytest.mark.parametrize(
        ("request_", "says"),
        [
            (
                _raw_request([2, 16], b"\0" * (2 * 16 * 4 - 4)),
                "raw contents hold 124 bytes, shape [2, 16] of FP32 needs 128",
            ),
            (
                _raw_request([2, 16], b"\0" * (2 * 16 * 4 + 4)),
                "raw contents hold 132 bytes, shape [2, 16] of FP32 needs 128",
            ),
            (service_pb2.ModelInferRequest(model_name="mlp"), "missing input(s) ['INPUT0']"),
            (_raw_request([1, -16], b""), "negative dimension"),
        ],
    )
    def test_bad_raw_request(self, triton: Any, stub: Any, request_: Any, says: str) -> None:
        assert_infer_refused(triton, stub, request_, says)

    def test_duplicated_input(self, triton: Any, stub: Any) -> None:
        request = _raw_request([1, 16], b"\0" * 64)
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(b"\0" * 64)
        assert_infer_refused(triton, stub, request, "tensor 'INPUT0': input given more than once")

    def test_raw_contents_count_must_match_inputs(self, triton: Any, stub: Any) -> None:
        request = _raw_request([1, 16], b"\0" * 64)
        request.raw_input_contents.append(b"\0" * 64)
        assert_infer_refused(triton, stub, request, "raw_input_contents has 2 entries for 1 inputs")

    def test_typed_contents_with_the_wrong_count(self, triton: Any, stub: Any) -> None:
        request = service_pb2.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend(
            [1.0] * 3
        )
        assert_infer_refused(
            triton, stub, request, "contents.fp32_contents holds 3 values, shape [1, 16] needs 16"
        )

    @pytest.mark.parametrize(
        ("call", "request_"),
        [
            (  # the settings are answered (tests/engine/test_tracing.py); changing them is not built
                "TraceSetting",
                service_pb2.TraceSettingRequest(
                    settings={"trace_rate": service_pb2.TraceSettingRequest.SettingValue(value=["10"])}
                ),
            ),
            ("LogSettings", service_pb2.LogSettingsRequest()),
        ],
    )
    def test_rpcs_not_built_say_so(self, triton: Any, stub: Any, call: str, request_: Any) -> None:
        assert_refused(
            triton,
            getattr(stub, call),
            request_,
            grpc.StatusCode.UNIMPLEMENTED,
            f"{call} is not implemented by hloserve",
        )


def test_a_model_whose_outputs_cannot_be_joined_refuses_a_batch_larger_than_its_sizes(tmp_path: Path) -> None:
    """A batch total (no batch axis on the output) cannot be split: too many rows is INVALID_ARGUMENT."""
    write_total(tmp_path / "total")
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as raised:
            infer(client, "total", {"X": np.ones((3, 4), np.float32)})
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "batch of 3 rows exceeds the largest compiled batch size 2" in raised.value.message()
        result = infer(client, "total", {"X": np.arange(8, dtype=np.float32).reshape(2, 4)})
        np.testing.assert_array_equal(result.as_numpy("TOTAL"), [4, 6, 8, 10])
        client.close()


def test_a_bad_bundle_is_listed_not_ready_with_its_reason(tmp_path: Path) -> None:
    from support.bundles import edit_manifest, write_affine

    write_affine(tmp_path / "good")
    bad = write_affine(tmp_path / "bad")
    edit_manifest(bad, lambda m: m["executable_inputs"][0]["dims"].update(f=5))
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert (index["good"].state, index["bad"].state) == ("READY", "UNAVAILABLE")
        assert "bundle 'bad', file 'model.b1.mlir', field 'main'" in index["bad"].reason
        assert not client.is_server_ready()  # strict readiness, as Triton: every model must be ready
        assert not client.is_model_ready("bad") and client.is_model_ready("good")
        tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException, match="model 'bad' is not ready") as raised:
            client.infer("bad", [tensor])
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
        assert_close(
            client.infer("good", [tensor]).as_numpy("OUTPUT"), [[0.1 * 18 + 1, 0.1 * 22 + 1, 0.1 * 26 + 1]]
        )
        client.close()


def test_large_and_small_replies_interleave_on_one_connection(tmp_path: Path) -> None:
    """A reply that fits the flow-control window goes out in one write, a larger one frame by
    frame as the window allows. On one connection, with both kinds in flight at once, every
    reply arrives whole: held-back small replies never wait on a window they would have earned."""
    export_bundle(
        lambda params, x: x * params["scale"],
        {"scale": np.float32(2)},
        [InputSpec("X", (65536,))],
        tmp_path / "double",
        batch_sizes=(1, 4),
        verify=False,
    )
    shutil.copytree(EXAMPLES / "mlp", tmp_path / "mlp")
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)  # one channel: one HTTP/2 connection
        rng = np.random.default_rng(5)
        big = [rng.random((4, 65536), dtype=np.float32) for _ in range(12)]  # 1 MiB replies
        small = [rng.random((1, 16), dtype=np.float32) for _ in range(48)]
        with ThreadPoolExecutor(8) as pool:
            big_results = [pool.submit(infer, client, "double", {"X": x}) for x in big]
            small_results = [pool.submit(infer, client, "mlp", {"INPUT0": x}) for x in small]
            for x, future in zip(big, big_results, strict=True):
                np.testing.assert_array_equal(future.result(timeout=60).as_numpy("output_0"), x * 2)
            for x, future in zip(small, small_results, strict=True):
                assert_close(future.result(timeout=60).as_numpy("OUTPUT0"), reference("mlp", x))
        client.close()


class TestClassification:
    """Triton's classification extension: `class_count` on a requested output."""

    @staticmethod
    def _classify(client: Any, x: np.ndarray, k: int) -> list[list[str]]:
        result = infer(
            client, "mlp", {"INPUT0": x}, outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=k)]
        )
        assert result.get_output("OUTPUT0").datatype == "BYTES"
        return [[item.decode() for item in row] for row in result.as_numpy("OUTPUT0")]

    @pytest.mark.parametrize("k", [1, 3, 4, 9])
    def test_the_top_k_as_score_colon_index(self, triton: Any, k: int) -> None:
        """Per row, highest first; k past the number of classes gives them all, as Triton."""
        x = np.random.default_rng(3).random((2, 16), dtype=np.float32)
        expected = reference("mlp", x)
        rows = self._classify(triton, x, k)
        assert [len(row) for row in rows] == [min(k, 4)] * 2
        for row, y in zip(rows, expected, strict=True):
            pairs = [item.split(":") for item in row]
            assert [int(i) for _, i in pairs] == list(np.argsort(-y, kind="stable")[: min(k, 4)])
            assert_close([float(s) for s, _ in pairs], np.sort(y)[::-1][: min(k, 4)])
        assert_good_request_served(triton)

    @pytest.mark.parametrize(
        ("value", "says"),
        [(-1, "must be an integer >= 0"), ("three", "must be an integer >= 0")],
    )
    def test_a_bad_class_count_is_refused(self, triton: Any, stub: Any, value: Any, says: str) -> None:
        request = _raw_request([1, 16], b"\0" * 64)
        output = request.outputs.add(name="OUTPUT0")
        if isinstance(value, int):
            output.parameters["classification"].int64_param = value
        else:
            output.parameters["classification"].string_param = value
        assert_refused(triton, stub.ModelInfer, request, grpc.StatusCode.INVALID_ARGUMENT, says)

    def test_labels_from_the_file_the_manifest_names(self, tmp_path: Path) -> None:
        shutil.copytree(EXAMPLES / "mlp", tmp_path / "mlp")
        (tmp_path / "mlp" / "labels.txt").write_text("cat\ndog\nbird\nfish\n")

        def add_labels(manifest: dict[str, Any]) -> None:
            manifest["executable_outputs"][0]["labels"] = "labels.txt"

        edit_manifest(tmp_path / "mlp", add_labels)
        server = ServerThread(make_config(tmp_path)).start()
        client = grpcclient.InferenceServerClient(server.url)
        try:
            x = np.random.default_rng(4).random((1, 16), dtype=np.float32)
            (row,) = self._classify(client, x, 4)
            names = ["cat", "dog", "bird", "fish"]
            assert [item.split(":")[2] for item in row] == [
                names[i] for i in np.argsort(-reference("mlp", x)[0], kind="stable")
            ]
            assert_good_request_served(client)
        finally:
            client.close()
            server.stop()


def test_a_call_whose_deadline_passed_before_it_began_is_deadline_exceeded(server: ServerThread) -> None:
    """grpclib answered UNKNOWN "Internal Server Error" (its deadline check raised outside its
    wrapper); a client that retries on DEADLINE_EXCEEDED, as Triton's do, took it for a crash."""
    from support.raw_grpc import frame, raw_call

    request = service_pb2.ServerLiveRequest().SerializeToString()
    for _ in range(3):
        answer, _ = raw_call(
            server.worker.grpc_port, "ServerLive", frame(request, False), [("grpc-timeout", "1n")]
        )
        assert answer["grpc-status"] == "4", answer
    live, _ = raw_call(
        server.worker.grpc_port, "ServerLive", frame(request, False), [("grpc-timeout", "10S")]
    )
    assert live["grpc-status"] == "0"
    infer = _raw_request([1, 16], b"\0" * 64).SerializeToString()
    for _ in range(3):  # inference, whose admission read a spent budget as a full queue (UNAVAILABLE)
        answer, _ = raw_call(
            server.worker.grpc_port, "ModelInfer", frame(infer, False), [("grpc-timeout", "1n")]
        )
        assert answer["grpc-status"] == "4", answer
    answer, _ = raw_call(
        server.worker.grpc_port, "ModelInfer", frame(infer, False), [("grpc-timeout", "10S")]
    )
    assert answer["grpc-status"] == "0", answer


_TEXT_MODEL_PY = """
import numpy as np

from hloserve import NamedTensor, register_model

LABELS = np.array([b"north", b"east", b"south", b"west"], dtype=object)


def preprocess(inputs):
    texts = inputs[0].data  # BYTES [batch, 1]: one string per row
    x = np.zeros((len(texts), 16), np.float32)
    for row, (text,) in enumerate(texts):
        codes = list(text[:16])
        x[row, : len(codes)] = np.array(codes, np.float32) / 255.0
    return [NamedTensor("INPUT0", x)]


def postprocess(outputs):
    logits = outputs[0].data
    return [NamedTensor("OUTPUT0", logits), NamedTensor("LABEL", LABELS[logits.argmax(axis=1)][:, None])]


register_model("text", preprocess=preprocess, postprocess=postprocess)
"""


@pytest.fixture(scope="module", name="text")
def _text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repository = tmp_path_factory.mktemp("text")
    shutil.copytree(EXAMPLES / "mlp", repository / "text")
    (repository / "text" / "model.py").write_text(_TEXT_MODEL_PY)

    def text_tensors(manifest: dict[str, Any]) -> None:
        manifest["name"] = "text"
        manifest["client_inputs"] = [{"name": "TEXT", "dtype": "bytes", "shape": "xn", "dims": {"x": 1}}]
        manifest["client_outputs"] = [
            {"name": "OUTPUT0", "dtype": "f32", "shape": "kn", "dims": {"k": 4}},
            {"name": "LABEL", "dtype": "bytes", "shape": "xn", "dims": {"x": 1}},
        ]

    edit_manifest(repository / "text", text_tensors)
    server = ServerThread(make_config(repository)).start()
    yield server
    server.stop()


class TestBytesThroughModelPy:
    """BYTES client tensors (strings) reach preprocess as bytes and leave postprocess as BYTES."""

    @staticmethod
    def _expected(texts: list[bytes]) -> np.ndarray:
        x = np.zeros((len(texts), 16), np.float32)
        for row, text in enumerate(texts):
            x[row, : len(text[:16])] = np.frombuffer(text[:16], np.uint8) / 255.0
        return reference("mlp", x)

    def test_raw_strings_from_tritonclient(self, text: ServerThread) -> None:
        texts = [b"hello world", "caf\u00e9 \u2603".encode(), b""]
        client = grpcclient.InferenceServerClient(text.url)
        try:
            tensor = grpcclient.InferInput("TEXT", [3, 1], "BYTES")
            tensor.set_data_from_numpy(np.array(texts, dtype=object).reshape(3, 1))
            result = client.infer("text", [tensor])
            logits = result.as_numpy("OUTPUT0")
            assert_close(logits, self._expected(texts))
            labels = [b"north", b"east", b"south", b"west"]
            assert result.get_output("LABEL").datatype == "BYTES"
            assert list(result.as_numpy("LABEL")[:, 0]) == [labels[i] for i in logits.argmax(axis=1)]
            config = client.get_model_config("text").config
            assert config.input[0].data_type == 13  # TYPE_STRING, as Triton names BYTES
        finally:
            client.close()

    def test_typed_bytes_contents(self, text: ServerThread) -> None:
        request = service_pb2.ModelInferRequest(model_name="text")
        tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 1])
        tensor.contents.bytes_contents.extend([b"abc", b"xyz"])
        with grpc.insecure_channel(text.url) as channel:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        logits = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 4)
        assert_close(logits, self._expected([b"abc", b"xyz"]))

    @pytest.mark.parametrize(
        ("raw", "shape", "says"),
        [
            (b"\x05\x00\x00\x00abc", [1, 1], "raw contents end inside BYTES element 0 of 1"),
            (b"\x01\x00\x00\x00a!", [1, 1], "1 bytes past the 1 BYTES elements"),
            (b"\x00\x00\x00\x00", [1000000, 1], "too few for 1000000 BYTES elements"),
        ],
        ids=["cut short", "trailing bytes", "a million elements announced"],
    )
    def test_malformed_raw_strings(self, text: ServerThread, raw: bytes, shape: list[int], says: str) -> None:
        request = service_pb2.ModelInferRequest(model_name="text")
        request.inputs.add(name="TEXT", datatype="BYTES", shape=shape)
        request.raw_input_contents.append(raw)
        with grpc.insecure_channel(text.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.ModelInfer(request)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in raised.value.details()
            good = service_pb2.ModelInferRequest(model_name="text")
            good.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"ok")
            assert stub.ModelInfer(good).outputs[0].name == "OUTPUT0"

    def test_json_strings_over_rest(self, text: ServerThread) -> None:
        import http.client
        import json

        body = {
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1], "data": [["abc"], ["xyz"]]}]
        }
        connection = http.client.HTTPConnection("127.0.0.1", text.worker.http_port, timeout=30)
        try:
            connection.request("POST", "/v2/models/text/infer", json.dumps(body))
            response = connection.getresponse()
            answer = json.loads(response.read())
        finally:
            connection.close()
        assert response.status == 200, answer
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert_close(np.array(outputs["OUTPUT0"]["data"]).reshape(2, 4), self._expected([b"abc", b"xyz"]))
        assert outputs["LABEL"]["datatype"] == "BYTES"
        assert all(label in ("north", "east", "south", "west") for label in outputs["LABEL"]["data"])

    def test_binary_strings_over_rest(self, text: ServerThread) -> None:
        """BYTES in Triton's binary extension (a view of the body) reach model.py as the strings sent."""
        import tritonclient.http as httpclient

        texts = [b"hello world", "caf\u00e9".encode()]
        tensor = httpclient.InferInput("TEXT", [2, 1], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object).reshape(2, 1), binary_data=True)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{text.worker.http_port}")
        try:
            result = client.infer("text", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
        finally:
            client.close()
        assert_close(result.as_numpy("OUTPUT0"), self._expected(texts))
