"""Triton Inference Server 2.51.0 as a benchmark peer, serving the same models as hloserve.

The runnable Triton here is the `tritonserver` binary inside the `nvidia-pytriton==0.7.0` wheel,
run standalone with its Python backend (research/peers_runnable.md §3.1). Installed once into
`.tools/peers/triton` (a venv; numpy 1.26 comes with it). The model repository it serves is
generated from hloserve's example bundles: the same weights, the same maths in numpy, dynamic
batching up to the same largest batch size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".tools" / "peers"
VENV = HOME / "triton"
REPO = HOME / "triton_repo"
BACKENDS = HOME / "triton_backends"
PYTRITON = "nvidia-pytriton==0.7.0"

__all__ = ["install", "start"]


def _site_packages() -> Path:
    return VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _tritonserver() -> Path:
    return _site_packages() / "pytriton" / "tritonserver"


def install() -> None:
    """Create the venv with PyTriton and the standalone backend folder (idempotent)."""
    if not (_tritonserver() / "bin" / "tritonserver").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", PYTRITON], check=True)
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
        if not target.exists():
            target.write_bytes(source.read_bytes())
            target.chmod(0o755)


_MODEL_PY = """
import sys
sys.path.insert(0, {site!r})  # the stub ignores PYTHONPATH; numpy 1.26 is what it is built for
import numpy as np
import triton_python_backend_utils as pb_utils

WEIGHTS = dict(np.load({weights!r})) if {weights!r} else {{}}


def run(x):
{body}


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, {input!r}).as_numpy() for r in requests]
        y = run(np.concatenate(xs) if len(xs) > 1 else xs[0])
        out, i = [], 0
        for x in xs:
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor({output!r}, y[i:i + len(x)])]))
            i += len(x)
        return out
"""

_MODELS = {
    # the example mlp: 16 -> 32 relu -> 4
    "mlp": (
        "INPUT0",
        "OUTPUT0",
        (16,),
        (4,),
        16,
        "h = np.maximum(x @ WEIGHTS['hidden.kernel'] + WEIGHTS['hidden.bias'], 0)\n"
        "return (h @ WEIGHTS['out.kernel'] + WEIGHTS['out.bias']).astype(np.float32)",
    ),
    # the example pool: per-channel mean of 224x224x3 images
    # (max batch 128 so one request can carry 104 images, as hloserve splits them)
    "pool": ("IMAGE", "MEAN", (224, 224, 3), (3,), 128, "return x.mean(axis=(1, 2)).astype(np.float32)"),
}


def write_repository() -> Path:
    """Triton's model repository for the example models, weights taken from the bundles."""
    from safetensors.numpy import load_file

    for name, (inp, out, in_dims, out_dims, max_batch, body) in _MODELS.items():
        model = REPO / name
        (model / "1").mkdir(parents=True, exist_ok=True)
        weights_file = ROOT / "examples" / "repository" / name / "weights.safetensors"
        weights = ""
        if weights_file.exists():
            weights = str(model / "weights.npz")
            np.savez(weights, **load_file(str(weights_file)))  # type: ignore[arg-type]
        (model / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
            f'input [ {{ name: "{inp}", data_type: TYPE_FP32, dims: {list(in_dims)} }} ]\n'
            f'output [ {{ name: "{out}", data_type: TYPE_FP32, dims: {list(out_dims)} }} ]\n'
            "dynamic_batching { max_queue_delay_microseconds: 100 }\n"
            "instance_group [ { kind: KIND_CPU, count: 1 } ]\n"
        )
        (model / "1" / "model.py").write_text(
            _MODEL_PY.format(
                site=str(_site_packages()),
                weights=weights,
                body=textwrap.indent(body, "    "),
                input=inp,
                output=out,
            )
        )
    return REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(pin: list[str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Start Triton on free loopback ports; returns the process and its gRPC port once ready."""
    install()
    write_repository()
    grpc_port, http_port = _free_port(), _free_port()
    libdir = sysconfig.get_config_var("LIBDIR")
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{_site_packages() / 'nvidia_pytriton.libs'}:{libdir}",
    }
    ts = _tritonserver()
    command = [
        *(pin or []),
        str(ts / "bin" / "tritonserver"),
        f"--model-repository={REPO}",
        f"--backend-directory={BACKENDS}",
        f"--cache-directory={ts / 'caches'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--log-verbose=0",
    ]
    log = open(HOME / "triton.log", "wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited; see {HOME / 'triton.log'}")
        try:
            if client.is_server_ready() and all(client.is_model_ready(m) for m in _MODELS):
                client.close()
                return process, grpc_port
        except Exception:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"tritonserver not ready in 180 s; see {HOME / 'triton.log'}")
