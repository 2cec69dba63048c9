"""The planes' local implementations on their own, over a model table of real bundles (the
example repository's, as a frontend holds them: `Remote` entries, no engine): what the
adapters read through them, the one place a call is counted (`Call`), and the control plane's
checks before a change reaches the dispatch loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, cast

import numpy as np
import pytest
import trio
import trio_asyncio
from export_examples import reference
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.numerics import assert_close
from support.servers import EXAMPLES, make_config

from hloserve._proto import hloserve_control as hc
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.control_plane import LocalControlPlane
from hloserve.api.data_plane import UNKNOWN, Job, LocalDataPlane, Record
from hloserve.api.model_plane import EXTENSIONS, LocalModelPlane
from hloserve.api.repository_plane import LocalRepositoryPlane
from hloserve.api.shm_registry import ShmRegistry
from hloserve.config import Config, ModelSettings
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.model_table import Failed, ModelEntry, ModelHost, Remote
from hloserve.engine.policy import PolicyParams
from hloserve.engine.statistics import Statistics
from hloserve.errors import InvalidInput, ModelNotFound, ModelNotReady, ShmDisabled, Unimplemented
from hloserve.models.bundle import load_bundle

T = TypeVar("T")


class _Host:
    """The host a plane reads: the configuration (loads are the model table's, not tested here)."""

    def __init__(self, config: Config) -> None:
        self.config = config


@pytest.fixture(scope="module", name="config")
def _config() -> Config:
    return make_config(http_port=-1, metrics_port=-1)


@pytest.fixture(scope="module", name="models")
def _models() -> dict[str, ModelEntry]:
    bundle = load_bundle(EXAMPLES / "mlp")
    return {
        "mlp": ModelEntry("mlp", Remote(bundle, (1, 4, 8, 16), True, None)),
        "broken": ModelEntry("broken", Failed("its weights did not load")),
    }


@pytest.fixture(name="statistics")
def _statistics() -> Statistics:
    return Statistics()


def _serve(
    config: Config,
    models: dict[str, ModelEntry],
    statistics: Statistics,
    body: Callable[[LocalDataPlane], Awaitable[T]],
    record: Record | None = None,
) -> tuple[T, Metrics]:
    """`body(plane)` on asyncio inside trio, as the adapters run it (meta models and hooks are
    trio's), over a data plane whose execute step is the model's function (in place of the
    engine); its answer, and the metrics the plane counted in."""

    async def execute(entry: ModelEntry, job: Job) -> list[np.ndarray]:
        return [reference(entry.name, job.inputs[0])]

    async def main() -> tuple[T, Metrics]:
        async with trio_asyncio.open_loop():
            metrics = Metrics(statistics)
            metas = MetaModels(models, 1, 1, None, statistics, PolicyParams())
            plane = LocalDataPlane(
                config=config,
                models=models,
                statistics=statistics,
                metrics=metrics,
                metas=metas,
                execute=execute,
                record=record,
            )
            return await trio_asyncio.aio_as_trio(body)(plane), metrics

    return trio.run(main)


def _counted(metrics: Metrics, model: str, status: str) -> float:
    """Calls counted in `metrics` for `model` with `status`."""
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == {"model": model, "status": status}:
                return sample.value
    return 0.0


def _request(x: np.ndarray, model: str = "mlp") -> hot.ModelInferRequest:
    request = hot.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend(x.shape)
    request.raw_input_contents.append(x.tobytes())
    return request


class TestDataPlane:
    def test_a_call_that_answers_is_counted_ok_under_its_model(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        """A call that leaves its block without an error counts OK, for the model it names."""
        x = np.random.default_rng(0).random((3, 16), dtype=np.float32)

        async def serve(plane: LocalDataPlane) -> hot.ModelInferResponse:
            with plane.call("ModelInfer", "mlp") as call:
                assert call.model == "mlp" and call.spans is None  # tracing is off
                return await plane.infer(_request(x), None, call.spans)

        response, metrics = _serve(config, models, statistics, serve)
        out = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(3, 4)
        assert_close(out, reference("mlp", x))
        assert _counted(metrics, "mlp", "OK") == 1
        assert statistics["mlp"].success.count == 1 and statistics["mlp"].fail.count == 0

    def test_a_call_naming_no_model_of_the_table_is_counted_as_unknown(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        """The label of a model the table lacks is `UNKNOWN` (a client cannot grow the labels),
        and the status is the one its error stands for."""

        async def serve(plane: LocalDataPlane) -> None:
            with pytest.raises(ModelNotFound), plane.call("ModelInfer", "no-such-model") as call:
                assert call.model == UNKNOWN
                await plane.infer(_request(np.zeros((1, 16), np.float32), "no-such-model"), None)

        _, metrics = _serve(config, models, statistics, serve)
        assert _counted(metrics, UNKNOWN, "NOT_FOUND") == 1
        assert _counted(metrics, "no-such-model", "NOT_FOUND") == 0

    def test_a_failed_call_counts_its_status_and_an_unexpected_error_internal(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        async def serve(plane: LocalDataPlane) -> None:
            for error in (InvalidInput("mlp", "a bad shape"), RuntimeError("a bug")):
                with pytest.raises(type(error)), plane.call("ModelInfer", "mlp"):
                    raise error

        _, metrics = _serve(config, models, statistics, serve)
        assert _counted(metrics, "mlp", "INVALID_ARGUMENT") == 1
        assert _counted(metrics, "mlp", "INTERNAL") == 1
        assert statistics["mlp"].fail.count == 2

    def test_a_call_whose_client_went_away_is_not_counted(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        """A cancellation, or an error whose status is CANCELLED (REST's disconnect), ends the
        call uncounted."""

        async def serve(plane: LocalDataPlane) -> None:
            for error in (asyncio.CancelledError(), GRPCError(Status.CANCELLED, "gone")):
                with pytest.raises(type(error)), plane.call("ModelInfer", "mlp"):
                    raise error
            with plane.call("ModelInfer", "mlp"):  # the control: one that ends is counted
                pass

        _, metrics = _serve(config, models, statistics, serve)
        assert _counted(metrics, "mlp", "CANCELLED") == 0
        assert _counted(metrics, "mlp", "OK") == 1
        assert statistics["mlp"].success.count == 1 and statistics["mlp"].fail.count == 0

    def test_calls_go_to_the_record_it_was_given(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        """A frontend's plane records over its link: nothing is counted in its own metrics."""
        recorded: list[tuple[str, str, float]] = []

        async def serve(plane: LocalDataPlane) -> None:
            with plane.call("ModelInfer", "mlp"):
                pass

        _, metrics = _serve(config, models, statistics, serve, record=lambda *call: recorded.append(call))
        assert [(m, s) for m, s, _ in recorded] == [("mlp", "OK")]
        assert _counted(metrics, "mlp", "OK") == 0

    def test_readiness_is_the_tables(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        async def serve(plane: LocalDataPlane) -> None:
            assert await plane.model_ready("mlp") and await plane.model_ready("mlp", "1")
            assert not await plane.model_ready("mlp", "2")
            assert not await plane.model_ready("broken")
            assert not await plane.ready()  # one bundle failed
            assert plane.serves("broken") and not plane.serves("absent")
            with pytest.raises(InvalidInput, match="version"):
                await plane.model_ready("mlp", "one")

        _serve(config, models, statistics, serve)


class TestModelPlane:
    @pytest.fixture(name="plane")
    def _plane(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> LocalModelPlane:
        return LocalModelPlane(
            config=config, models=models, statistics=statistics, host=_Host(config), platform="cpu"
        )

    def test_server_metadata_names_the_extensions(self, plane: LocalModelPlane) -> None:
        answer = asyncio.run(plane.server_metadata())
        assert answer.name == "hloserve" and tuple(answer.extensions) == EXTENSIONS

    def test_metadata_is_the_manifests(self, plane: LocalModelPlane) -> None:
        answer = asyncio.run(plane.metadata(kserve.ModelMetadataRequest("mlp", "")))
        assert answer.platform == "stablehlo_cpu" and answer.versions == ["1"]
        assert [(t.name, t.datatype, t.shape) for t in answer.inputs] == [("INPUT0", "FP32", [-1, 16])]
        assert [(t.name, t.datatype, t.shape) for t in answer.outputs] == [("OUTPUT0", "FP32", [-1, 4])]

    def test_config_takes_the_load_settings_of_its_host(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        """ModelConfig reads the configuration as the host holds it now (a load's settings)."""
        host = _Host(config)
        plane = LocalModelPlane(
            config=config, models=models, statistics=statistics, host=host, platform="cpu"
        )
        before = asyncio.run(plane.config(kserve.ModelConfigRequest("mlp", ""))).config
        assert before.max_batch_size == 16 and before.input[0].dims == [16]
        host.config = config.replace("scheduler", models={"mlp": ModelSettings(max_batch_size=4)})
        after = asyncio.run(plane.config(kserve.ModelConfigRequest("mlp", ""))).config
        assert after.max_batch_size == 4
        assert after.dynamic_batching is not None and after.dynamic_batching.preferred_batch_size == [1, 4]

    def test_metadata_of_a_model_not_ready_says_why(self, plane: LocalModelPlane) -> None:
        with pytest.raises(ModelNotReady, match="its weights did not load"):
            asyncio.run(plane.metadata(kserve.ModelMetadataRequest("broken", "")))
        with pytest.raises(ModelNotFound):
            asyncio.run(plane.config(kserve.ModelConfigRequest("absent", "")))

    def test_statistics_of_one_model_or_all(self, plane: LocalModelPlane, statistics: Statistics) -> None:
        statistics["mlp"].success.add(0.5)
        one = asyncio.run(plane.statistics(kserve.ModelStatisticsRequest("mlp", "")))
        assert [(s.name, s.inference_stats.success.count) for s in one.model_stats] == [("mlp", 1)]
        every = asyncio.run(plane.statistics(kserve.ModelStatisticsRequest("", "")))
        assert [s.name for s in every.model_stats] == ["broken", "mlp"]
        with pytest.raises(InvalidInput, match="requested statistics are not available"):
            asyncio.run(plane.statistics(kserve.ModelStatisticsRequest("absent", "")))

    def test_trace_settings_are_read_not_changed(self, plane: LocalModelPlane) -> None:
        answer = asyncio.run(plane.trace_settings(kserve.TraceSettingRequest({}, "mlp")))
        assert "trace_level" in answer.settings
        change = {"trace_rate": kserve.TraceSettingRequestSettingValue(["1"])}
        with pytest.raises(Unimplemented, match="changing trace settings"):
            asyncio.run(plane.trace_settings(kserve.TraceSettingRequest(change, "")))
        with pytest.raises(ModelNotFound):
            asyncio.run(plane.trace_settings(kserve.TraceSettingRequest({}, "absent")))


class TestRepositoryPlane:
    def _plane(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics, shm: ShmRegistry | None
    ) -> LocalRepositoryPlane:
        host: ModelHost = _Host(config)  # type: ignore[assignment]  # loads are not called here
        return LocalRepositoryPlane(host=host, config=config, models=models, statistics=statistics, shm=shm)

    def test_the_index_lists_the_table_and_the_bundles_not_served(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        plane = self._plane(config, models, statistics, None)
        index = asyncio.run(plane.index(kserve.RepositoryIndexRequest(ready=False))).models
        states = {m.name: (m.state, m.reason) for m in index}
        assert states["mlp"] == ("READY", "")
        assert states["broken"] == ("UNAVAILABLE", "its weights did not load")
        on_disk = {p.name for p in Path(EXAMPLES).iterdir() if (p / "manifest.yaml").is_file()}
        assert {n for n, (_, reason) in states.items() if reason == "unloaded"} == on_disk - set(models)
        ready = asyncio.run(plane.index(kserve.RepositoryIndexRequest(ready=True))).models
        assert [m.name for m in ready] == ["mlp"]

    def test_regions_register_list_and_unregister(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics, tmp_path: Path
    ) -> None:
        from multiprocessing import shared_memory

        memory = shared_memory.SharedMemory(create=True, size=4096)
        try:
            plane = self._plane(config, models, statistics, ShmRegistry(4, 1 << 20))
            key = "/" + memory.name.lstrip("/")
            asyncio.run(plane.register_region(kserve.SystemSharedMemoryRegisterRequest("r", key, 0, 4096)))
            status = asyncio.run(plane.region_status(kserve.SystemSharedMemoryStatusRequest("")))
            assert [(r.name, r.byte_size) for r in status.regions.values()] == [("r", 4096)]
            asyncio.run(plane.unregister_region(kserve.SystemSharedMemoryUnregisterRequest("r")))
            assert not asyncio.run(plane.region_status(kserve.SystemSharedMemoryStatusRequest(""))).regions
            plane.close()
        finally:
            memory.close()
            memory.unlink()

    def test_regions_are_refused_where_not_allowed(
        self, config: Config, models: dict[str, ModelEntry], statistics: Statistics
    ) -> None:
        plane = self._plane(config, models, statistics, None)
        with pytest.raises(ShmDisabled):
            asyncio.run(plane.register_region(kserve.SystemSharedMemoryRegisterRequest("r", "/k", 0, 8)))


class _ControlHost:
    """The host the control plane changes: what reached its dispatch loop, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    async def set_policy(self, model: str | None, *, weight: float | None, discipline: str | None) -> None:
        self.calls.append(("policy", model, weight, discipline))

    async def set_residency(self, model: str, floor: str) -> tuple[str, bool]:
        self.calls.append(("residency", model, floor))
        return floor, floor == "device"


def _control(body: Callable[[LocalControlPlane], Awaitable[T]]) -> tuple[T, _ControlHost]:
    """`body(plane)` on asyncio inside trio, as the control service runs it (the host is trio's)."""
    host = _ControlHost()

    async def main() -> T:
        async with trio_asyncio.open_loop():
            return await trio_asyncio.aio_as_trio(body)(LocalControlPlane(cast(ModelHost, host)))

    return trio.run(main), host


class TestControlPlane:
    @pytest.mark.parametrize(
        ("message", "said"),
        [
            (
                hc.SetModelPolicyRequest("m", has_weight=True, weight=0.0),
                "weight must be > 0 and finite, got 0.0",
            ),
            (hc.SetModelPolicyRequest("m", has_weight=True, weight=float("nan")), "got nan"),
            (hc.SetModelPolicyRequest("m", has_weight=True, weight=float("inf")), "got inf"),
            (
                hc.SetModelPolicyRequest("m", discipline="lifo"),
                "discipline 'lifo'; expected fair, fifo or edf",
            ),
            (
                hc.SetModelResidencyRequest("m", hc.Residency.RESIDENCY_UNSPECIFIED),
                "unspecified; expected UNPINNED, SYSTEM or DEVICE",
            ),
        ],
        ids=["weight-0", "weight-nan", "weight-inf", "discipline", "residency"],
    )
    def test_a_bad_change_is_refused_before_the_dispatch_loop_hears_of_it(
        self, message: object, said: str
    ) -> None:
        async def change(plane: LocalControlPlane) -> InvalidInput:
            call = plane.set_policy if isinstance(message, hc.SetModelPolicyRequest) else plane.set_residency
            with pytest.raises(InvalidInput) as refused:
                await call(message)  # type: ignore[arg-type]
            return refused.value

        refusal, host = _control(change)
        assert host.calls == []
        assert str(refusal).startswith("model 'm': ") and said in str(refusal), str(refusal)

    def test_changes_reach_the_dispatch_loop_as_parsed(self) -> None:
        async def change(plane: LocalControlPlane) -> hc.SetModelResidencyResponse:
            await plane.set_policy(
                hc.SetModelPolicyRequest("m", has_weight=True, weight=2.5, discipline="edf")
            )
            await plane.set_policy(hc.SetModelPolicyRequest("n"))  # nothing set: both left as they are
            return await plane.set_residency(hc.SetModelResidencyRequest("m", hc.Residency.DEVICE))

        pinned, host = _control(change)
        assert host.calls == [
            ("policy", "m", 2.5, "edf"),
            ("policy", "n", None, None),
            ("residency", "m", "device"),
        ]
        assert pinned.residency == hc.Residency.DEVICE and pinned.device_resident
