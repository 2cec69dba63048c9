"""Triton Inference Server 2.51.0 as a benchmark peer, serving the same models as hloserve.

The runnable Triton here is the `tritonserver` binary inside the `nvidia-pytriton==0.7.0` wheel,
run standalone with its Python backend. Installed once into
`.tools/peers/triton` (a venv; numpy 1.26 comes with it, which the backend stub is built for).
Each model is a Python-backend model running `models.compile_model` on the model's body and
weights, with dynamic batching (100 µs queue delay) up to the model's largest batch size.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benches.peers import HOME, IMPORT_MODELS, PeerUnavailable, free_port, launch, make_venv, site_packages
from benches.peers.models import MLP, POOL, PeerModel

NAME = "Triton 2.51.0"
VENV = HOME / "triton"
REPO = HOME / "triton_repo"
BACKENDS = HOME / "triton_backends"
REQUIREMENTS = ("nvidia-pytriton==0.7.0", "safetensors")

__all__ = ["NAME", "install", "serve", "start"]


def _tritonserver() -> Path:
    return site_packages(VENV) / "pytriton" / "tritonserver"


def install() -> None:
    """Create the venv with PyTriton and the standalone backend folder (idempotent)."""
    make_venv(VENV, REQUIREMENTS)
    python_backend = BACKENDS / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    ts = _tritonserver()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source in (
        ts / "backends" / "python" / "libtriton_python.so",
        ts / "backends" / "python" / "triton_python_backend_utils.py",
        ts / "python_backend_stubs" / version / "triton_python_backend_stub",
    ):
        target = python_backend / source.name
        if not source.exists():
            raise PeerUnavailable(f"{source} is missing from {REQUIREMENTS[0]}")
        if not target.exists():
            shutil.copyfile(source, target)
            target.chmod(0o755)


_MODEL_PY = """
import importlib.util
import sys

sys.path.insert(0, {site!r})  # the stub ignores PYTHONPATH; numpy 1.26 is what it is built for
{import_models}
import numpy as np
import triton_python_backend_utils as pb_utils

MODEL = models.PeerModel(**{spec})
run = models.compile_model(MODEL.body, MODEL.weights)


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, MODEL.input).as_numpy() for r in requests]
        y = run(np.concatenate(xs) if len(xs) > 1 else xs[0])
        out, i = [], 0
        for x in xs:
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(MODEL.output, y[i:i + len(x)])]))
            i += len(x)
        return out
"""


def write_repository(models: Sequence[PeerModel] = (MLP, POOL), repository: Path = REPO) -> Path:
    """Triton's model repository for `models` (rewritten from scratch: Triton serves all it finds)."""
    shutil.rmtree(repository, ignore_errors=True)
    for m in models:
        (repository / m.name / "1").mkdir(parents=True)
        (repository / m.name / "config.pbtxt").write_text(
            f'name: "{m.name}"\nbackend: "python"\nmax_batch_size: {m.max_batch}\n'
            f'input [ {{ name: "{m.input}", data_type: TYPE_FP32, dims: {list(m.in_dims)} }} ]\n'
            f'output [ {{ name: "{m.output}", data_type: TYPE_FP32, dims: {list(m.out_dims)} }} ]\n'
            "dynamic_batching { max_queue_delay_microseconds: 100 }\n"
            "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
        )
        (repository / m.name / "1" / "model.py").write_text(
            _MODEL_PY.format(
                site=str(site_packages(VENV)),
                import_models=IMPORT_MODELS,
                spec=repr(asdict(m)),
            )
        )
    return repository


def serve(
    repository: Path, models: Sequence[PeerModel], extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """Triton on a `repository` the caller wrote, with more tritonserver flags `extra`; returns
    once ready and `models` (among those served) answered correctly (one try)."""
    install()
    global http_port
    grpc_port, http_port = free_port(), free_port()
    command = [*_command(None, grpc_port, http_port, repository), *extra]
    return launch("triton", command, _env(), models, grpc_port), grpc_port


def start(
    pin: list[str] | None = None, models: Sequence[PeerModel] = (MLP, POOL), attempts: int = 3
) -> tuple[subprocess.Popen[bytes], int]:
    """Start Triton on free loopback ports; returns the process and its gRPC port once ready.

    Up to `attempts` tries: pinned to one core, tritonserver 2.51 sometimes (about 1 start in 5
    here) aborts at start with `boost::interprocess::lock_exception`, or its first request finds a
    Python-backend stub "not healthy" (a timed-lock health check). The previous version of this
    module failed the same way under the same pin. A failed try's log is kept as triton.failed.log.
    """
    install()
    write_repository(models)
    for _ in range(attempts - 1):
        try:
            return _launch(pin, models)
        except PeerUnavailable:
            (HOME / "triton.log").replace(HOME / "triton.failed.log")
    return _launch(pin, models)


http_port: int | None = None
"""The REST port of the Triton last started (its V2 HTTP endpoint, Triton's 8000 by default)."""


def _launch(pin: list[str] | None, models: Sequence[PeerModel]) -> tuple[subprocess.Popen[bytes], int]:
    global http_port
    grpc_port, http_port = free_port(), free_port()
    return launch("triton", _command(pin, grpc_port, http_port), _env(), models, grpc_port), grpc_port


def _env() -> dict[str, str]:
    libdir = sysconfig.get_config_var("LIBDIR")  # the stub must load the libpython of our stdlib
    return {**os.environ, "LD_LIBRARY_PATH": f"{site_packages(VENV) / 'nvidia_pytriton.libs'}:{libdir}"}


def _command(pin: list[str] | None, grpc_port: int, http_port: int, repository: Path = REPO) -> list[str]:
    ts = _tritonserver()
    return [
        *(pin or []),
        str(ts / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={BACKENDS}",
        f"--cache-directory={ts / 'caches'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--log-verbose=0",
    ]
