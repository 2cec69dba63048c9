"""Triton's own perf_analyzer runs against hloserve without errors and sees server-side times.

On the `server` fixture: with 0 and 2 frontends. The shared-memory run stays one process (suite
time); regions through two frontends are tested in tests/frontends/test_engine_calls.py.
"""

from __future__ import annotations

import sys

import pytest
from support.servers import ROOT, ServerThread, make_config, start_worker

sys.path.insert(0, str(ROOT / "benches"))
from perf_analyzer import perf_analyzer_path, run_perf_analyzer


def _run_clean(url: str, model: str, *flags: str) -> str:
    """perf_analyzer at concurrency 1 to 2 on batches of 2; it must end clean. Its output."""
    assert perf_analyzer_path() is not None, (
        "run `python benches/perf_analyzer.py --install` (tox -e tests does)"
    )
    result = run_perf_analyzer(
        ["-m", model, "-u", url, "-i", "grpc", "--concurrency-range", "1:2", "-b", "2",
         "--measurement-interval", "1000", "-s", "100", "--max-trials", "10", *flags],
        timeout=180,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "error" not in output.lower(), output
    assert "Request concurrency: 2" in output
    return output


@pytest.mark.slow
@pytest.mark.parametrize(("model", "shape"), [("mlp", []), ("cnn", [])])
def test_perf_analyzer_runs_clean(server: ServerThread, model: str, shape: list[str]) -> None:
    output = _run_clean(server.url, model, *shape)
    # Server-side figures come from ModelStatistics: queue and compute times are reported.
    assert "Server:" in output and "compute infer" in output and "queue" in output


@pytest.mark.slow
def test_perf_analyzer_with_system_shared_memory() -> None:
    with start_worker(make_config(allow_client_shm=True)) as server:
        _run_clean(server.url, "mlp", "--shared-memory", "system", "--output-shared-memory-size", "32")
