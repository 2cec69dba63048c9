"""The KServe V2 REST front end: tritonclient.http (sync and aio) against a real worker, answers
equal to gRPC's, JSON and binary tensors, compression, shared memory, and every bad request
answered with Triton's HTTP status and a message, the next good request served.

The `rest` fixture runs with 0 and 2 frontends (each frontend serves REST on the engine's port);
the start and shutdown tests of the single process's own REST server stay one process.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
import tritonclient.utils.shared_memory as shm
from support.clients import wait_until
from support.numerics import assert_close
from support.servers import EXAMPLES, ROOT, ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import load_config
from hloserve.errors import ConfigError
from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

LIMIT = 1 << 20  # the module server's server.max_message_bytes


def _pair(params: Any, a: Any, b: Any) -> tuple[Any, Any]:
    return a + b.astype(a.dtype) * params["k"], b * 2


WIDE = 1 << 15  # floats per row of the `wide` model: its answers are sent in pieces


def _scaled(params: Any, x: Any) -> tuple[Any]:
    return (x * params["k"],)


@pytest.fixture(scope="module", name="rest", params=[0, 2], ids=["frontends0", "frontends2"])
def _rest(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker with a two-input model, the MLP and severity grader, shared memory allowed and
    a 1 MiB body limit."""
    repository = tmp_path_factory.mktemp("repository")
    export_bundle(
        _pair,
        {"k": np.float32(0.5)},
        [InputSpec("A", (4,), np.float32, letters="f"), InputSpec("B", (4,), np.int32, letters="f")],
        repository / "pair",
        batch_sizes=(1, 2),
        outputs=[OutputSpec("SUM", letters="f"), OutputSpec("TWICE", letters="f")],
        verify=False,
    )
    export_bundle(
        _scaled,
        {"k": np.float32(2)},
        [InputSpec("X", (WIDE,), np.float32, letters="f")],
        repository / "wide",
        batch_sizes=(1, 2),
        outputs=[OutputSpec("Y", letters="f")],
        verify=False,
    )
    for name in ("mlp", "severity_grader"):
        shutil.copytree(EXAMPLES / name, repository / name)
    config = make_config(repository, allow_client_shm=True, max_message_bytes=LIMIT)
    with start_worker(config, frontends=request.param) as server:
        yield server


def _inputs(metadata: dict[str, Any], rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs fitting a model's metadata (a -1 axis gets `rows`)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in metadata["inputs"]:
        shape = [rows if d == -1 else d for d in spec["shape"]]
        dtype = {"FP32": np.float32, "INT32": np.int32, "UINT8": np.uint8}[spec["datatype"]]
        arrays[spec["name"]] = (rng.random(shape) * 100).astype(dtype)
    return arrays


_GRPC: dict[str, grpcclient.InferenceServerClient] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_grpc_clients() -> Iterator[None]:
    yield
    while _GRPC:
        _GRPC.popitem()[1].close()


def _grpc_answer(server: ServerThread, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The gRPC answer, on one channel per server (a fresh channel right after a closed one can
    be reset by the gRPC front end: a separate, known problem)."""
    client = _GRPC.get(server.url) or _GRPC.setdefault(
        server.url, grpcclient.InferenceServerClient(server.url)
    )
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _wire(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def _wire(array: np.ndarray) -> str:
    return {"float32": "FP32", "int32": "INT32", "uint8": "UINT8"}[array.dtype.name]


def _http_inputs(arrays: dict[str, np.ndarray], binary: list[bool]) -> list[httpclient.InferInput]:
    inputs = []
    for (name, array), as_binary in zip(arrays.items(), binary, strict=True):
        tensor = httpclient.InferInput(name, list(array.shape), _wire(array))
        tensor.set_data_from_numpy(array, binary_data=as_binary)
        inputs.append(tensor)
    return inputs


def _post(
    server: ServerThread, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """A raw POST; the status, the JSON (header) of the body or None, the headers (lower case)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.worker.http_port, timeout=30)
    try:
        try:
            connection.request("POST", path, body, headers or {})
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the body was read: the answer is there to read
        response = connection.getresponse()
        data = response.read()
        headers = {name.lower(): value for name, value in response.getheaders()}
        data = data[: int(headers.get("inference-header-content-length", len(data)))]
        return response.status, json.loads(data) if data else None, headers
    finally:
        connection.close()


MLP_INPUT = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}


