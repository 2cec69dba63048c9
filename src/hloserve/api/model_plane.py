"""The model plane: what the protocol adapters (the gRPC servicer, the REST routes) answer about
the server and its models: server metadata, a model's metadata, configuration and statistics,
and the trace settings.

`ModelPlane` is the protocol, in the KServe V2 messages (betterproto2) that gRPC carries as they
are and REST writes as JSON; `LocalModelPlane` its implementation over a model table. A frontend
answers statistics through the engine (`hloserve.frontends.frontend.LinkedModelPlane`), a node
from its workers (`hloserve.fleet.services.NodeModelPlane`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from hloserve import dtypes
from hloserve._proto import inference as kserve
from hloserve._version import __version__
from hloserve.api.data_plane import find_entry, ready_entry
from hloserve.config import Config
from hloserve.engine.statistics import Duration, ExecutionTimes, Statistics
from hloserve.engine.tracing import settings, triton_trace_settings
from hloserve.errors import InvalidInput, ModelNotFound, Unimplemented
from hloserve.models.manifest import TensorSpec
from hloserve.models.names import check_model_name

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry

__all__ = ["EXTENSIONS", "ConfigHost", "LocalModelPlane", "ModelPlane"]

EXTENSIONS = ("model_configuration", "model_repository", "statistics", "system_shared_memory")
"""Triton protocol extensions hloserve implements, reported by ServerMetadata."""


class ModelPlane(Protocol):
    """What the adapters answer about the server and its models (see the module docstring)."""

    async def server_metadata(self) -> kserve.ServerMetadataResponse: ...

    async def metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        """A ready model's name, platform and tensors."""
        ...

    async def config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        """A ready model's configuration, in Triton's terms, with its load settings."""
        ...

    async def statistics(self, message: kserve.ModelStatisticsRequest) -> kserve.ModelStatisticsResponse:
        """One model's counters (`message.name`), or every model's."""
        ...

    async def trace_settings(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        """The trace settings, in Triton's keys; a request that changes any is refused."""
        ...


class ConfigHost(Protocol):
    """What the plane reads of its process's host: the configuration as loads changed it."""

    @property
    def config(self) -> Config: ...


def _duration(d: Duration) -> kserve.StatisticDuration:
    return kserve.StatisticDuration(count=d.count, ns=d.ns)


def _data_type(spec: TensorSpec) -> kserve.DataType:
    return kserve.DataType["TYPE_STRING" if spec.dtype is dtypes.BYTES else f"TYPE_{spec.dtype.wire}"]


class LocalModelPlane:
    """The model plane over a model table: its entries' manifests, this process's statistics and
    the configuration as `host` holds it now (load settings included). Models run on `platform`
    (a device platform's name: the engine's device's, which a frontend is told)."""

    def __init__(
        self,
        *,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        host: ConfigHost,
        platform: str,
    ) -> None:
        self._config = config
        self._models = models
        self._statistics = statistics
        self._host = host
        self.platform = f"stablehlo_{platform}"
        """The platform ModelMetadata and ModelConfig name."""

    async def server_metadata(self) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(
            name="hloserve", version=__version__, extensions=list(EXTENSIONS)
        )

    async def metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        entry = ready_entry(self._models, message.name, message.version)
        assert entry.bundle is not None
        manifest = entry.bundle.manifest

        def tensors(specs: tuple[TensorSpec, ...]) -> list[kserve.ModelMetadataResponseTensorMetadata]:
            return [
                kserve.ModelMetadataResponseTensorMetadata(
                    name=s.name, datatype=s.dtype.wire or "", shape=s.metadata_shape
                )
                for s in specs
            ]

        return kserve.ModelMetadataResponse(
            name=entry.name,
            versions=["1"],
            platform=self.platform,
            inputs=tensors(manifest.inputs),
            outputs=tensors(manifest.outputs),
        )

    async def config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        entry = ready_entry(self._models, message.name, message.version)
        assert entry.bundle is not None
        manifest = entry.bundle.manifest
        specs = (*manifest.inputs, *manifest.outputs)
        # Triton's max_batch_size > 0 means "dims exclude a leading batch axis"; a model whose
        # batch axis is elsewhere is described unbatched, with -1 where the batch goes. A meta
        # model has no compiled sizes: unbatched.
        leading = manifest.batched and all(s.batch_axis in (0, None) for s in specs)
        sizes = [b for b in entry.batch_sizes if b > 0]
        max_batch = sizes[-1] if leading and sizes else 0

        def dims(spec: TensorSpec) -> list[int]:
            shape = spec.metadata_shape
            return shape[1:] if max_batch and spec.batch_axis == 0 else shape

        policy = self._host.config.scheduler.models.get(entry.name)  # with load overrides
        if policy is not None and policy.max_batch_size and max_batch:  # above the largest: split
            max_batch = policy.max_batch_size
            sizes = [b for b in sizes if b <= max_batch]
        if policy is not None and policy.preferred_batch_sizes:  # the sizes it runs
            sizes = [b for b in sizes if b in policy.preferred_batch_sizes]
        return kserve.ModelConfigResponse(
            config=kserve.ModelConfig(
                name=entry.name,
                platform=self.platform,
                backend="python" if manifest.is_meta else "jax",
                max_batch_size=max_batch,
                version_policy=kserve.ModelVersionPolicy(latest=kserve.ModelVersionPolicyLatest(1)),
                input=[
                    kserve.ModelInput(
                        name=s.name,
                        data_type=_data_type(s),
                        dims=dims(s),
                        format=kserve.ModelInputFormat[s.format or "NONE"],
                    )
                    for s in manifest.inputs
                ],
                output=[
                    kserve.ModelOutput(name=s.name, data_type=_data_type(s), dims=dims(s))
                    for s in manifest.outputs
                ],
                dynamic_batching=kserve.ModelDynamicBatching(
                    preferred_batch_size=sizes,
                    max_queue_delay_microseconds=policy.max_queue_delay_us if policy else 0,
                )
                if max_batch
                else None,
            )
        )

    async def statistics(self, message: kserve.ModelStatisticsRequest) -> kserve.ModelStatisticsResponse:
        try:
            names = (
                [find_entry(self._models, message.name, message.version).name]
                if message.name
                else sorted(self._models)
            )
        except ModelNotFound as e:  # as Triton: the statistics asked for are not available
            raise InvalidInput(message.name, f"requested statistics are not available: {e}") from None
        return kserve.ModelStatisticsResponse(model_stats=[self._model_statistics(name) for name in names])

    def _model_statistics(self, name: str) -> kserve.ModelStatistics:
        s = self._statistics[name]

        def times(t: ExecutionTimes) -> dict[str, kserve.StatisticDuration]:
            return {
                "compute_input": _duration(t.compute_input),
                "compute_infer": _duration(t.compute_infer),
                "compute_output": _duration(t.compute_output),
            }

        return kserve.ModelStatistics(
            name=name,
            version="1",
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            inference_stats=kserve.InferStatistics(
                success=_duration(s.success),
                fail=_duration(s.fail),
                queue=_duration(s.queue),
                **times(s.compute),
            ),
            batch_stats=[
                kserve.InferBatchStatistics(batch_size=size, **times(t))
                for size, t in sorted(s.by_batch_size.items())
            ],
        )

    async def trace_settings(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        """The trace settings in Triton's keys (the same for every model: `model_name`, if any,
        must be served). They are fixed at start (the tracing section, OTEL_* variables): a
        request that changes any is refused."""
        if message.model_name:
            find_entry(self._models, check_model_name(message.model_name))
        if message.settings:
            raise Unimplemented(
                "TraceSetting",
                "changing trace settings while serving; they are set at start by the tracing "
                "section of the configuration or the OTEL_* variables",
            )
        current = triton_trace_settings(settings(self._config.tracing))
        return kserve.TraceSettingResponse(
            {k: kserve.TraceSettingResponseSettingValue(v) for k, v in current.items()}
        )
