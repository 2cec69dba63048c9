"""The breakdown bench's patched servers serve what they claim (`python -m benches breakdown`);
the overload bench's sink refuses as it claims; `benches/gpu` runs to the end on a CPU
(`--quick`) and carries the wheels it needs; the soak reads Envoy's allocator; the routes bench
starts Envoy on the node's files and times requests through it; the node-scale bench measures a
node it started over a catalogue; the anchors bench exports again what was tuned on a busy machine."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import export_examples
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.clients import wait_until
from support.numerics import assert_close
from support.servers import ROOT

from benches import anchors, node_scale, overload, routes, soak
from benches.openloop import generate
from benches.serving import _free_port, start_server
from hloserve.fleet.envoy import find_envoy


def test_the_overload_sink_refuses_every_request_unavailable_at_once() -> None:
    """`benches overload`'s last case: Envoy alone, answering gRPC UNAVAILABLE from its route,
    so the generator and Envoy's own cost per refusal are measured with no server behind."""
    port = _free_port()
    envoy = subprocess.Popen(
        [find_envoy(), "--config-yaml", json.dumps(overload._sink_config(port, _free_port())),
         "--disable-hot-restart", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: _accepts(port), 30, "the sink")
        load = generate(f"127.0.0.1:{port}", overload._mlp_request(), seconds=0.5, rate=200, deadline_s=1.0)
        assert set(load["outcomes"]) == {"UNAVAILABLE"} and load["outcomes"]["UNAVAILABLE"] >= 90, load
        assert load["messages"]["UNAVAILABLE"][0] == "shed"
    finally:
        envoy.terminate()
        envoy.wait(30)


def test_the_soak_reads_envoys_allocator_from_its_admin_port(tmp_path: Path) -> None:
    """`benches soak --node` samples Envoy's tcmalloc (what it holds in all, allocated, and
    mapped but free) from the admin port of the bootstrap on its command line, as it samples
    glibc's in the server's processes; a process without one gives nothing."""
    admin = _free_port()
    bootstrap = tmp_path / "envoy.json"
    bootstrap.write_text(
        json.dumps({"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}}})
    )
    envoy = subprocess.Popen(
        [find_envoy(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: _accepts(admin), 30, "Envoy's admin port")
        allocator = soak._envoy_memory(envoy.pid)["allocator"]
        assert allocator["in_use"] > 1 << 20 and allocator["free"] >= 0, allocator
        assert allocator["heap"] >= allocator["in_use"] + allocator["free"], allocator
    finally:
        envoy.terminate()
        envoy.wait(30)
    assert soak._envoy_memory(os.getpid()) == {}


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no execution", "no actors", "canned reply"])
def test_breakdown_variant_answers_and_keeps_statistics(variant: str) -> None:
    port = _free_port()
    server = start_server(port, module=("benches.breakdown", variant))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        out = client.infer("mlp", [tensor]).as_numpy("OUTPUT0")
        expected = export_examples.reference("mlp", x) if variant == "no actors" else np.zeros((1, 4))
        assert_close(out, expected)
        # perf_analyzer refuses a run whose statistics lack queue and execution counts.
        stats = client.get_inference_statistics("mlp").model_stats[0]
        assert (stats.inference_stats.success.count, stats.inference_stats.queue.count) == (1, 1)
        assert stats.execution_count == 1
        client.close()
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run's own limit is 600 s
def test_the_gpu_suite_dry_runs_on_a_cpu(tmp_path: Path) -> None:
    """`benches/gpu --quick` as a GPU session runs it (the script, then the suite), small."""
    output = tmp_path / "gpu.json"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HLOSERVE_")}
    run = subprocess.run(
        ["bash", "benches/gpu", "--quick", "--output", str(output)],
        cwd=ROOT,
        env={**environment, "PYTHON": sys.executable, "GPU_SUITE_SITE": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results) >= {"bandwidth", "budget", "cold", "catalogue", "compaction", "real_models"}
    assert all(
        {"pageable_gb_per_s", "shm_gb_per_s", "pinned_gb_per_s"} <= set(row) for row in results["bandwidth"]
    )
    assert [row["weights_mb"] for row in results["cold"]] == [1, 4]
    assert all(
        row["raw_pinned_put_ms"] and row["pinned_overhead_ratio"] is not None for row in results["cold"]
    )
    assert [row["budget"] for row in results["catalogue"]] == [
        "none (all resident)",
        "1/10 of the catalogue",
        "1/10, loads not overlapped",
        "same bytes, bf16 (1/5)",  # the same budget holds twice the models in bf16
    ]
    assert all(row["errors"] == 0 and row["throughput"] > 0 for row in results["catalogue"])
    assert results["compaction"]["resident_bytes_after"] == 0
    assert results["compaction"]["fragmentation"]["ran"] is False  # a CPU keeps no allocator statistics
    # The real models' rows (ResNet-50 and ViT-B/16 on a GPU), with a small CNN in their place:
    # exported in each precision, served, timed at each batch size.
    assert [(r["model"], r["precision"], r.get("batch")) for r in results["real_models"]] == [
        ("small_cnn", precision, batch) for precision in ("fp32", "bf16") for batch in (1, 8)
    ], results["real_models"]
    assert all(r["compute_ms"] > 0 and r["grpc_ms"] >= r["compute_ms"] for r in results["real_models"])
    assert all(  # torch beside it on the same device (a CPU here)
        r["torch_device"] == "cpu" and r["torch_eager_ms"] > 0 and r["torch_compile_ms"] > 0
        and r["compute_over_torch_compile"] > 0
        for r in results["real_models"]
    )  # fmt: skip
    bf16, fp32 = (next(r for r in results["real_models"] if r["precision"] == p) for p in ("bf16", "fp32"))
    assert 0 < bf16["weight_bytes"] < 0.6 * fp32["weight_bytes"]


def test_the_gpu_suite_measures_resnet50_and_vit_in_both_precisions() -> None:
    """What a GPU run measures in place of the dry run's small CNN (issue 27)."""
    from benches import gpu_suite

    assert gpu_suite.REAL_MODELS == ("resnet50", "vit_b_16")
    assert (gpu_suite.PRECISIONS, gpu_suite.REAL_BATCH_SIZES) == (("fp32", "bf16"), (1, 8))
    specs = gpu_suite.MODEL_SPECS.read_text()
    assert all(f"def {name}()" in specs for name in gpu_suite.REAL_MODELS)


def test_the_gpu_wheels_are_the_versions_hloserve_pins() -> None:
    """Every exactly pinned dependency that the GPU image lacks travels in benches/gpu-wheels.txt
    at the same version (the image has jax, numpy, protobuf and the rest: see that file)."""
    wheels = {}
    for line in (ROOT / "benches" / "gpu-wheels.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            wheels[re.sub(r"[-_.]+", "-", name.lower())] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^;\s]+)", requirement.strip())
        if match:
            pinned[re.sub(r"[-_.]+", "-", match[1].lower())] = match[2]
    assert pinned, "no pinned dependency found in pyproject.toml"
    assert {name: wheels.get(name) for name in pinned} == pinned
    tritonclient = next(r for r in project["optional-dependencies"]["dev"] if r.startswith("tritonclient"))
    assert wheels["tritonclient"] == tritonclient.split("==")[1]


def test_the_routes_bench_has_envoy_apply_the_nodes_files_and_answer() -> None:
    """`python -m benches routes` at 10 models: Envoy applied the files (its admin reported their
    version) and every timed request was answered by the route being timed (the controller's
    closed port: gRPC UNAVAILABLE, REST 503; the bench raises on any other answer)."""
    (row,) = routes.run(sizes=[10])
    assert row.models == 10 and row.files_mb >= 0 and row.write_s >= 0
    assert row.envoy_apply_s > 0 and row.envoy_rss_mb > 10
    assert row.grpc_unclaimed_ms > 0 and row.rest_unclaimed_ms > 0  # each call checked: the 503 timed
    assert "Envoy apply s" in routes.table([row])


@pytest.mark.slow
def test_the_node_scale_bench_measures_a_ready_node_over_its_catalogue() -> None:
    """`python -m benches node_scale` at 10 models: the node was ready, listed every model in its
    index and its merged control status (the bench raises otherwise), and each process's idle
    CPU was read."""
    (row,) = node_scale.run(sizes=[10])
    assert row.models == 10 and 0 < row.ready_s < node_scale.READY_WITHIN_S
    assert row.controller_cores > 0 and row.worker_cores > 0  # the discovery rounds cost something
    assert row.index_ms > 0 and row.status_ms > 0


def test_the_anchors_bench_exports_again_what_was_tuned_on_a_busy_machine(tmp_path: Path) -> None:
    """The zoo's tests export two models at a time; an export whose tuning saw the other one
    keep the cores busy would have the bench time options an idle machine would not pick."""
    repository = tmp_path / "repository"
    for name, tuning in {
        "busy": {"others_cpu_share": 0.48},
        "idle": {"others_cpu_share": 0.02},
        "unmeasured": {"default_ms": 3.0},  # an export before the share was recorded, or no /proc
    }.items():
        (repository / name).mkdir(parents=True)
        manifest = {"provenance": {"xla_tuning": {"batch_size": 4, **tuning}}}
        (repository / name / "manifest.yaml").write_text(json.dumps(manifest))
    (repository / "untuned").mkdir()
    (repository / "untuned" / "manifest.yaml").write_text(json.dumps({"provenance": {}}))
    busy = {p.name for p in repository.iterdir() if anchors._tuned_while_busy(p)}
    assert busy == {"busy"} and not anchors._tuned_while_busy(repository / "missing")


def test_the_anchors_bench_times_each_runtime_after_calls_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ONNX Runtime's and torch's threads spin on after a call returns, and each runtime fills
    the caches with its own weights: in each turn a runtime's timed call follows untimed calls
    of its own for `PRIMING_S` (at least `PRIMING`), never another runtime's, and each gets its
    own median."""
    assert anchors.PRIMING >= 1 and anchors.PRIMING_S >= 0.1  # the bench's own: ~100 ms of spin measured
    monkeypatch.setattr(anchors, "MAX_ROUNDS", anchors.WARMUP + 2)
    monkeypatch.setattr(anchors, "PRIMING_S", 0.05)
    runtimes: list[str] = []  # in the order they were called

    def call(runtime: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            time.sleep(seconds)
            runtimes.append(runtime)

        return run

    medians = anchors.take_turns({"hloserve": call("hloserve", 0.002), "ort": call("ort", 0.03)}, repeats=2)
    turns = [(runtime, len(list(g))) for runtime, g in itertools.groupby(runtimes)]
    assert [runtime for runtime, _ in turns] == ["hloserve", "ort"] * (anchors.WARMUP + 2)
    # 2 ms calls: untimed ones for 50 ms, then the timed one; 30 ms calls: two untimed, one timed
    assert all(n > 10 for runtime, n in turns if runtime == "hloserve"), turns
    assert all(n == 3 for runtime, n in turns if runtime == "ort"), turns
    assert 2 <= medians["hloserve"] < medians["ort"] and medians["ort"] >= 20, medians
