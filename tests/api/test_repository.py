"""Triton's RepositoryModelLoad and RepositoryModelUnload on a live server."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import PARAMS, X, affine, affine_output, edit_manifest, save_affine_weights, write_affine
from support.numerics import assert_close
from support.servers import ServerThread, make_config, start_worker
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from hloserve.config import ModelSettings
from hloserve.export.jax import InputSpec, OutputSpec, export_bundle


@pytest.fixture(name="repo", params=[0, 2], ids=["frontends0", "frontends2"])
def _repo(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    write_affine(tmp_path / "steady")
    settings = {"late": ModelSettings(max_queue_delay_us=500_000)}  # holds lone rows half a second
    config = make_config(tmp_path, scheduler={"models": settings})
    with start_worker(config, frontends=request.param) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield tmp_path, server, client
        client.close()


def test_load_a_new_bundle_then_reload_it_changed(repo: Any) -> None:
    path, _, client = repo
    with pytest.raises(InferenceServerException, match="unknown model: 'late'"):
        affine_output(client, "late")
    write_affine(path / "late")
    client.load_model("late")
    assert client.is_model_ready("late")
    assert "late" in [m.name for m in client.get_model_repository_index().models]
    assert_close(affine_output(client, "late"), affine(PARAMS, X))
    doubled = {"b": PARAMS["b"] * 2, "w": PARAMS["w"] * 2}
    save_affine_weights(path / "late", doubled)
    client.load_model("late")
    assert_close(affine_output(client, "late"), affine(doubled, X))


def test_a_failed_reload_keeps_the_old_version_serving(repo: Any) -> None:
    path, _, client = repo
    write_affine(path / "late")
    client.load_model("late")
    edit_manifest(path / "late", lambda m: m.update(format_version="9"))
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("late")
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "bundle 'late', file 'manifest.yaml', field 'format_version'" in raised.value.message()
    assert_close(affine_output(client, "late"), affine(PARAMS, X))


def _queue_one(server: ServerThread, model: str) -> tuple[threading.Thread, list[str]]:
    """A request for `model` from another thread, returned once it waits in the model's queue
    (the `late` model holds a lone row for half a second); the list gets its outcome."""
    outcome: list[str] = []

    def queued() -> None:
        c = grpcclient.InferenceServerClient(server.url)
        try:
            affine_output(c, model)
            outcome.append("OK")
        except InferenceServerException as e:
            outcome.append(f"{e.status()} {e.message()}")
        c.close()

    thread = threading.Thread(target=queued)
    thread.start()
    deadline = time.monotonic() + 10
    while server.call(lambda: server.worker.statistics[model].queue_depth) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return thread, outcome


def test_unload_answers_queued_requests_not_found(repo: Any) -> None:
    path, server, client = repo
    write_affine(path / "late")
    client.load_model("late")
    thread, outcome = _queue_one(server, "late")
    client.unload_model("late")
    thread.join(10)
    assert outcome == ["StatusCode.NOT_FOUND Request for unknown model: 'late' is not found: it was unloaded"]
    assert not client.is_model_ready("late")
    with pytest.raises(InferenceServerException, match="unknown model: 'late'"):
        affine_output(client, "late")
    with pytest.raises(InferenceServerException, match="unknown model: 'late'") as raised:
        client.unload_model("late")
    assert raised.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="no bundle 'nothing'"):
        client.load_model("nothing")


def test_a_reload_with_other_tensors_answers_queued_requests_unavailable(repo: Any) -> None:
    """Requests checked against the old tensors cannot run on the new ones: they are answered
    with a retryable status saying why, and the new version serves what comes next."""
    path, server, client = repo
    write_affine(path / "late")
    client.load_model("late")
    thread, outcome = _queue_one(server, "late")
    shutil.rmtree(path / "late")
    export_bundle(
        lambda params, x: x * params["scale"],
        {"scale": np.float32(3)},
        [InputSpec("INPUT", (4,), letters="f")],
        path / "late",
        outputs=[OutputSpec("OUTPUT", letters="f")],  # [n, 4] where the old version gave [n, 3]
        verify=False,
    )
    client.load_model("late")
    thread.join(10)
    assert outcome == [
        "StatusCode.UNAVAILABLE model 'late' is not ready: it was reloaded with other tensors "
        "while this request was queued; send it again"
    ]
    assert_close(affine_output(client, "late"), X * 3)


def test_load_and_unload_while_another_model_is_under_load(repo: Any) -> None:
    path, server, client = repo
    stop = threading.Event()
    results: list[str] = []

    def steady() -> None:
        c = grpcclient.InferenceServerClient(server.url)
        while not stop.is_set():
            try:
                assert_close(affine_output(c, "steady"), affine(PARAMS, X))
                results.append("OK")
            except Exception as e:
                results.append(repr(e))
        c.close()

    threads = [threading.Thread(target=steady) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(3):
            write_affine(path / f"extra{i}")
            client.load_model(f"extra{i}")
            assert_close(affine_output(client, f"extra{i}"), affine(PARAMS, X))
            client.unload_model(f"extra{i}")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert results and set(results) == {"OK"}, [r for r in results if r != "OK"][:3]


def test_the_index_lists_every_bundle_loaded_or_not(repo: Any) -> None:
    """As Triton: an unloaded bundle stays in the index (UNAVAILABLE, "unloaded"); `ready` filters."""
    path, server, client = repo
    write_affine(path / "late")
    client.load_model("late")
    client.unload_model("late")
    index = client.get_model_repository_index()
    assert [(m.name, m.state, m.reason) for m in index.models] == [
        ("late", "UNAVAILABLE", "unloaded"),
        ("steady", "READY", ""),
    ]
    with grpc.insecure_channel(server.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        ready = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
    assert [m.name for m in ready.models] == ["steady"]
    affine_output(client, "steady")


def test_a_config_override_applies_the_serving_settings(repo: Any) -> None:
    """Triton's load `config`: batch limit and queue delay replace the model's settings."""
    path, _, client = repo
    write_affine(path / "late")
    client.load_model("late")
    before = client.get_model_config("late").config
    assert (before.max_batch_size, before.dynamic_batching.max_queue_delay_microseconds) == (2, 500_000)
    override = (
        '{"name": "late", "max_batch_size": 1, "dynamic_batching": {"max_queue_delay_microseconds": "0"}}'
    )
    client.load_model("late", config=override)
    after = client.get_model_config("late").config
    assert (after.max_batch_size, after.dynamic_batching.max_queue_delay_microseconds) == (1, 0)
    started = time.monotonic()
    assert_close(affine_output(client, "late"), affine(PARAMS, X))
    assert time.monotonic() - started < 0.4  # no longer held half a second for company


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{not json", "load parameter 'config' is not JSON"),
        ("[1]", "must be a JSON object"),
        ("[" * 60_000, "load parameter 'config' nests arrays or objects too deeply"),  # issue 25
        ('{"max_batch_size": "many"}', "field 'max_batch_size': must be an integer >= 1"),
        ('{"max_batch_size": 0}', "field 'max_batch_size': must be an integer >= 1"),
        ('{"name": "other"}', "field 'name': is 'other', the model loaded is 'steady'"),
        ('{"instance_group": []}', "field 'instance_group': is not supported"),
        ('{"dynamic_batching": {"priority_levels": 2}}', "field 'dynamic_batching.priority_levels': is not"),
        ('{"dynamic_batching": {"max_queue_delay_microseconds": -1}}', "must be an integer >= 0"),
    ],
)
def test_a_bad_config_override_is_invalid_argument_naming_the_field(
    repo: Any, config: str, says: str
) -> None:
    _, _, client = repo
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("steady", config=config)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert says in (raised.value.message() or "")
    if config.startswith(("{not", "[")):  # malformed: Triton's words, which its clients match on
        assert "failed to load" in (raised.value.message() or "")
    assert client.get_model_config("steady").config.max_batch_size == 2
    affine_output(client, "steady")


def test_a_batch_limit_below_every_compiled_size_is_refused(repo: Any) -> None:
    path, _, client = repo
    write_affine(path / "big", batch_sizes=(4, 8))
    with pytest.raises(
        InferenceServerException, match="field 'max_batch_size': 2 fits no compiled batch size"
    ):
        client.load_model("big", config='{"max_batch_size": 2}')
    affine_output(client, "steady")


def test_preferred_batch_sizes_are_the_only_sizes_run(repo: Any) -> None:
    """Triton's dynamic_batching.preferred_batch_size: the model runs only those compiled sizes,
    a lone row padded up to one; ModelConfig lists them."""
    path, _, client = repo
    write_affine(path / "padded", batch_sizes=(1, 2, 4))
    client.load_model("padded", config='{"dynamic_batching": {"preferred_batch_size": [4]}}')
    assert list(client.get_model_config("padded").config.dynamic_batching.preferred_batch_size) == [4]
    for _ in range(3):
        assert_close(affine_output(client, "padded"), affine(PARAMS, X))
    stats = client.get_inference_statistics("padded").model_stats[0]
    assert (stats.inference_count, stats.execution_count) == (3, 3)
    assert [b.batch_size for b in stats.batch_stats] == [4]
    client.load_model("padded", config='{"dynamic_batching": {"preferred_batch_size": []}}')  # all again
    assert list(client.get_model_config("padded").config.dynamic_batching.preferred_batch_size) == [1, 2, 4]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            '{"dynamic_batching": {"preferred_batch_size": [3, 4]}}',
            "[3] are not compiled batch sizes (compiled: [1, 2, 4])",
        ),
        (
            '{"max_batch_size": 2, "dynamic_batching": {"preferred_batch_size": [4]}}',
            "4 exceeds max_batch_size 2",
        ),
        ('{"dynamic_batching": {"preferred_batch_size": [0]}}', "must be an integer >= 1"),
    ],
)
def test_a_preferred_batch_size_not_compiled_is_refused(repo: Any, config: str, says: str) -> None:
    path, _, client = repo
    write_affine(path / "padded", batch_sizes=(1, 2, 4))
    client.load_model("padded")
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("padded", config=config)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert says in (raised.value.message() or "")
    assert "preferred_batch_size" in (raised.value.message() or "")
    assert list(client.get_model_config("padded").config.dynamic_batching.preferred_batch_size) == [1, 2, 4]
    affine_output(client, "padded")


def test_preferred_batch_sizes_in_the_config_file_must_be_compiled(tmp_path: Path) -> None:
    write_affine(tmp_path / "steady")
    write_affine(tmp_path / "padded", batch_sizes=(1, 2, 4))
    settings = {
        "steady": ModelSettings(preferred_batch_sizes=(8,)),
        "padded": ModelSettings(preferred_batch_sizes=(2,)),
    }
    with start_worker(make_config(tmp_path, scheduler={"models": settings})) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert not client.is_model_ready("steady")
        with grpc.insecure_channel(server.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest())
        [reason] = [m.reason for m in index.models if m.name == "steady"]
        assert "scheduler.models.steady" in reason and "[8] are not compiled batch sizes" in reason
        affine_output(client, "padded")
        stats = client.get_inference_statistics("padded").model_stats[0]
        assert [b.batch_size for b in stats.batch_stats] == [2]
        client.close()
