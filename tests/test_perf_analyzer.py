"""Triton's own perf_analyzer runs against hloserve without errors and sees server-side times."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, ServerThread, make_config

sys.path.insert(0, str(ROOT / "benches"))
from perf_analyzer import perf_analyzer_path, run_perf_analyzer


@pytest.mark.slow
@pytest.mark.parametrize(("model", "shape"), [("mlp", []), ("cnn", [])])
def test_perf_analyzer_runs_clean(server: ServerThread, model: str, shape: list[str]) -> None:
    assert perf_analyzer_path() is not None, (
        "run `python benches/perf_analyzer.py --install` (tox -e tests does)"
    )
    result = run_perf_analyzer(
        ["-m", model, "-u", server.url, "-i", "grpc", "--concurrency-range", "1:2", "-b", "2",
         "--measurement-interval", "1000", "-s", "100", "--max-trials", "3", *shape],
        timeout=180,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "error" not in output.lower(), output
    assert "Request concurrency: 2" in output
    # Server-side figures come from ModelStatistics: queue and compute times are reported.
    assert "Server:" in output and "compute infer" in output and "queue" in output


@pytest.mark.slow
def test_perf_analyzer_with_system_shared_memory() -> None:
    server = ServerThread(make_config(allow_client_shm=True)).start()
    try:
        result = run_perf_analyzer(
            ["-m", "mlp", "-u", server.url, "-i", "grpc", "--concurrency-range", "1:2", "-b", "2",
             "--shared-memory", "system", "--output-shared-memory-size", "32",
             "--measurement-interval", "1000", "-s", "100", "--max-trials", "3"],
            timeout=180,
        )  # fmt: skip
    finally:
        server.stop()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "error" not in output.lower(), output
    assert "Request concurrency: 2" in output
