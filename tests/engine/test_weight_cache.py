"""The weight cache on CPU with a small byte budget: LRU order, pinning, over-budget, external mode.

One process: the weight cache is the engine's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog
import trio
import tritonclient.grpc as grpcclient
from support.bundles import (
    PARAMS,
    WEIGHT_BYTES,
    affine,
    assert_affine_answers,
    save_affine_weights,
    write_affine,
)
from support.numerics import assert_close
from support.servers import ServerThread, make_config, residency, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import ModelSettings, WeightsConfig


def _server(
    tmp_path: Path,
    names: str,
    budget: int | None,
    external: bool = False,
    pin: bool | None = None,
    **floors: str,
) -> ServerThread:
    for name in names:
        write_affine(tmp_path / name)
    settings = {name: ModelSettings(residency=floor) for name, floor in floors.items()}  # type: ignore[arg-type]
    config = make_config(tmp_path, scheduler={"models": settings})
    config = config.replace("weights", budget_bytes=budget, externally_managed=external, pin_host_floors=pin)
    return start_worker(config)


def test_least_recently_used_is_evicted_to_fit_the_budget(tmp_path: Path) -> None:
    with _server(tmp_path, "abc", budget=2 * WEIGHT_BYTES + 10) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert residency(server) == {"a": (False, 0, 0), "b": (False, 0, 0), "c": (False, 0, 0)}
        for model in "abc":
            assert_affine_answers(client, model)
        assert residency(server) == {"a": (False, 1, 1), "b": (True, 1, 0), "c": (True, 1, 0)}
        assert_affine_answers(client, "b")  # b is now the most recent: c is next out
        assert_affine_answers(client, "a")
        assert residency(server) == {"a": (True, 2, 1), "b": (True, 1, 0), "c": (False, 1, 1)}
        client.close()


def test_a_device_pinned_model_is_never_evicted(tmp_path: Path) -> None:
    with _server(tmp_path, "abp", budget=WEIGHT_BYTES + 10, p="device") as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert residency(server)["p"] == (True, 0, 0)  # loaded at start
        for model in "abpab":
            assert_affine_answers(client, model)
        state = residency(server)
        assert state["p"] == (True, 0, 0)
        assert state["a"] == (False, 2, 2) and state["b"] == (True, 2, 1)
        client.close()


def test_a_model_larger_than_the_budget_loads_alone_with_a_warning(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        with _server(tmp_path, "ab", budget=WEIGHT_BYTES // 2) as server:
            client = grpcclient.InferenceServerClient(server.url)
            assert_affine_answers(client, "a")
            assert_affine_answers(client, "b")
            assert residency(server) == {"a": (False, 1, 1), "b": (True, 1, 0)}
            client.close()
    warnings = [e for e in logs if e["event"].startswith("model exceeds the weight budget")]
    assert [e["model"] for e in warnings] == ["a", "b"]


def test_unpinned_models_are_read_from_the_file_at_each_load(tmp_path: Path) -> None:
    """`unpinned` re-reads the file at every load; `system` keeps the floor read at start."""

    with _server(tmp_path, "ab", budget=WEIGHT_BYTES + 10, a="unpinned") as server:
        client = grpcclient.InferenceServerClient(server.url)
        for model in "abab":
            assert_affine_answers(client, model)
        assert residency(server) == {"a": (False, 2, 2), "b": (True, 2, 1)}
        doubled = {"b": PARAMS["b"] * 2, "w": PARAMS["w"] * 2}
        for name in "ab":
            save_affine_weights(tmp_path / name, doubled)
        x = np.ones((1, 4), np.float32)
        tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        tensor.set_data_from_numpy(x)
        assert_close(client.infer("a", [tensor]).as_numpy("OUTPUT"), affine(doubled, x))
        assert_affine_answers(client, "b")  # evicted meanwhile and reloaded from its host floor: old weights
        client.close()


def test_externally_managed_refuses_a_model_not_on_the_device(tmp_path: Path) -> None:
    with _server(tmp_path, "ap", budget=None, external=True, p="device") as server:
        client = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as raised:
            assert_affine_answers(client, "a")
        assert raised.value.status() == "StatusCode.FAILED_PRECONDITION"
        assert "model 'a' is not resident and residency is externally managed" in raised.value.message()
        assert_affine_answers(client, "p")  # a pinned model serves
        assert residency(server)["a"] == (False, 0, 0)
        assert not client.is_model_ready("a") and client.is_model_ready("p")
        index = {m.name: (m.state, m.reason) for m in client.get_model_repository_index().models}
        assert index == {
            "a": ("UNAVAILABLE", "not resident; residency is externally managed"),
            "p": ("READY", ""),
        }
        client.close()


def test_weights_budget_is_validated() -> None:
    from hloserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"weights\.budget_bytes: must be >= 0"):
        WeightsConfig(budget_bytes=-1).validate()


def test_compaction_frees_every_unpinned_model_and_reloads_exactly_the_list(tmp_path: Path) -> None:
    with _server(tmp_path, "abcp", budget=None, p="device") as server:
        client = grpcclient.InferenceServerClient(server.url)
        for model in "abc":
            assert_affine_answers(client, model)
        assert all(resident for resident, _, _ in residency(server).values())
        done = trio.from_thread.run(server.worker.compact, ["b"], trio_token=server._token)
        assert done.reloaded == ("b",) and done.resident_bytes == WEIGHT_BYTES
        state = residency(server)
        assert {n for n, (resident, _, _) in state.items() if resident} == {"b", "p"}  # p is pinned
        assert state["b"] == (True, 2, 0)
        assert server.call(lambda: server.worker.statistics.compactions) == 1
        assert_affine_answers(client, "a")  # serves on, loading again
        client.close()


def test_compaction_every_n_loads(tmp_path: Path) -> None:
    _server(tmp_path, "abc", budget=None).stop()
    config = make_config(tmp_path, scheduler={"compaction_interval": 2})
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for model in "abc":  # the third load finds 2 loads since the last compaction
            assert_affine_answers(client, model)
        state = residency(server)
        assert {n for n, (resident, _, _) in state.items() if resident} == {"c"}
        assert server.call(lambda: server.worker.statistics.compactions) == 1
        client.close()


def _pinned(server: ServerThread) -> dict[str, bool]:
    stats = server.call(server.worker.statistics.snapshot)
    return {n: s.host_pinned for n, s in sorted(stats.items()) if s.residency}


def test_system_floors_are_pinned_at_start_and_load_from_there(tmp_path: Path) -> None:
    with _server(tmp_path, "abu", budget=WEIGHT_BYTES + 10, pin=True, u="unpinned") as server:
        assert _pinned(server) == {"a": True, "b": True, "u": False}  # the CPU lists pinned_host too
        client = grpcclient.InferenceServerClient(server.url)
        for model in "abuab":
            assert_affine_answers(client, model)
        assert residency(server)["b"] == (True, 2, 1)
        client.close()


@pytest.mark.parametrize("pin", [False, None])
def test_pinning_off_and_by_default_on_a_cpu_keeps_floors_pageable(tmp_path: Path, pin: bool | None) -> None:
    """On a CPU the device aliases a pageable floor; a pinned one would cost a copy per load."""
    with _server(tmp_path, "ab", budget=WEIGHT_BYTES + 10, pin=pin) as server:
        assert _pinned(server) == {"a": False, "b": False}
        client = grpcclient.InferenceServerClient(server.url)
        for model in "aba":
            assert_affine_answers(client, model)
        client.close()


def test_pinning_that_fails_leaves_the_floor_pageable_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hloserve.models import _xla

    def refuse(arrays: object) -> None:
        raise RuntimeError("RESOURCE_EXHAUSTED: cudaHostAlloc failed: locked memory limit\nmore")

    monkeypatch.setattr(_xla, "pin", refuse)
    with structlog.testing.capture_logs() as logs:
        with _server(tmp_path, "ab", budget=WEIGHT_BYTES + 10, pin=True) as server:
            assert _pinned(server) == {"a": False, "b": False}
            client = grpcclient.InferenceServerClient(server.url)
            for model in "aba":
                assert_affine_answers(client, model)
            client.close()
    failed = [e for e in logs if e["event"].startswith("pinning the host floor failed")]
    assert [(e["model"], e["error"]) for e in failed] == [
        ("a", "RESOURCE_EXHAUSTED: cudaHostAlloc failed: locked memory limit"),
        ("b", "RESOURCE_EXHAUSTED: cudaHostAlloc failed: locked memory limit"),
    ]
    assert failed[0]["log_level"] == "warning"


def test_shared_host_floors_stay_pageable_and_serve(tmp_path: Path) -> None:
    """JAX pins only memory it allocates, so a region shared with other workers is not pinned."""
    for name in "ab":
        write_affine(tmp_path / name)
    config = make_config(tmp_path).replace(
        "weights", budget_bytes=WEIGHT_BYTES + 10, shared_host_weights=True, pin_host_floors=True
    )
    with start_worker(config) as server:
        assert _pinned(server) == {"a": False, "b": False}
        client = grpcclient.InferenceServerClient(server.url)
        for model in "aba":
            assert_affine_answers(client, model)
        client.close()
