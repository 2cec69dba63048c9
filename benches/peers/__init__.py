"""Peer servers run beside hloserve in benchmarks, each installed in its own venv under .tools/peers.

Every peer module (`triton`, `mlserver`, `kserve`) has the same interface, so a benchmark can
loop over them:

- `NAME`: the peer and its version, for tables.
- `install()`: its own venv under .tools/peers/<name>, idempotent; `PeerUnavailable` on failure.
- `start(pin, models) -> (process, grpc_port)`: serves every `models.PeerModel` over V2 gRPC on
  127.0.0.1 (free ports), `pin` (e.g. `taskset -c 0`) prefixed to its command. It returns only
  once the server and every model are ready and one inference per model matched
  `models.reference`, so a benchmark never measures a peer that answers wrongly.
- `stop(process)` (here) stops any of them, its whole process group if it has to.

Each peer logs to .tools/peers/<name>.log and runs in its own session, so that stragglers (Triton's
Python-backend stubs, MLServer's workers) can be killed with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benches.peers.models import PeerModel, reference, sample

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".tools" / "peers"
MODELS_PY = Path(__file__).with_name("models.py")
IMPORT_MODELS = f"""spec = importlib.util.spec_from_file_location("peer_models", {str(MODELS_PY)!r})
models = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = models
spec.loader.exec_module(models)
"""
"""The lines with which every generated peer script, once it has imported `importlib.util` and
`sys`, imports `models.py` by its path as `models` (a peer runs in a venv of its own, where
`benches` is not importable)."""
READY_SECONDS = 180.0


class PeerUnavailable(RuntimeError):
    """A peer cannot be installed or started on this machine; a benchmark may skip it, saying why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_venv(venv: Path, requirements: Sequence[str]) -> None:
    """A venv under .tools/peers holding exactly `requirements` (a marker file makes it idempotent)."""
    marker = venv / ".requirements"
    wanted = "\n".join(requirements)
    if marker.exists() and marker.read_text() == wanted:
        return
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *requirements], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        output = getattr(e, "stderr", None) or str(e)
        raise PeerUnavailable(
            f"installing {' '.join(requirements)} into {venv} failed: {output[-2000:]}"
        ) from e
    marker.write_text(wanted)


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def launch(
    name: str, command: list[str], env: dict[str, str], models: Sequence[PeerModel], port: int
) -> subprocess.Popen[bytes]:
    """Start a peer (own session, log in .tools/peers/<name>.log), wait until ready, check answers."""
    log_path = HOME / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(process, port, models, log_path)
        _check(port, models, log_path)
    except BaseException:
        stop(process)
        raise
    return process


def _wait_ready(process: subprocess.Popen[bytes], port: int, models: Sequence[PeerModel], log: Path) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PeerUnavailable(f"exited with {process.returncode} before it was ready; see {log}")
            try:
                if client.is_server_ready() and all(client.is_model_ready(m.name) for m in models):
                    return
            except Exception:
                pass  # not listening yet
            time.sleep(0.1)
        raise PeerUnavailable(f"not ready in {READY_SECONDS:.0f} s; see {log}")
    finally:
        client.close()


def _check(port: int, models: Sequence[PeerModel], log: Path) -> None:
    """One request of two rows per model, compared with the in-process reference."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for model in models:
            x = sample(model, batch=min(2, model.max_batch))
            tensor = grpcclient.InferInput(model.input, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            try:
                result = client.infer(
                    model.name, [tensor], outputs=[grpcclient.InferRequestedOutput(model.output)]
                )
            except InferenceServerException as e:  # the server failed, as opposed to answering wrongly
                raise PeerUnavailable(f"{model.name}: {e}; see {log}") from e
            y, expected = result.as_numpy(model.output), reference(model, x)
            if y is None or y.shape != expected.shape or not np.allclose(y, expected, rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"{model.name}: answered {y!r}, expected {expected!r}; see {log}")
    finally:
        client.close()


def stop(process: subprocess.Popen[bytes], seconds: float = 15.0) -> None:
    """SIGTERM, wait `seconds`, then SIGKILL whatever is left of the process group.

    Peers run in their own session, so the group is theirs alone. The group is swept even when the
    leader exited by itself: a crashed tritonserver leaves Python-backend stubs behind that ignore
    SIGTERM.
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(seconds)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left
    process.wait(seconds)