def _assert_serves(server: ServerThread) -> None:
    """The next good request is answered."""
    status, body, _ = _post(server, "/v2/models/mlp/infer", json.dumps({"inputs": [MLP_INPUT]}).encode())
    assert status == 200, body
    assert len(body["outputs"][0]["data"]) == 4


# -- every endpoint ---------------------------------------------------------------------------


def test_health_metadata_config_stats_and_index_answer_as_grpc(server: ServerThread) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    triton = grpcclient.InferenceServerClient(server.url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata() == {
            "name": "hloserve",
            "version": triton.get_server_metadata().version,
            "extensions": list(triton.get_server_metadata().extensions),
        }
        index = client.get_model_repository_index()
        grpc_index = triton.get_model_repository_index(as_json=True)["models"]
        assert index == [{"reason": "", **m} for m in grpc_index]
        for entry in index:
            model = entry["name"]
            assert client.is_model_ready(model) and client.is_model_ready(model, "1")
            grpc_metadata = triton.get_model_metadata(model, as_json=True)
            for version in ("", "1"):
                metadata = client.get_model_metadata(model, version)
                assert metadata["inputs"] == [
                    {**t, "shape": [int(d) for d in t["shape"]]} for t in grpc_metadata["inputs"]
                ]
                assert metadata["outputs"] == [
                    {**t, "shape": [int(d) for d in t["shape"]]} for t in grpc_metadata["outputs"]
                ]
            config = client.get_model_config(model)
            grpc_config = triton.get_model_config(model, as_json=True)["config"]
            assert config["name"] == model and config["max_batch_size"] == int(
                grpc_config.get("max_batch_size", 0)
            )
            assert [i["dims"] for i in config["input"]] == [
                [int(d) for d in i["dims"]] for i in grpc_config["input"]
            ]
        assert not client.is_model_ready("no_such_model")
        stats = client.get_inference_statistics()["model_stats"]
        assert sorted(s["name"] for s in stats) == sorted(e["name"] for e in index)
        one = client.get_inference_statistics("mlp", "1")["model_stats"]
        assert [s["name"] for s in one] == ["mlp"] and "success" in one[0]["inference_stats"]
    finally:
        client.close()
        triton.close()


def test_cuda_shared_memory_cleanup_answers_as_triton_without_a_gpu(rest: ServerThread) -> None:
    """Status lists nothing and unregistering succeeds, so clients that clean up first go on."""
    client = httpclient.InferenceServerClient(rest.http_url)
    try:
        assert client.get_cuda_shared_memory_status() == []
        client.unregister_cuda_shared_memory()
        client.unregister_cuda_shared_memory("never")
    finally:
        client.close()
    _assert_serves(rest)


def test_statistics_and_metrics_are_shared_with_grpc(rest: ServerThread) -> None:
    client = httpclient.InferenceServerClient(rest.http_url)
    triton = grpcclient.InferenceServerClient(rest.url)
    try:

        def counts() -> tuple[int, int]:
            s = triton.get_inference_statistics("mlp").model_stats[0].inference_stats
            return s.success.count, s.fail.count

        before = counts()
        arrays = _inputs(client.get_model_metadata("mlp"))
        for _ in range(3):
            client.infer("mlp", _http_inputs(arrays, [True]))
        wrong = httpclient.InferInput("INPUT0", [1, 3], "FP32")
        wrong.set_data_from_numpy(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceServerException, match="INPUT0") as error:
            client.infer("mlp", [wrong])
        assert error.value.status() == "400"
        # a frontend sends its counts to the engine on a write of their own, so they arrive
        # a moment later at K=2 (bounded: the next counts message)
        want = (before[0] + 3, before[1] + 1)
        wait_until(lambda: counts() == want, 10, f"statistics counting {want}")
        assert counts() == want
    finally:
        client.close()
        triton.close()


def test_repository_load_and_unload(rest: ServerThread) -> None:
    client = httpclient.InferenceServerClient(rest.http_url)
    try:
        client.unload_model("severity_grader")
        assert not client.is_model_ready("severity_grader")
        with pytest.raises(InferenceServerException, match="unknown model") as error:
            client.get_model_metadata("severity_grader")
        assert error.value.status() == "404"
        client.load_model("severity_grader")
        assert client.is_model_ready("severity_grader")
        assert [m["name"] for m in client.get_model_repository_index(query_params=None)] == [
            "mlp",
            "pair",
            "severity_grader",
            "wide",
        ]
        with pytest.raises(InferenceServerException, match="no bundle 'nothing'") as error:
            client.load_model("nothing")
        assert error.value.status() == "404"
    finally:
        client.close()


# -- inference: every example model, JSON, binary, mixed --------------------------------------


@pytest.mark.parametrize("model", ["cnn", "mlp", "pool", "severity_grader"])
def test_every_example_model_answers_as_grpc(server: ServerThread, model: str) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        arrays = _inputs(client.get_model_metadata(model), rows=2)
        expected = _grpc_answer(server, model, arrays)
        for binary_in, binary_out in ((True, True), (False, False), (False, True), (True, False)):
            outputs = [httpclient.InferRequestedOutput(name, binary_data=binary_out) for name in expected]
            result = client.infer(model, _http_inputs(arrays, [binary_in] * len(arrays)), outputs=outputs)
            for name, want in expected.items():
                got = result.as_numpy(name)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert_close(got, want)
            kinds = {o["name"]: "parameters" in o for o in result.get_response()["outputs"]}
            assert kinds == dict.fromkeys(expected, binary_out)
    finally:
        client.close()


def test_json_and_binary_inputs_mixed_in_one_request(rest: ServerThread) -> None:
    client = httpclient.InferenceServerClient(rest.http_url)
    try:
        arrays = {
            "A": np.arange(8, dtype=np.float32).reshape(2, 4),
            "B": np.arange(8, dtype=np.int32).reshape(2, 4),
        }
        want = {"SUM": arrays["A"] + arrays["B"] * 0.5, "TWICE": arrays["B"] * 2}
        for binary in ([True, False], [False, True]):
            outputs = [
                httpclient.InferRequestedOutput("SUM", binary_data=binary[0]),
                httpclient.InferRequestedOutput("TWICE", binary_data=binary[1]),
            ]
            result = client.infer("pair", _http_inputs(arrays, binary), outputs=outputs, request_id="r7")
            assert result.get_response()["id"] == "r7"
            for name, value in want.items():
                np.testing.assert_array_equal(result.as_numpy(name), value)
        # Only TWICE asked for, nested JSON data, everything in JSON: one output back.
        body = {
            "inputs": [
                {"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [[1, 2, 3, 4]]},
                {"name": "B", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
            ],
            "outputs": [{"name": "TWICE"}],
        }
        status, answer, _ = _post(rest, "/v2/models/pair/versions/1/infer", json.dumps(body).encode())
        assert status == 200, answer
        assert answer["outputs"] == [
            {"name": "TWICE", "datatype": "INT32", "shape": [1, 4], "data": [2, 4, 6, 8]}
        ]
        # binary_data_output: every output in binary.
        body["parameters"] = {"binary_data_output": True}
        del body["outputs"]
        status, _, headers = _post(rest, "/v2/models/pair/infer", json.dumps(body).encode())
        assert status == 200 and int(headers["inference-header-content-length"]) > 0
    finally:
        client.close()


def test_large_binary_tensors_arrive_whole(rest: ServerThread) -> None:
    """A 256 KiB binary input (read into one buffer, handed on as a view) and its 256 KiB binary
    output (sent after the JSON header without joining them), equal to gRPC's answer."""
    x = np.random.default_rng(3).random((2, WIDE), dtype=np.float32)
    client = httpclient.InferenceServerClient(rest.http_url)
    try:
        for binary_output in (True, False):
            result = client.infer(
                "wide",
                _http_inputs({"X": x}, [True]),
                outputs=[httpclient.InferRequestedOutput("Y", binary_data=binary_output)],
            )
            np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)
    finally:
        client.close()
    np.testing.assert_array_equal(_grpc_answer(rest, "wide", {"X": x})["Y"], x * 2)


def test_aio_client(rest: ServerThread) -> None:
    async def main() -> None:
        client = aioclient.InferenceServerClient(rest.http_url)
        try:
            assert await client.is_server_live() and await client.is_server_ready()
            assert await client.is_model_ready("mlp")
            metadata = await client.get_model_metadata("mlp")
            assert (await client.get_model_config("mlp"))["name"] == "mlp"
            assert (await client.get_inference_statistics("mlp"))["model_stats"][0]["name"] == "mlp"
            arrays = _inputs(metadata, rows=4)
            inputs = []
            for name, array in arrays.items():
                tensor = aioclient.InferInput(name, list(array.shape), "FP32")
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            results = await asyncio.gather(*(client.infer("mlp", inputs) for _ in range(8)))
            first = results[0].as_numpy("OUTPUT0")
            assert first.shape == (4, 4)
            for result in results:  # each joined into some compiled batch size: last bits may differ
                assert_close(result.as_numpy("OUTPUT0"), first)
            assert_close(first, _grpc_answer(rest, "mlp", arrays)["OUTPUT0"])
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("request_encoding", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_encoding", [None, "gzip", "deflate"])
def test_compressed_requests_and_responses(
    rest: ServerThread, request_encoding: str | None, response_encoding: str | None
) -> None:
    client = httpclient.InferenceServerClient(rest.http_url)
    try:
        arrays = _inputs(client.get_model_metadata("mlp"), rows=2)
        result = client.infer(
            "mlp",
            _http_inputs(arrays, [True]),
            request_compression_algorithm=request_encoding,
            response_compression_algorithm=response_encoding,
        )
        assert_close(result.as_numpy("OUTPUT0"), _grpc_answer(rest, "mlp", arrays)["OUTPUT0"])
    finally:
        client.close()


def test_accept_encoding_weights_pick_the_encoding(rest: ServerThread) -> None:
    body = json.dumps({"inputs": [MLP_INPUT]}).encode()
    for accept, expected in (
        ("gzip;q=0.5, deflate", "deflate"),
        ("identity, gzip;q=0.5", None),
        ("br", None),
    ):
        status, _, headers = _post_raw_encoding(rest, body, accept)
        assert status == 200
        assert headers.get("content-encoding") == expected


def _post_raw_encoding(server: ServerThread, body: bytes, accept: str) -> tuple[int, bytes, dict[str, str]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.worker.http_port, timeout=30)
    try:
        connection.request("POST", "/v2/models/mlp/infer", body, {"Accept-Encoding": accept})
        response = connection.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


# -- shared memory ----------------------------------------------------------------------------


def test_system_shared_memory_through_http(rest: ServerThread) -> None:
    client = httpclient.InferenceServerClient(rest.http_url)
    x = np.random.default_rng(1).random((2, 16), dtype=np.float32)
    handles = []
    try:
        handles = [shm.create_shared_memory_region(n, f"/hloserve_http_{n}", 128) for n in ("in", "out")]
        shm.set_shared_memory_region(handles[0], [x])
        client.register_system_shared_memory("in", "/hloserve_http_in", 128)
        client.register_system_shared_memory("out", "/hloserve_http_out", 128)
        status = client.get_system_shared_memory_status()
        assert sorted(r["name"] for r in status) == ["in", "out"]
        assert client.get_system_shared_memory_status("in") == [
            {"name": "in", "key": "/hloserve_http_in", "offset": 0, "byte_size": 128}
        ]
        tensor = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_shared_memory("in", x.nbytes)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", 32)
        result = client.infer("mlp", [tensor], outputs=[output])
        answer = result.get_output("OUTPUT0")
        assert answer["parameters"]["shared_memory_region"] == "out" and "data" not in answer
        got = shm.get_contents_as_numpy(handles[1], np.float32, [2, 4])
        assert_close(got, _grpc_answer(rest, "mlp", {"INPUT0": x})["OUTPUT0"])
        with pytest.raises(InferenceServerException, match="exceeds") as error:
            client.register_system_shared_memory("big", "/hloserve_http_in", 4096)
        assert error.value.status() == "400"
        client.unregister_system_shared_memory("in")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_shared_memory_disabled_says_how_to_enable_it(server: ServerThread) -> None:
    status, body, _ = _post(
        server, "/v2/systemsharedmemory/region/r/register", json.dumps({"key": "/k", "byte_size": 8}).encode()
    )
    assert status == 400 and "--allow-client-shm" in body["error"]
    _assert_serves(server)


# -- every bad request: Triton's status, a message, and the server goes on -------------------


def _infer_body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _binary(header: dict[str, Any], blob: bytes) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + blob, {"Inference-Header-Content-Length": str(len(text))}


_ONES = np.ones((1, 16), np.float32).tobytes()
_BINARY_INPUT = {
    "name": "INPUT0",
    "datatype": "FP32",
    "shape": [1, 16],
    "parameters": {"binary_data_size": 64},
}

INFER = "/v2/models/mlp/infer"
SHM = "/v2/systemsharedmemory/region/r/register"
U8 = {"name": "INPUT__0", "datatype": "UINT8", "shape": [1, 224, 224, 3], "data": [300] * (224 * 224 * 3)}


def _mlp(**changes: Any) -> bytes:
    return _infer_body([{**MLP_INPUT, **changes}])


def _sized(size: Any) -> tuple[bytes, dict[str, str]]:
    return _binary({"inputs": [{**_BINARY_INPUT, "parameters": {"binary_data_size": size}}]}, _ONES)


BAD_REQUESTS = [
    ("malformed JSON", INFER, b'{"inputs": [', {}, 400, "not valid JSON"),
    ("not an object", INFER, b"[1, 2]", {}, 400, "JSON object"),
    ("no inputs", INFER, b"{}", {}, 400, "no 'inputs'"),
    ("inputs not a list", INFER, b'{"inputs": {"a": 1}}', {}, 400, "'inputs' must be an array"),
    ("shape of strings", INFER, _mlp(shape=["1", "16"]), {}, 400, "array of integers"),
    ("strings for FP32", INFER, _mlp(data=["a"] * 16), {}, 400, "JSON numbers for FP32"),
    ("null in data", INFER, _mlp(data=[None] * 16), {}, 400, "JSON numbers"),
    ("ragged data", INFER, _mlp(data=[[1, 2], [3]]), {}, 400, "ragged"),
    ("too few values", INFER, _mlp(data=[1.0] * 15), {}, 400, "holds 15 values"),
    ("no data", INFER, _infer_body([{**MLP_INPUT, "data": None}]), {}, 400, "has no 'data'"),
    ("wrong dtype", INFER, _mlp(datatype="INT32", data=[1] * 16), {}, 400, "expected 'FP32'"),
    ("unknown dtype", INFER, _mlp(datatype="STRING"), {}, 400, "unknown datatype 'STRING'"),
    ("wrong shape", INFER, _mlp(shape=[2, 8]), {}, 400, "INPUT0"),
    ("negative shape", INFER, _mlp(shape=[-1, 16]), {}, 400, "negative"),
    ("unknown input", INFER, _mlp(name="X"), {}, 400, "unexpected inference input 'X'"),
    (
        "unknown output",
        INFER,
        _infer_body([MLP_INPUT], outputs=[{"name": "N"}]),
        {},
        400,
        "unexpected inference output 'N'",
    ),
    ("bad parameter", INFER, _infer_body([MLP_INPUT], parameters={"p": [1]}), {}, 400, "parameter 'p'"),
    (
        "u8 out of range",
        "/v2/models/severity_grader/infer",
        _infer_body([U8]),
        {},
        400,
        "300 is out of range",
    ),
    ("unknown model", "/v2/models/nope/infer", _mlp(), {}, 404, "unknown model: 'nope'"),
    ("unknown version", "/v2/models/mlp/versions/7/infer", _mlp(), {}, 404, "'mlp' version 7 is not found"),
    ("binary size past the body", INFER, *_sized(128), 400, "only 64 bytes"),
    ("binary size too small", INFER, *_sized(32), 400, "32 bytes follow"),
    ("binary size a string", INFER, *_sized("64"), 400, "non-negative integer"),
    ("header past the body", INFER, b"{}", {"Inference-Header-Content-Length": "99"}, 400, "is 99"),
    ("header length not a number", INFER, b"{}", {"Inference-Header-Content-Length": "x"}, 400, "byte count"),
    ("unknown encoding", INFER, b"{}", {"Content-Encoding": "br"}, 501, "'br' is not supported"),
    ("corrupt gzip", INFER, b"not gzip", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    (
        "truncated deflate",
        INFER,
        zlib.compress(_mlp())[:-8],
        {"Content-Encoding": "deflate"},
        400,
        "truncated",
    ),
    ("gzip bomb", INFER, gzip.compress(b" " * (LIMIT + 1)), {"Content-Encoding": "gzip"}, 413, "inflates"),
    ("body over the limit", INFER, b" " * (LIMIT + 1), {}, 413, "server.max_message_bytes"),
    ("index ready not a bool", "/v2/repository/index", b'{"ready": "yes"}', {}, 400, "expected a boolean"),
    ("register without key", SHM, b'{"byte_size": 8}', {}, 400, "'key'"),
    ("register negative size", SHM, b'{"key": "/k", "byte_size": -1}', {}, 400, "'byte_size', an integer"),
    ("register unknown key", SHM, b'{"key": "/hloserve_none", "byte_size": 8}', {}, 400, "cannot open"),
    ("load unknown model", "/v2/repository/models/nothing/load", b"", {}, 404, "no bundle 'nothing'"),
    ("cuda shared memory", "/v2/cudasharedmemory/region/r/register", b"{}", {}, 501, "no CUDA shared memory"),
    ("unknown path", "/v2/nothing", b"", {}, 404, "Not Found"),
    ("wrong method", "/v2/health/live", b"", {}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "says"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_answers_its_status_and_message(
    rest: ServerThread, path: str, body: bytes, headers: dict[str, str], status: int, says: str
) -> None:
    got, answer, response_headers = _post(rest, path, body, headers)
    assert got == status, answer
    assert says in answer["error"], answer
    assert len(answer["error"]) < 400
    if status == 501 and "Content-Encoding" in headers:
        assert response_headers["accept-encoding"] == "gzip, deflate"
    _assert_serves(rest)


def test_oversized_body_is_refused_before_it_is_sent(rest: ServerThread) -> None:
    """The Content-Length alone earns the 413 Content Too Large: the body is never read (nor sent here)."""
    with socket.create_connection(("127.0.0.1", rest.worker.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 2000000000\r\nContent-Type: application/json\r\n\r\n"
        )
        reply = b""
        while b"max_message_bytes" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request body of 2000000000 bytes exceeds" in reply
    _assert_serves(rest)


def test_chunked_body_over_the_limit_is_cut_off(rest: ServerThread) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536

    connection = http.client.HTTPConnection("127.0.0.1", rest.worker.http_port, timeout=30)
    try:
        try:
            connection.request("POST", "/v2/models/mlp/infer", chunks(), encode_chunked=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the client finished sending
        response = connection.getresponse()
        assert response.status == 413
        assert "request body of more than 1048576 bytes" in json.loads(response.read())["error"]
    finally:
        connection.close()
    _assert_serves(rest)


# -- configuration ----------------------------------------------------------------------------


def test_http_port_minus_one_turns_rest_off() -> None:
    with start_worker(make_config(http_port=-1)) as server:
        assert server.worker.http_port is None
        assert grpcclient.InferenceServerClient(server.url).is_server_live()


def test_http_port_from_yaml_environment_and_flag(tmp_path: Path) -> None:
    from hloserve.cli import _apply_flags, _parser

    path = tmp_path / "hloserve.yaml"
    path.write_text("server:\n  http_port: 9100\n")
    assert load_config(path, environ={}).server.http_port == 9100
    assert load_config(path, environ={"HLOSERVE_SERVER_HTTP_PORT": "-1"}).server.http_port == -1
    flagged = _apply_flags(load_config(environ={}), _parser().parse_args(["serve", "--http-port", "9101"]))
    assert flagged.server.http_port == 9101
    assert load_config(environ={}).server.http_port == 8000  # Triton's port
    with pytest.raises(ConfigError, match=r"server\.http_port"):
        load_config(environ={"HLOSERVE_SERVER_HTTP_PORT": "-2"})


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the start fails
def test_a_taken_http_port_names_the_field(rest: ServerThread) -> None:
    with pytest.raises(RuntimeError) as error:
        start_worker(make_config(http_port=rest.worker.http_port), frontends=rest.config.server.frontends)

    def leaves(e: BaseException) -> Iterator[BaseException]:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                yield from leaves(inner)
        else:
            yield e

    (config_error,) = [e for e in leaves(error.value.__cause__) if isinstance(e, ConfigError)]
    assert "server.http_port" in str(config_error) and "cannot listen" in str(config_error)


# -- README and perf_analyzer -----------------------------------------------------------------


def test_readme_curl_examples_run(server: ServerThread) -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [c for c in re.findall(r"^(curl .+)$", readme, re.MULTILINE) if "localhost:8000" in c]
    assert len(commands) >= 3, "the README shows curl against localhost:8000"
    for command in commands:
        command = command.replace("localhost:8000", f"127.0.0.1:{server.worker.http_port}")
        result = subprocess.run(
            ["bash", "-c", command + " --fail --silent --show-error"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, (command, result.stderr)
        if result.stdout.strip():
            json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 16])
def test_perf_analyzer_over_http(server: ServerThread, concurrency: int) -> None:
    sys.path.insert(0, str(ROOT / "benches"))
    from perf_analyzer import perf_analyzer_path, run_perf_analyzer

    assert perf_analyzer_path() is not None, "run `python benches/perf_analyzer.py --install`"
    result = run_perf_analyzer(
        ["-m", "mlp", "-u", server.http_url, "-i", "http", "--measurement-interval", "1000",
         "--concurrency-range", f"{concurrency}:{concurrency}", "-s", "100", "--max-trials", "10"],
        timeout=180,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "error" not in output.lower(), output
    assert f"Request concurrency: {concurrency}" in output and "Server:" in output


def test_shutdown_closes_rest_promptly_with_an_idle_connection_open() -> None:
    server = start_worker(make_config())
    port = server.worker.http_port
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    idle.request("HEAD", "/v2/health/ready")  # a load balancer's probe, then the connection idles
    probe = idle.getresponse()
    probe.read()
    assert probe.status == 200
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 5
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_classification_answers_strings_in_json(rest: ServerThread) -> None:
    body = {"inputs": [MLP_INPUT], "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]}
    status, answer, _ = _post(rest, INFER, json.dumps(body).encode())
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert (output["datatype"], output["shape"]) == ("BYTES", [1, 2])
    scores = [float(item.split(":")[0]) for item in output["data"]]
    assert scores == sorted(scores, reverse=True) and all(
        int(i.split(":")[1]) in range(4) for i in output["data"]
    )
    _assert_serves(rest)
