"""The control service over gRPC: status, residency, policy and compaction.

`external` runs with 0 and 2 frontends (the control service answers from the engine through any
frontend); compaction is the engine's alone and stays one process (suite time).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import tritonclient.grpc as grpcclient
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.bundles import WEIGHT_BYTES, assert_affine_answers, write_affine
from support.clients import control
from support.servers import ServerThread, make_config, residency, start_worker
from tritonclient.utils import InferenceServerException

from hloserve._proto import hloserve_control as hc

T = TypeVar("T")


def _expect(
    server: ServerThread, call: Callable[[hc.ControlServiceStub], Awaitable[Any]], status: Status, says: str
) -> None:
    with pytest.raises(GRPCError) as raised:
        control(server, call)
    assert raised.value.status == status
    assert says in (raised.value.message or "")


@pytest.fixture(name="external", params=[0, 2], ids=["frontends0", "frontends2"])
def _external(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    for name in "ab":
        write_affine(tmp_path / name)
    config = make_config(tmp_path).replace("weights", externally_managed=True, budget_bytes=10 * WEIGHT_BYTES)
    with start_worker(config, frontends=request.param) as server:
        yield server


def test_status_reports_every_model(server: ServerThread, triton: Any) -> None:
    _infer_mlp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    import numpy as np

    _infer_mlp.set_data_from_numpy(np.ones((2, 16), np.float32))
    triton.infer("mlp", [_infer_mlp])
    status = control(server, lambda s: s.model_control_status(hc.ModelControlStatusRequest()))
    assert (status.residency_mode, status.discipline, status.weight_cache_max_bytes) == (
        "self_managed",
        "fair",
        0,
    )
    mlp = {m.name: m for m in status.models}["mlp"]
    assert mlp.residency == hc.Residency.SYSTEM and mlp.device_resident and mlp.host_resident
    assert mlp.weight_nbytes == 2704 and mlp.max_batch_size == 16 and mlp.weight == 1.0
    assert mlp.rows_served >= 2 and mlp.dispatch_count >= 1 and mlp.loads == 1
    assert [m.name for m in status.models] == ["cnn", "mlp", "pool", "severity_grader"]


def test_set_model_policy(server: ServerThread) -> None:
    control(
        server,
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="cnn", has_weight=True, weight=2.5)),
    )
    status = control(server, lambda s: s.model_control_status(hc.ModelControlStatusRequest()))
    assert {m.name: m.weight for m in status.models}["cnn"] == 2.5
    control(
        server,
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="cnn", has_weight=True, weight=1.0)),
    )
    _expect(
        server,
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="cnn", has_weight=True, weight=0)),
        Status.INVALID_ARGUMENT,
        "weight must be > 0",
    )
    _expect(
        server,
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="nope", has_weight=True, weight=1)),
        Status.NOT_FOUND,
        "unknown model: 'nope'",
    )
    _expect(
        server,
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="cnn", discipline="lifo")),
        Status.INVALID_ARGUMENT,
        "expected fair, fifo or edf",
    )


def test_residency_is_refused_when_self_managed(server: ServerThread) -> None:
    _expect(
        server,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="mlp", target=hc.Residency.DEVICE)),
        Status.FAILED_PRECONDITION,
        "residency is self-managed",
    )


def test_externally_managed_residency_over_grpc(external: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(external.url)
    with pytest.raises(InferenceServerException, match="not resident"):
        assert_affine_answers(client, "a")
    assert not client.is_model_ready("a")
    reply = control(
        external,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="a", target=hc.Residency.DEVICE)),
    )
    assert (reply.residency, reply.device_resident) == (hc.Residency.DEVICE, True)
    assert client.is_model_ready("a")  # ready means on the device
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index == {"a": "READY", "b": "UNAVAILABLE"}
    assert_affine_answers(client, "a")
    reply = control(
        external,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="a", target=hc.Residency.SYSTEM)),
    )
    assert (reply.residency, reply.device_resident) == (hc.Residency.SYSTEM, False)
    with pytest.raises(InferenceServerException, match="not resident"):
        assert_affine_answers(client, "a")
    reply = control(
        external,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="b", target=hc.Residency.UNPINNED)),
    )
    assert reply.residency == hc.Residency.UNPINNED
    status = {
        m.name: m
        for m in control(external, lambda s: s.model_control_status(hc.ModelControlStatusRequest())).models
    }
    assert status["b"].residency == hc.Residency.UNPINNED and not status["b"].host_resident
    _expect(
        external,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="a")),
        Status.INVALID_ARGUMENT,
        "target residency is unspecified",
    )
    _expect(
        external,
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="zzz", target=hc.Residency.DEVICE)),
        Status.NOT_FOUND,
        "unknown model: 'zzz'",
    )
    client.close()


def test_compact_memory_over_grpc(tmp_path: Path) -> None:
    for name in "abc":
        write_affine(tmp_path / name)
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for model in "abc":
            assert_affine_answers(client, model)
        reply = control(server, lambda s: s.compact_memory(hc.CompactMemoryRequest(reload_models=["c"])))
        assert (list(reply.reloaded_models), reply.resident_bytes_after) == (["c"], WEIGHT_BYTES)
        assert {n for n, (resident, _, _) in residency(server).items() if resident} == {"c"}
        status = control(server, lambda s: s.model_control_status(hc.ModelControlStatusRequest()))
        assert status.compactions == 1
        _expect(
            server,
            lambda s: s.compact_memory(hc.CompactMemoryRequest(reload_models=["nope"])),
            Status.NOT_FOUND,
            "unknown model: 'nope'",
        )
        client.close()
