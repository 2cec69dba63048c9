"""MLServer 1.7.1 as a benchmark peer: a custom runtime per model, V2 gRPC on loopback.

Installed into `.tools/peers/mlserver` with `uvloop<0.22` (uvloop 0.22+ kills MLServer 1.7.1's
inference worker at start). Every model gets MLServer's adaptive
batching up to its largest batch size with `max_batch_time` 0.5 ms, as Triton gets 100 µs of
dynamic batching.

`parallel_workers: 0`, i.e. inference in the server process: in trial runs on this machine it was the
faster configuration by far (quiet-window medians 421 vs 183 infer/s at concurrency 1, 741 vs 372
at 4; 1.9 vs 4.4 ms of server CPU per request), because the default (`1`) adds a hop through
multiprocessing queues to a worker process. The HTTP listener cannot be turned off, so it gets a
free loopback port too; metrics are off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benches.peers import HOME, IMPORT_MODELS, free_port, launch, make_venv
from benches.peers.models import MLP, POOL, PeerModel

NAME = "MLServer 1.7.1"
VENV = HOME / "mlserver"
REPO = HOME / "mlserver_repo"
REQUIREMENTS = ("mlserver==1.7.1", "uvloop<0.22", "numpy", "safetensors")
MAX_BATCH_TIME_S = 0.0005

__all__ = ["NAME", "install", "start"]

_RUNTIME_PY = """
import importlib.util
import sys

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

{import_models}

class PeerRuntime(MLModel):
    async def load(self) -> bool:
        extra = self.settings.parameters.extra
        self._output = extra["output"]
        self._run = models.compile_model(extra["body"], extra["weights"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        y = self._run(NumpyCodec.decode_input(payload.inputs[0]))
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output(self._output, y)])
"""


def install() -> None:
    """The venv with MLServer (idempotent); `PeerUnavailable` if pip fails."""
    make_venv(VENV, REQUIREMENTS)


def write_repository(models: Sequence[PeerModel], http_port: int, grpc_port: int) -> Path:
    """settings.json, the runtime and one model-settings.json per model (rewritten from scratch)."""
    shutil.rmtree(REPO, ignore_errors=True)
    REPO.mkdir(parents=True)
    settings = {
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_endpoint": None,
        "parallel_workers": 0,
        "grpc_max_message_length": 2**31 - 1,  # as Triton: a 128-image pool request is 77 MB
        "debug": False,
        "load_models_at_startup": True,
    }
    (REPO / "settings.json").write_text(json.dumps(settings, indent=1))
    (REPO / "peer_runtime.py").write_text(_RUNTIME_PY.format(import_models=IMPORT_MODELS))
    for m in models:
        tensor = {"datatype": "FP32"}
        model_settings = {
            "name": m.name,
            "implementation": "peer_runtime.PeerRuntime",
            "max_batch_size": m.max_batch,
            "max_batch_time": MAX_BATCH_TIME_S,
            "inputs": [{**tensor, "name": m.input, "shape": [-1, *m.in_dims]}],
            "outputs": [{**tensor, "name": m.output, "shape": [-1, *m.out_dims]}],
            "parameters": {"extra": asdict(m)},
        }
        (REPO / m.name).mkdir()
        (REPO / m.name / "model-settings.json").write_text(json.dumps(model_settings, indent=1))
    return REPO


def start(
    pin: list[str] | None = None, models: Sequence[PeerModel] = (MLP, POOL)
) -> tuple[subprocess.Popen[bytes], int]:
    """Start MLServer on free loopback ports; returns the process and its gRPC port once ready."""
    install()
    grpc_port, http_port = free_port(), free_port()
    write_repository(models, http_port, grpc_port)
    command = [*(pin or []), str(VENV / "bin" / "mlserver"), "start", str(REPO)]
    return launch("mlserver", command, dict(os.environ), models, grpc_port), grpc_port
