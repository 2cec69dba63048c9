"""Programs shared by models whose modules are byte-identical (issue 36): one compile and one
warm-up for every variant, each variant answering with its own weights."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from support.bundles import (
    PARAMS,
    X,
    affine,
    affine_output,
    edit_manifest,
    save_affine_weights,
    write_affine,
    write_convolutions,
)
from support.clients import infer
from support.numerics import assert_close
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

from hloserve.models.bundle import load_bundle
from hloserve.models.executable_cache import ExecutableCache
from hloserve.models.programs import Programs


def _variant(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in PARAMS.items()}


def _named(name: str) -> Callable[[dict[str, Any]], None]:
    def rename(manifest: dict[str, Any]) -> None:
        manifest["name"] = name

    return rename


def _variants(repository: Path, count: int) -> dict[str, dict[str, np.ndarray]]:
    """`count` copies of one affine bundle (`v0`, `v1`, ...), each with weights of its own."""
    first = write_affine(repository / "v0")
    params = {}
    for i in range(count):
        directory = repository / f"v{i}"
        if i:
            shutil.copytree(first, directory)
            edit_manifest(directory, _named(f"v{i}"))
        params[f"v{i}"] = _variant(i)
        save_affine_weights(directory, params[f"v{i}"])
    return params


def test_a_program_is_compiled_once_for_byte_identical_modules(tmp_path: Path) -> None:
    _variants(tmp_path, 3)
    write_affine(tmp_path / "other", batch_sizes=(1, 4))
    cache = ExecutableCache(tmp_path / "cache")
    programs = Programs(cache)
    loaded = [programs.load(load_bundle(tmp_path / name)) for name in ("v0", "v1", "v2")]
    assert [shared for _, shared in loaded] == [False, True, True]
    assert loaded[1][0] is loaded[0][0] is loaded[2][0]
    assert loaded[0][0].loaded_for == "v0"
    assert cache.hits + cache.misses == 2  # one compile (or cache read) per batch size, not per model
    assert set(loaded[0][0].costs) == {1, 2}  # warmed up once, each size
    other, shared = programs.load(load_bundle(tmp_path / "other"))
    assert not shared and other is not loaded[0][0]
    assert len(programs) == 2
    del loaded, other
    assert len(programs) == 0  # a program lives while a model uses it


def test_variants_share_a_program_and_answer_with_their_own_weights(tmp_path: Path) -> None:
    params = _variants(tmp_path, 4)
    write_affine(tmp_path / "other", batch_sizes=(1,))  # another module: a program of its own
    with start_worker(make_config(tmp_path)) as server:
        assert isinstance(server, ServerThread)
        client = grpcclient.InferenceServerClient(server.url)
        assert server.call(lambda: len(server.worker.programs)) == 2
        for name, p in params.items():
            assert_close(affine_output(client, name), affine(p, X))
        x4 = np.arange(8, dtype=np.float32).reshape(2, 4)
        assert_close(affine_output(client, "v3", x4), affine(params["v3"], x4))
        assert_close(affine_output(client, "other"), affine(PARAMS, X))

        client.unload_model("v1")  # the others keep serving on the program they share
        for name in ("v0", "v2", "v3"):
            assert_close(affine_output(client, name), affine(params[name], X))
        assert server.call(lambda: len(server.worker.programs)) == 2

        # v2 reloaded with another module (other batch sizes): it leaves the shared program
        shutil.rmtree(tmp_path / "v2")
        write_affine(tmp_path / "v2", batch_sizes=(1, 4))
        save_affine_weights(tmp_path / "v2", params["v2"])
        client.load_model("v2")
        assert server.call(lambda: len(server.worker.programs)) == 3
        table = server.worker.models
        assert table["v2"].compiled.program is not table["v0"].compiled.program
        assert table["v3"].compiled.program is table["v0"].compiled.program
        assert table["v2"].batch_sizes == (1, 4)
        for name in ("v0", "v2", "v3"):
            assert_close(affine_output(client, name), affine(params[name], X))
        client.close()


def _scrape(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.worker.metrics_port}/metrics", timeout=60).read()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_a_scrape_exposes_the_busiest_models_up_to_its_bound(tmp_path: Path) -> None:
    params = _variants(tmp_path, 4)
    config = make_config(tmp_path, metrics_max_models=2)
    with start_worker(config) as server:
        assert isinstance(server, ServerThread)
        client = grpcclient.InferenceServerClient(server.url)
        for name in ("v2", "v2", "v3"):
            assert_close(affine_output(client, name), affine(params[name], X))
        client.close()
        samples = _scrape(server)
    served = {dict(labels)["model"] for (name, labels) in samples if name == "hloserve_executions_total"}
    assert served == {"v2", "v3"}
    assert samples[("hloserve_models_unexposed", ())] == 2
    assert samples[("hloserve_programs_loaded", ())] == 1


def test_ten_thousand_variants_start_on_one_program_and_are_indexed(tmp_path: Path) -> None:
    """Start-up at the issue's 10,000 models: every variant READY, one program loaded (one compile,
    one warm-up), the load log naming the program each shares; some answer with their weights;
    RepositoryIndex lists every one over gRPC (encoded by upb: betterproto2 took half a second of
    the serving loop) and over REST; a scrape lists the models that served, up to
    `server.metrics_max_models` (1000 by default) of them, and counts the rest."""
    count = 10_000
    first = write_affine(tmp_path / "v0")
    for i in range(1, count):
        directory = tmp_path / f"v{i}"
        shutil.copytree(first, directory)
        edit_manifest(directory, _named(f"v{i}"))
    chosen = {f"v{i}": _variant(i) for i in (7, 5000, count - 1)}
    for name, params in chosen.items():
        save_affine_weights(tmp_path / name, params)
    with structlog.testing.capture_logs() as logs, start_worker(make_config(tmp_path)) as server:
        assert isinstance(server, ServerThread)
        client = grpcclient.InferenceServerClient(server.url)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert sorted(m["name"] for m in index) == sorted(f"v{i}" for i in range(count))
        assert all(m["state"] == "READY" for m in index)
        assert server.call(lambda: len(server.worker.programs)) == 1
        for name, params in chosen.items():
            assert_close(affine_output(client, name), affine(params, X))
        assert_close(affine_output(client, "v3"), affine(PARAMS, X))
        client.close()
        request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}")
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert {m["name"] for m in json.load(answer)} == {m["name"] for m in index}
        samples = _scrape(server)
    exposed = {dict(labels)["model"] for (name, labels) in samples if name == "hloserve_model_weight_bytes"}
    assert len(exposed) == 1000 and {*chosen, "v3"} <= exposed
    assert samples[("hloserve_models_unexposed", ())] == count - 1000
    executions = {
        dict(labels)["model"]: v
        for (name, labels), v in samples.items()
        if name == "hloserve_executions_total"
    }
    assert all(executions[name] >= 1 for name in (*chosen, "v3"))
    loaded = [e for e in logs if e["event"] == "model loaded"]
    assert len(loaded) == count
    assert sum("shared_with" in e for e in loaded) == count - 1
    assert {e["program"] for e in loaded} == {loaded[0]["program"]}


_EIGEN_CONVOLUTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
"""The option set the exporter keeps for dense convolutional nets on CPU (hloserve.export.tuning)."""


def _with_xla_options(directory: Path, options: dict[str, Any]) -> Path:
    def add(manifest: dict[str, Any]) -> None:
        manifest["xla_options"] = {"cpu": options}

    edit_manifest(directory, add)
    return directory


def _ynn_convolutions(program: Any) -> list[bool]:
    """Per executable, whether XLA sent a convolution to YNNPACK: a computation that a
    `ynn_fusion` instruction calls holds a convolution, in the optimized HLO."""
    found = []
    for _, executable in sorted(program.executables.items()):
        text = executable.hlo_modules()[0].to_string()
        bodies = dict(re.findall(r"^(?:ENTRY )?%(\S+) \(.*?\{\n(.*?)^\}", text, re.MULTILINE | re.DOTALL))
        called = re.findall(r"%ynn_fusion\S* = .*?calls=%([\w.-]+)", text)
        found.append(any("convolution(" in bodies[name] for name in called))
    return found


def test_a_bundles_xla_options_compile_its_program_apart_from_the_defaults(tmp_path: Path) -> None:
    write_convolutions(tmp_path / "convs")
    tuned = shutil.copytree(tmp_path / "convs", tmp_path / "tuned")
    _with_xla_options(tuned, _EIGEN_CONVOLUTIONS)
    edit_manifest(tuned, _named("tuned"))
    cache = ExecutableCache(tmp_path / "cache")
    programs = Programs(cache)
    default, _ = programs.load(load_bundle(tmp_path / "convs"))
    program, shared = programs.load(load_bundle(tuned))
    assert not shared and program is not default  # same modules, other options: another program
    assert cache.misses == 4  # two batch sizes each, cached under keys of their own
    assert _ynn_convolutions(default) == [True, True]  # XLA's default: YNNPACK's
    assert _ynn_convolutions(program) == [False, False]
    again, _ = Programs(cache).load(load_bundle(tuned))  # read back from the cache, options kept
    assert cache.hits == 2 and _ynn_convolutions(again) == [False, False]


def test_xla_options_for_another_platform_change_nothing_here(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "cnn", tmp_path / "cnn")
    other = shutil.copytree(EXAMPLES / "cnn", tmp_path / "other")
    cuda_only = {"cuda": {"xla_gpu_autotune_level": 0}}
    edit_manifest(other, lambda m: m.update(name="other", xla_options=cuda_only))
    programs = Programs(None)
    default, _ = programs.load(load_bundle(tmp_path / "cnn"))
    assert programs.load(load_bundle(other)) == (default, True)


def test_an_option_xla_does_not_know_fails_only_its_bundle(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "cnn", tmp_path / "cnn")
    _with_xla_options(shutil.copytree(EXAMPLES / "cnn", tmp_path / "typo"), {"xla_cpu_no_such_option": True})
    edit_manifest(tmp_path / "typo", _named("typo"))
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["cnn"].state == "READY"
        assert index["typo"].state == "UNAVAILABLE"
        assert "xla_cpu_no_such_option" in index["typo"].reason, index["typo"].reason
        logits = infer(client, "cnn", {"IMAGE": np.zeros((1, 16, 16, 3), np.float32)}).as_numpy("LOGITS")
        assert logits.shape == (1, 10) and np.isfinite(logits).all()  # the other bundle still serves
        client.close()
