"""The distribution: `python -m build` makes an sdist and a wheel (built from the sdist, so the
sdist is complete), and the wheel, installed into a fresh venv far from the source tree, serves
its shipped example repository with the plain `hloserve serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import ROOT
from export_examples import reference
from hostile.support import free_port


@pytest.mark.slow
def test_the_wheel_serves_the_example_repository_from_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    wheel = next(dist.glob("hloserve-*.whl"))
    assert next(dist.glob("hloserve-*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hloserve/example_repository/mlp/manifest.yaml" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True, capture_output=True, timeout=900, env=env,
    )  # fmt: skip

    port = free_port()
    env |= {"HLOSERVE_SERVER_EXECUTABLE_CACHE": str(tmp_path / "executables")}
    log = tmp_path / "server.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [str(venv / "bin" / "hloserve"), "serve", "--grpc-port", str(port), "--metrics-port", "-1"],
            cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not _ready(client):
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the installed server did not become ready"
            time.sleep(0.3)
        x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
        tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(x)
        out = client.infer("mlp", [tensor]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, reference("mlp", x), rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        server.kill()
        server.wait(30)


def _ready(client: grpcclient.InferenceServerClient) -> bool:
    try:
        return bool(client.is_server_ready())
    except Exception:
        return False
