"""The two servers of the differential suite: hloserve and Triton 2.51 serving equivalent models.

Both serve `mlp` (the example bundle; Triton runs the same maths in its Python backend, from
`benches.peers.models`), `identity` and `identity_fp16`: one input and output per KServe
datatype (BF16 aside: Triton's Python backend has no numpy type for it), and `doubled`: a model
without a batch axis (Triton's max_batch_size 0) doubling one whole [2, 4] tensor. Triton is installed
into .tools/peers/triton when absent (a few minutes, said loudly on the terminal, bounded by
INSTALL_SECONDS) and runs with explicit model control, so that load and unload work as hloserve's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.servers import EXAMPLES, make_config, start_worker

from benches.peers import PeerUnavailable, site_packages, stop
from benches.peers import triton as peer
from benches.peers.models import MLP
from hloserve.export.jax import InputSpec, OutputSpec, export_bundle

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SECONDS = 1200
IDENTITY = {
    "identity": [
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP32",
        "FP64",
    ],
    "identity_fp16": ["FP16"],
}
"""Identity models and the datatypes each carries: FP16 has no typed contents field, so it has a
model of its own, and every input of `identity` can be sent typed as well as raw."""
DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}  # fmt: skip
"""Every KServe datatype both servers carry in a fixed-size tensor (BF16: see the module)."""

_IDENTITY_PY = """
import sys

sys.path.insert(0, {site!r})
import triton_python_backend_utils as pb_utils

NAMES = {names!r}


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [
                    pb_utils.Tensor("OUTPUT_" + n, tensor.as_numpy())
                    for n in NAMES
                    if (tensor := pb_utils.get_input_tensor_by_name(r, "INPUT_" + n)) is not None
                ]
            )
            for r in requests
        ]
"""


_DOUBLED_PY = """
import sys

sys.path.insert(0, {site!r})
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", 2 * pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())]
            )
            for r in requests
        ]
"""
DOUBLED_SHAPE = (2, 4)
"""The whole input and output of `doubled`, which has no batch axis."""


def _say(line: str) -> None:
    """A line on the terminal, past pytest's capture."""
    print(f"\n[conformance] {line}", file=sys.__stderr__, flush=True)


def _install() -> None:
    """Triton into .tools/peers/triton unless there, in a bounded subprocess."""
    if (peer.VENV / ".requirements").exists():
        return
    _say(
        f"Triton is not installed: installing {peer.NAME} into {peer.VENV} "
        f"(minutes, at most {INSTALL_SECONDS} s)"
    )
    command = [sys.executable, "-c", "from benches.peers import triton; triton.install()"]
    try:
        subprocess.run(command, cwd=ROOT, check=True, timeout=INSTALL_SECONDS, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"installing {peer.NAME} took more than {INSTALL_SECONDS} s")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"installing {peer.NAME} failed: {e.stderr[-2000:]}")
    _say(f"{peer.NAME} installed")


def _triton_repository(directory: Path) -> Path:
    peer.write_repository((MLP,), directory)
    for model, wires in IDENTITY.items():
        (directory / model / "1").mkdir(parents=True)
        ins = ", ".join(f'{{ name: "INPUT_{w}", data_type: TYPE_{w}, dims: [4] }}' for w in wires)
        outs = ", ".join(f'{{ name: "OUTPUT_{w}", data_type: TYPE_{w}, dims: [4] }}' for w in wires)
        (directory / model / "config.pbtxt").write_text(
            f'name: "{model}"\nbackend: "python"\nmax_batch_size: 8\n'
            f"input [ {ins} ]\noutput [ {outs} ]\ninstance_group [ {{ kind: KIND_CPU, count: 1 }} ]\n"
        )
        (directory / model / "1" / "model.py").write_text(
            _IDENTITY_PY.format(site=str(site_packages(peer.VENV)), names=wires)
        )
    (directory / "doubled" / "1").mkdir(parents=True)
    (directory / "doubled" / "config.pbtxt").write_text(
        'name: "doubled"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT", data_type: TYPE_FP32, dims: [2, 4] } ]\n'
        'output [ { name: "OUTPUT", data_type: TYPE_FP32, dims: [2, 4] } ]\n'
        "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
    )
    (directory / "doubled" / "1" / "model.py").write_text(
        _DOUBLED_PY.format(site=str(site_packages(peer.VENV)))
    )
    return directory


def _hloserve_repository(directory: Path) -> Path:
    shutil.copytree(EXAMPLES / "mlp", directory / "mlp")
    for model, wires in IDENTITY.items():
        export_bundle(
            lambda _, *xs: tuple(xs),
            {},
            [InputSpec(f"INPUT_{w}", (4,), DTYPES[w], letters="f") for w in wires],
            directory / model,
            batch_sizes=(1, 8),
            outputs=[OutputSpec(f"OUTPUT_{w}", letters="f") for w in wires],
            verify=False,
        )
    export_bundle(
        lambda _, x: 2 * x,
        {},
        [InputSpec("INPUT", DOUBLED_SHAPE, np.float32, letters="rf")],
        directory / "doubled",
        batch_axis=False,
        outputs=[OutputSpec("OUTPUT", letters="rf")],
        verify=False,
    )
    return directory


@pytest.fixture(scope="session", name="triton_url")
def _triton_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Triton's gRPC address, one server for every run of the suite."""
    _install()
    repository = _triton_repository(tmp_path_factory.mktemp("triton_repository"))
    try:
        process, port = peer.serve(repository, (MLP,), ["--model-control-mode=explicit", "--load-model=*"])
    except PeerUnavailable as e:
        pytest.fail(f"{peer.NAME} did not start: {e}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.fixture(scope="session", name="servers", params=[0, 2], ids=["frontends0", "frontends2"])
def _servers(
    tmp_path_factory: pytest.TempPathFactory, triton_url: str, request: pytest.FixtureRequest
) -> Iterator[dict[str, str]]:
    """The gRPC address of each server, by name: "hloserve" (one process, then an engine with
    two frontends, which must answer as Triton does too) and "triton"."""
    config = make_config(
        _hloserve_repository(tmp_path_factory.mktemp("hloserve_repository")), allow_client_shm=True
    )
    with start_worker(config, frontends=request.param) as server:
        yield {"hloserve": server.url, "triton": triton_url}


@pytest.fixture(name="clients")
def _clients(servers: dict[str, str]) -> Iterator[dict[str, Any]]:
    clients = {name: grpcclient.InferenceServerClient(url) for name, url in servers.items()}
    yield clients
    for client in clients.values():
        client.close()
