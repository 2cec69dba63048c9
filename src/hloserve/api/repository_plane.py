"""The RPCs whose state only the engine holds: per-model statistics, loads and unloads, and the
client's shared-memory regions (and, where residency is externally managed, the repository
index, whose readiness is residency).

`InferenceService` serves them through an `EngineRpcs`: the engine's own (`LocalEngineRpcs`, over
its model table) or, in a frontend, its link to the engine
(`hloserve.frontends.process.EngineOverLink`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import betterproto2
import trio_asyncio

from hloserve._proto import inference as kserve
from hloserve.api.data_plane import find_entry
from hloserve.api.shm_registry import Region, ShmRegistry
from hloserve.config import Config, ModelSettings
from hloserve.engine.statistics import Duration, ExecutionTimes, Statistics
from hloserve.errors import InvalidInput, ModelNotFound, ShmDisabled, ShmRegionNotFound
from hloserve.models.bundle import check_model_name
from hloserve.models.load_files import FILE_PREFIX, check_files
from hloserve.models.load_override import CONFIG_PARAM, apply_config

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry, ModelHost

__all__ = ["EngineRpcs", "LocalEngineRpcs"]


def _duration(d: Duration) -> kserve.StatisticDuration:
    return kserve.StatisticDuration(count=d.count, ns=d.ns)


class EngineRpcs(Protocol):
    """The RPCs only the engine answers (see the module docstring); errors become statuses in
    the service."""

    async def model_statistics(
        self, message: kserve.ModelStatisticsRequest
    ) -> kserve.ModelStatisticsResponse: ...
    async def repository_model_load(
        self, message: kserve.RepositoryModelLoadRequest
    ) -> kserve.RepositoryModelLoadResponse: ...
    async def repository_model_unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse: ...
    async def system_shared_memory_register(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse: ...
    async def system_shared_memory_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse: ...
    async def system_shared_memory_unregister(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse: ...
    async def repository_index(
        self, message: kserve.RepositoryIndexRequest
    ) -> kserve.RepositoryIndexResponse | None:
        """The engine's index where only it knows readiness; None: the service's model table
        answers."""
        ...

    def close(self) -> None:
        """Let go of what it holds (the shared-memory regions)."""
        ...


class LocalEngineRpcs:
    """`EngineRpcs` in the engine, over its model table and its host."""

    def __init__(
        self,
        host: ModelHost,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        shm: ShmRegistry | None = None,
    ) -> None:
        self._host = host
        self._config = config
        self._models = models
        self._statistics = statistics
        self._shm = shm
        """The client's shared-memory regions (None: not allowed)."""

    def close(self) -> None:
        """Close every registered shared-memory region."""
        if self._shm is not None:
            self._shm.close()

    async def repository_index(
        self, message: kserve.RepositoryIndexRequest
    ) -> kserve.RepositoryIndexResponse | None:
        return None  # the service's table is this one

    async def model_statistics(
        self, message: kserve.ModelStatisticsRequest
    ) -> kserve.ModelStatisticsResponse:
        try:
            names = (
                [find_entry(self._models, message.name, message.version).name]
                if message.name
                else sorted(self._models)
            )
        except ModelNotFound as e:  # as Triton: the statistics asked for are not available
            raise InvalidInput(message.name, f"requested statistics are not available: {e}") from None
        stats = []
        for name in names:
            s = self._statistics[name]

            def times(t: ExecutionTimes) -> dict[str, kserve.StatisticDuration]:
                return {
                    "compute_input": _duration(t.compute_input),
                    "compute_infer": _duration(t.compute_infer),
                    "compute_output": _duration(t.compute_output),
                }

            stats.append(
                kserve.ModelStatistics(
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
            )
        return kserve.ModelStatisticsResponse(model_stats=stats)

    def _registry(self) -> ShmRegistry:
        if self._shm is None:
            raise ShmDisabled()
        return self._shm

    def _registered(self, name: str) -> list[Region]:
        """Every region, or the one named (as Triton: NOT_FOUND when it is not registered)."""
        registry = self._registry()
        if name and name not in {r.name for r in registry.status()}:
            raise ShmRegionNotFound(name)
        return registry.status(name)

    async def system_shared_memory_register(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        self._registry().register(message.name, message.key, message.offset, message.byte_size)
        return kserve.SystemSharedMemoryRegisterResponse()

    async def system_shared_memory_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        return kserve.SystemSharedMemoryStatusResponse(
            regions={
                r.name: kserve.SystemSharedMemoryStatusResponseRegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
                for r in self._registered(message.name)
            }
        )

    async def system_shared_memory_unregister(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        self._registry().unregister(message.name)
        return kserve.SystemSharedMemoryUnregisterResponse()

    async def repository_model_load(
        self, message: kserve.RepositoryModelLoadRequest
    ) -> kserve.RepositoryModelLoadResponse:
        name = check_model_name(message.model_name)
        chosen = {
            key: betterproto2.which_one_of(p, "parameter_choice") for key, p in message.parameters.items()
        }
        parameters = {
            key: value if kind == "string_param" else None
            for key, (kind, value) in chosen.items()
            if not key.startswith(FILE_PREFIX)
        }
        current = self._host.config.scheduler.models.get(name, ModelSettings())
        settings = apply_config(name, parameters, current)
        sent = {
            key.removeprefix(FILE_PREFIX): value if kind == "bytes_param" else None
            for key, (kind, value) in chosen.items()
            if key.startswith(FILE_PREFIX)
        }
        server = self._config.server
        files = (
            check_files(
                name,
                sent,
                has_config=CONFIG_PARAM in parameters,
                max_files=server.max_load_files,
                max_bytes=server.max_load_file_bytes,
            )
            if sent
            else None
        )
        await trio_asyncio.trio_as_aio(self._host.load_model)(name, settings, files)
        return kserve.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        await trio_asyncio.trio_as_aio(self._host.unload_model)(message.model_name)
        return kserve.RepositoryModelUnloadResponse()
