"""A missing optional extra (otel, torch, onnx, node) is a configuration error like any other:
the command stops before it loads a model or exports anything, with one line on stderr naming
the setting and the `pip install` that fixes it, and exit status 2.

Each test runs the real CLI in a subprocess on whose PYTHONPATH `support/without_extras`'s
sitecustomize makes the extra's modules fail to import, as on a machine without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.clients import free_port
from support.servers import EXAMPLES, ROOT

WITHOUT_EXTRAS = ROOT / "tests" / "support" / "without_extras"


def _without(absent: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`hloserve ARGS` where the modules `absent` (comma-separated) cannot be imported."""
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("HLOSERVE_", "OTEL_"))},
        "PYTHONPATH": str(WITHOUT_EXTRAS),
        "TEST_ABSENT_MODULES": absent,
        "HLOSERVE_LOGGING_FORMAT": "json",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "hloserve.cli", *args], cwd=cwd, env=environ, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _serve_flags() -> list[str]:
    port = str(free_port())
    return [
        "--model-repository",
        str(EXAMPLES),
        "--grpc-port",
        port,
        "--http-port",
        "-1",
        "--metrics-port",
        "-1",
    ]


def _assert_one_line_exit_2(ran: subprocess.CompletedProcess[str], *words: str) -> None:
    assert ran.returncode == 2, ran.stdout + ran.stderr
    lines = ran.stderr.splitlines()
    assert len(lines) == 1, ran.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "load" not in ran.stdout.lower(), f"something was loaded: {ran.stdout[-2000:]}"


def test_the_blocker_makes_a_module_absent(tmp_path: Path) -> None:
    """What the other tests rely on: the sitecustomize hides the named module, and only it."""
    absent = "opentelemetry"
    probe = "import importlib.util as u, json; print(json.dumps([u.find_spec('json') is not None]))"
    ran = subprocess.run(
        [sys.executable, "-c", f"{probe}; import opentelemetry.exporter"], cwd=tmp_path, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(WITHOUT_EXTRAS), "TEST_ABSENT_MODULES": absent},
    )  # fmt: skip
    assert ran.stdout.strip() == "[true]"
    assert ran.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'opentelemetry'"


@pytest.mark.parametrize("how", ["OTEL_TRACES_EXPORTER", "HLOSERVE_TRACING_EXPORTER"])
def test_serve_with_traces_without_otel_stops_before_loading(how: str, tmp_path: Path) -> None:
    ran = _without("opentelemetry.exporter", "serve", *_serve_flags(), cwd=tmp_path, **{how: "otlp"})
    setting = "OTEL_TRACES_EXPORTER" if how == "OTEL_TRACES_EXPORTER" else "tracing.exporter"
    _assert_one_line_exit_2(ran, f"config {setting}:", "`otel` extra", "pip install 'hloserve[otel]'")


def test_node_with_traces_without_otel_stops_before_starting_a_worker(tmp_path: Path) -> None:
    ran = _without(
        "opentelemetry",
        "node",
        "--cpu-workers",
        "1",
        *_serve_flags(),
        cwd=tmp_path,
        OTEL_TRACES_EXPORTER="otlp",
    )
    _assert_one_line_exit_2(ran, "config OTEL_TRACES_EXPORTER:", "pip install 'hloserve[otel]'")


def test_an_embedded_worker_without_otel_raises_before_loading(tmp_path: Path) -> None:
    """`hloserve.serve` itself checks first: a program that embeds it gets the ConfigError, and
    no model was loaded (nothing logged)."""
    program = (
        "import trio, trio_asyncio, hloserve\n"
        "from hloserve.errors import ConfigError\n"
        "async def main():\n"
        "    async with trio_asyncio.open_loop():\n"
        "        try:\n"
        "            async with hloserve.serve(hloserve.load_config()):\n"
        "                pass\n"
        "        except ConfigError as e:\n"
        "            print('refused:', e)\n"
        "trio.run(main)\n"
    )
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("HLOSERVE_", "OTEL_"))},
        "PYTHONPATH": str(WITHOUT_EXTRAS),
        "TEST_ABSENT_MODULES": "opentelemetry.exporter",
        "HLOSERVE_SERVER_MODEL_REPOSITORY": str(EXAMPLES),
        "HLOSERVE_TRACING_EXPORTER": "otlp",
        "HLOSERVE_LOGGING_FORMAT": "json",
    }
    ran = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "refused: config tracing.exporter: otlp (OpenTelemetry traces) needs the `otel` extra, which is not "
        "installed (No module named 'opentelemetry.exporter'): pip install 'hloserve[otel]'"
    ]


def test_node_of_two_workers_without_envoy_stops_before_starting_one(tmp_path: Path) -> None:
    ran = _without(
        "envoy", "node", "--cpu-workers", "2", *_serve_flags(), cwd=tmp_path, PATH=os.defpath.strip(":")
    )
    _assert_one_line_exit_2(ran, "config node.envoy:", "pip install 'hloserve[node]'")


def test_import_without_onnx_stops_before_converting(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    ran = _without("onnx2torch", "import", "triton", "repo", "--out", "out", cwd=tmp_path)
    _assert_one_line_exit_2(
        ran, "hloserve import:", "`onnx` extra", "onnx2torch", "pip install 'hloserve[onnx]'"
    )
    assert not (tmp_path / "out").exists()


_TORCH_SPEC = """
import torch


def linear():
    return {"module": torch.nn.Linear(4, 2).eval(), "example_inputs": (torch.zeros(1, 4),)}
"""


@pytest.mark.parametrize("absent", ["torch,torchvision", "torchax"])
def test_export_of_a_pytorch_module_without_torch_stops_before_exporting(absent: str, tmp_path: Path) -> None:
    """Without torch the spec itself cannot import it; with torch but not torchax the exporter
    cannot lower it: either way, one line naming the `torch` extra."""
    (tmp_path / "spec.py").write_text(_TORCH_SPEC)
    ran = _without(absent, "export", "spec.py:linear", "--out", "out", cwd=tmp_path)
    _assert_one_line_exit_2(
        ran, "hloserve export: spec.py:linear", "`torch` extra", "pip install 'hloserve[torch]'"
    )
    assert absent.split(",")[0] in ran.stderr
    assert not (tmp_path / "out").exists()
