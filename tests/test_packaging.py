"""The distribution: `python -m build` makes an sdist and a wheel (built from the sdist, so the
sdist is complete), and the wheel, installed into a fresh venv far from the source tree, serves
its shipped example repository with the plain `hloserve serve`.

One process: the installed wheel's first command (`hloserve serve`) is under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.clients import infer
from support.numerics import assert_close
from support.servers import ROOT, start_worker


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

    installed = [str(venv / "bin" / "hloserve"), "serve"]
    unset = {name: None for name in ("PYTHONPATH", "VIRTUAL_ENV")}
    env_of_server = {**unset, "HLOSERVE_SERVER_EXECUTABLE_CACHE": str(tmp_path / "executables")}
    with start_worker(
        process="subprocess", command=installed, repository=None, env=env_of_server, cwd=tmp_path
    ) as server:
        client = grpcclient.InferenceServerClient(server.url)
        x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
        out = infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0")
        assert_close(out, reference("mlp", x))
        client.close()
