"""KServe 0.21.0 as a benchmark peer: a custom `kserve.Model` per model, V2 gRPC on loopback.

Installed into `.tools/peers/kserve`. KServe's `ModelServer` has no batching (that lives in its
separate Go agent), so each request runs alone; gRPC is grpc.aio with 4 threads, as shipped.

Loopback only: KServe 0.21 hard-codes `[::]:<port>` for gRPC and `0.0.0.0` for REST, with no
host option. The generated server script therefore patches both
before starting: the `aio.server` KServe's gRPC module calls returns a server whose
`add_insecure_port` binds 127.0.0.1 on the same port, and `uvicorn.Config` is forced to host
127.0.0.1. The REST listener cannot be turned off, so it gets a free loopback port too. Per-request
logging is off (`KSERVE_LOGLEVEL=WARNING`, `--enable_latency_logging False`), and gRPC message
limits are raised from KServe's 8 MB to Triton's 2 GB, since a 104-image pool request is 63 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict

from benches.peers import HOME, IMPORT_MODELS, free_port, launch, make_venv
from benches.peers.models import MLP, POOL, PeerModel

NAME = "KServe 0.21.0"
VENV = HOME / "kserve"
SERVE_PY = HOME / "kserve_serve.py"
SPECS = HOME / "kserve_models.json"
REQUIREMENTS = ("kserve==0.21.0", "numpy", "safetensors")

__all__ = ["NAME", "install", "start"]

_SERVE_PY = """
import importlib.util
import json
import os
import sys

import uvicorn
from grpc import aio

import kserve.protocol.grpc.server as kserve_grpc
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

{import_models}

class _LoopbackAio:
    # KServe binds gRPC to [::]:port; keep the port, bind loopback only
    @staticmethod
    def server(*args, **kwargs):
        server = aio.server(*args, **kwargs)
        add = server.add_insecure_port
        server.add_insecure_port = lambda address: add("127.0.0.1:" + address.rsplit(":", 1)[1])
        return server


class _LoopbackConfig(uvicorn.Config):
    # KServe binds REST to 0.0.0.0
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{{**kwargs, "host": "127.0.0.1"}})


kserve_grpc.aio = _LoopbackAio
uvicorn.Config = _LoopbackConfig


class PeerModel(Model):
    def __init__(self, spec):
        super().__init__(spec["name"])
        self._output = spec["output"]
        self._run = models.compile_model(spec["body"], spec["weights"])
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        y = self._run(payload.inputs[0].as_numpy())
        out = InferOutput(name=self._output, shape=list(y.shape), datatype="FP32")
        out.set_data_from_numpy(y, binary_data=True)  # raw_output_contents, what tritonclient reads
        return InferResponse(model_name=self.name, infer_outputs=[out], response_id=payload.id)


if __name__ == "__main__":
    with open(os.environ["PEER_MODELS"]) as f:
        ModelServer().start([PeerModel(s) for s in json.load(f)])
"""


def install() -> None:
    """The venv with KServe (idempotent); `PeerUnavailable` if pip fails."""
    make_venv(VENV, REQUIREMENTS)


def start(
    pin: list[str] | None = None, models: Sequence[PeerModel] = (MLP, POOL)
) -> tuple[subprocess.Popen[bytes], int]:
    """Start KServe on free loopback ports; returns the process and its gRPC port once ready."""
    install()
    SERVE_PY.write_text(_SERVE_PY.format(import_models=IMPORT_MODELS))
    SPECS.write_text(json.dumps([asdict(m) for m in models]))
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "KSERVE_LOGLEVEL": "WARNING", "PEER_MODELS": str(SPECS)}
    limit = str(2**31 - 1)
    command = [
        *(pin or []),
        str(VENV / "bin" / "python"),
        str(SERVE_PY),
        f"--http_port={http_port}",
        f"--grpc_port={grpc_port}",
        "--enable_latency_logging=False",
        f"--grpc_max_send_message_length={limit}",
        f"--grpc_max_receive_message_length={limit}",
    ]
    return launch("kserve", command, env, models, grpc_port), grpc_port
