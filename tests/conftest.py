"""Fixtures and one collection hook only; the code behind them is in `support` (tests import it
from there)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from support.servers import ServerThread, Worker, make_config, start_worker

# A server that a test starts in a subprocess takes a free REST port, never Triton's fixed 8000
# (tests and other checkouts run side by side).
os.environ.setdefault("HLOSERVE_SERVER_HTTP_PORT", "0")


_FRONTENDS = {"params": [0, 2], "ids": ["frontends0", "frontends2"]}
"""The server-level fixtures run every test twice: one process, and an engine with two frontend
processes (docs/frontends.md), which must answer the same."""


LONG = (
    # deployments of several processes: Envoy and workers, frontend processes
    "tests/node/test_node.py",
    "tests/node/test_node_access.py",
    "tests/node/test_node_scale.py",
    "tests/node/test_dns.py",
    "tests/node/test_supervisor.py",
    "tests/frontends/test_processes.py",
    "tests/engine/test_tracing.py::test_envoy_and_the_worker_join_the_clients_trace_through_the_node",
    "tests/test_memory_probe.py::test_the_node_its_engine_and_each_frontend_write_their_memory_figures",
    "tests/api/test_restricted.py::test_restricted_by_flags_in_a_subprocess",
    # installs and exports of real architectures: a wheel in a fresh venv, torch and ONNX
    "tests/test_packaging.py",
    "tests/importers/test_triton_import.py",
    "tests/export/test_export_torch.py",
    "tests/export/test_precision.py",
    "tests/export/test_export.py::test_shipped_example_repository_is_what_the_script_exports",
    "tests/test_benches.py::test_the_gpu_suite_dry_runs_on_a_cpu",
    # hours of a worker's life in minutes: 10,000 load/unload cycles, five minutes of mixed load
    "tests/test_soak.py",
    "tests/engine/test_unload_releases.py::test_thousands_of_load_unload_cycles_return_the_heap_and_the_counters_to_their_start",
    "tests/models/test_programs.py::test_ten_thousand_variants_start_on_one_program_and_are_indexed",
    # seconds of flooding or of timing, each alone on the machine (`serial`): every one stops the
    # other worker, and together they took the main suite past ten minutes on two cores
    "tests/engine/test_scheduler.py::test_weights_one_to_three_give_compute_shares_one_to_three",
    "tests/engine/test_meta.py::test_a_meta_request_given_up_answers_at_once_and_its_run_finishes_in_a_held_thread",
    "tests/api/test_compression.py::test_a_large_compressed_request_costs_others_under_the_bound",
    "tests/hostile/test_transport.py::test_a_control_frame_flood_from_a_peer_that_never_reads_is_cut_off",
    "tests/hostile/test_transport.py::test_running_out_of_descriptors_refuses_connections_and_keeps_serving",
    "tests/hostile/test_rest_descriptors.py",
    "tests/hostile/test_fairness.py::test_an_overloaded_model_answers_what_it_admits_within_the_deadline",
    "tests/hostile/test_fairness.py::test_a_split_request_yields_to_other_models_between_chunks",
    "tests/hostile/test_rest_stalls.py::test_a_large_json_answer_costs_others_under_the_bound",
    # processes of their own: two workers sharing one region, an engine left idle for seconds
    "tests/models/test_shared_weights.py::test_two_worker_processes_share_one_region",
    "tests/frontends/test_engine_calls.py::test_an_idle_engine_keeps_its_frontends",
    "tests/node/test_residency.py",
    # exports of several models, each compiled and verified in a process of its own
    "tests/export/test_export.py::test_flax_models_exported_and_served_match_flax",
    "tests/export/test_export.py::test_the_fresh_process_loads_the_executables_the_exporter_compiled",
    "tests/export/test_verification.py::test_cli_export_takes_rtol_and_atol",
    # a node of two workers started, then watched idle for 30 s
    "tests/test_benches.py::test_the_node_scale_bench_measures_a_ready_node_over_its_catalogue",
)
"""Tests marked `long`, run by `tox -e long` (and by the README's test command after `tests`):
on two cores they would take the main suite past ten minutes, most of them alone (`serial`)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for entry in LONG:  # a renamed file or test must not quietly move back into `tests`
        path, _, name = entry.partition("::")
        file = root / path
        if not file.is_file() or (name and f"def {name}(" not in file.read_text()):
            raise pytest.UsageError(f"tests/conftest.py LONG names {entry!r}, which does not exist")
    for item in items:
        path = item.path.relative_to(root).as_posix()
        test = f"{path}::{item.originalname}" if isinstance(item, pytest.Function) else path
        if path in LONG or test in LONG:
            item.add_marker(pytest.mark.long)


@pytest.fixture(autouse=True)
def _cli_keeps_the_suite_s_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI run in this process (`hloserve.cli.main`) leaves structlog as the suite set it.
    Its `configure_logging` caches loggers on first use and points them at the stream of the
    moment: a logger cached then escapes every later test's `capture_logs`, and one bound to a
    test's captured stream writes to it after it closed. A CLI in a subprocess configures its own."""
    monkeypatch.setattr("hloserve.cli.configure_logging", lambda config: None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under pytest-xdist, a test marked `serial` (it asserts on timing, or floods the machine)
    runs while no other worker is in a test: it holds a lock exclusively that every other test
    holds shared, from its setup to its teardown, so that no other worker is starting or stopping
    a fixture's server meanwhile either. Run without workers, there is nothing to wait for."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        return (yield)
    lock = Path(tempfile.gettempdir()) / f"hloserve-tests-{workerinput['testrunuid']}.lock"
    with lock.open("a") as file:
        serial = item.get_closest_marker("serial") is not None
        fcntl.flock(file, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@pytest.fixture(scope="session", name="server", **_FRONTENDS)
def _server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """One worker on the example repository, shared by the tests that only read from it."""
    with start_worker(frontends=request.param) as server:
        yield server


@pytest.fixture(name="triton")
def _triton(server: ServerThread) -> Iterator[Any]:
    with closing(grpcclient.InferenceServerClient(server.url)) as client:
        yield client


@pytest.fixture(scope="module", name="shm_server", **_FRONTENDS)
def _shm_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A worker that accepts clients' shared-memory regions (one per module: regions stay apart)."""
    with start_worker(make_config(allow_client_shm=True), frontends=request.param) as server:
        yield server


@pytest.fixture(name="worker_factory")
def _worker_factory() -> Iterator[Callable[..., Worker]]:
    """`start_worker`, with whatever it started stopped when the test ends."""
    started: list[Worker] = []

    def start(*args: Any, **kwargs: Any) -> Worker:
        started.append(start_worker(*args, **kwargs))
        return started[-1]

    yield start
    for worker in reversed(started):
        worker.stop()
