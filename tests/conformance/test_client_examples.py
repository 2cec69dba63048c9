"""Triton's own client examples, unedited, against hloserve serving the models they expect.

The examples come from triton-inference-server/client at the commit of Triton 2.51's release line
(r24.10, the conformance peer's), fetched once into .tools/triton_client_examples/ and checked
against their SHA-256, so what runs is byte for byte what Triton ships. The project may not
ship their text, and no package index carries it: a machine that cannot reach GitHub (CI's) reports
that test as skipped, with the path to place the file at by hand, and
`test_the_model_control_example_s_calls_in_order` makes the same calls and checks there.

`simple_grpc_model_control.py` wants a repository of eight models, one of them `simple` (Triton's
example model: INPUT0 and INPUT1, INT32 [16], OUTPUT0 their sum and OUTPUT1 their difference,
`max_batch_size` 8), which it loads, reloads with `{"max_batch_size": "16"}` (ModelConfig must
say 16 after), unloads, and a model that does not exist, which must fail to load.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support.servers import ROOT, Worker, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

COMMIT = "06344caed307d019c2a38ae3bf3677572e77903d"
"""triton-inference-server/client's last change to the examples below before r24.10."""
EXAMPLES = {
    "simple_grpc_model_control.py": "494c584a378bf3e1838aa72b8af947ae1a4f36a8ce42e976b313f0be8009629c"
}
CACHE = ROOT / ".tools" / "triton_client_examples" / COMMIT
SIMPLE_SIZES = (1, 2, 4, 8)


def _example(name: str) -> Path:
    """Triton's example `name`, fetched at COMMIT once, its SHA-256 checked every time."""
    path = CACHE / name
    if not path.is_file():
        url = f"https://raw.githubusercontent.com/triton-inference-server/client/{COMMIT}/src/python/examples/{name}"
        print(f"\nfetching Triton's client example {url}", file=sys.stderr)
        try:
            with urllib.request.urlopen(url, timeout=20) as response:
                body = response.read(1 << 20)
        except OSError as e:  # no route to GitHub: reported, and the calls are checked without it
            pytest.skip(f"Triton's {name} cannot be fetched ({e}); place it at {path}")
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == EXAMPLES[name], f"{path} is not Triton's {name} at {COMMIT} (sha256 {digest})"
    return path


def _simple(params: Any, a: Any, b: Any) -> Any:
    return a + b, a - b


def _write_simple(directory: Path) -> Path:
    """Triton's example model `simple`, compiled at 1, 2, 4 and 8 rows."""
    return export_bundle(
        _simple,
        {},
        [InputSpec("INPUT0", (16,), np.int32), InputSpec("INPUT1", (16,), np.int32)],
        directory,
        batch_sizes=SIMPLE_SIZES,
        outputs=[OutputSpec("OUTPUT0"), OutputSpec("OUTPUT1")],
        verify=False,  # a fixture; the exporter's own tests verify
    )


@pytest.fixture(scope="module", name="server")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker on eight bundles, as Triton's example repository holds eight models."""
    repository = tmp_path_factory.mktemp("triton_examples")
    _write_simple(repository / "simple")
    for name in (
        "simple_int8",
        "simple_string",
        "simple_identity",
        "simple_sequence",
        "simple_dyna_sequence",
    ):
        _write_simple(repository / name)
    for name in ("inception_graphdef", "densenet_onnx"):
        _write_simple(repository / name)
    with start_worker(make_config(repository)) as server:
        yield server


def test_simple_grpc_model_control_passes_unedited(server: Worker) -> None:
    ran = subprocess.run(
        [sys.executable, str(_example("simple_grpc_model_control.py")), "-u", server.url],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip().splitlines()[-1] == "PASS: model control"


def test_the_model_control_example_s_calls_in_order(server: Worker) -> None:
    """What `simple_grpc_model_control.py` asks and checks, written out: the index of eight, a
    load, an override that is not JSON refused as "failed to load", the override of 16 read back,
    an unload, and a model that does not exist refused as "failed to load"."""
    client = grpcclient.InferenceServerClient(server.url)
    assert len(client.get_model_repository_index().models) == 8
    client.load_model("simple")
    assert client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as malformed:
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    assert "failed to load" in str(malformed.value.message())
    client.load_model("simple", config='{"max_batch_size":"16"}')
    assert client.get_model_config("simple").config.max_batch_size == 16
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as missing:
        client.load_model("wrong_model_name")
    assert "failed to load" in str(missing.value.message())
    client.load_model("simple")  # as the module's other tests expect it
    assert client.is_model_ready("simple")


def _simple_request(rows: int) -> tuple[list[grpcclient.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    b = np.ones((rows, 16), np.int32)
    inputs = [
        grpcclient.InferInput("INPUT0", [rows, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [rows, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def test_a_load_s_max_batch_size_above_the_compiled_sizes_is_served_split_and_refused_above(
    server: Worker,
) -> None:
    """16 over compiled 1..8: ModelConfig says 16, 16 rows are answered (two executions of 8),
    17 are INVALID_ARGUMENT in Triton's words, over gRPC and REST; then the next request works."""
    client = grpcclient.InferenceServerClient(server.url)
    client.load_model("simple", config='{"max_batch_size": "16"}')
    try:
        assert client.get_model_config("simple").config.max_batch_size == 16
        inputs, a, b = _simple_request(16)
        answer = client.infer("simple", inputs)
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT1"), a - b)

        with pytest.raises(InferenceServerException) as refused:
            client.infer("simple", _simple_request(17)[0])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert refused.value.message() == "inference request batch-size must be <= 16 for 'simple'"

        rest = httpclient.InferenceServerClient(server.http_url)
        rows = (
            httpclient.InferInput("INPUT0", [17, 16], "INT32"),
            httpclient.InferInput("INPUT1", [17, 16], "INT32"),
        )
        for tensor in rows:
            tensor.set_data_from_numpy(np.zeros((17, 16), np.int32))
        with pytest.raises(InferenceServerException) as refused_rest:
            rest.infer("simple", list(rows))
        assert refused_rest.value.status() == "400"
        assert "inference request batch-size must be <= 16 for 'simple'" in str(refused_rest.value.message())

        inputs, a, b = _simple_request(3)
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
    finally:
        client.unload_model("simple")


def test_without_a_max_batch_size_a_large_request_is_split(server: Worker) -> None:
    """A model whose settings set no limit (never overridden): 20 rows over compiled 1..8 are
    served, split, and ModelConfig says 8, its largest execution."""
    client = grpcclient.InferenceServerClient(server.url)
    assert client.get_model_config("simple_int8").config.max_batch_size == 8
    inputs, a, b = _simple_request(20)
    np.testing.assert_array_equal(client.infer("simple_int8", inputs).as_numpy("OUTPUT1"), a - b)
