"""The repository plane: what the protocol adapters (the gRPC servicer, the REST routes) serve of
the model repository (its index, loads and unloads) and of the client's shared-memory regions.

`RepositoryPlane` is the protocol, in the KServe V2 messages (betterproto2); `LocalRepositoryPlane`
its implementation in the engine, over its model table and its host. A frontend's loads, unloads
and regions are the engine's, answered over its link (`hloserve.frontends.frontend.LinkedRepositoryPlane`),
and a node's span its workers (`hloserve.fleet.services.NodeRepositoryPlane`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import betterproto2
import trio_asyncio

from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_status_pb2 as hot
from hloserve.api.data_plane import not_ready_because
from hloserve.api.shm_registry import Region, ShmRegistry
from hloserve.config import Config, ModelSettings
from hloserve.engine.statistics import Statistics
from hloserve.errors import ShmDisabled, ShmRegionNotFound, Unimplemented
from hloserve.models.load_files import FILE_PREFIX, check_files
from hloserve.models.load_override import CONFIG_PARAM, apply_config
from hloserve.models.manifest import FILE as MANIFEST
from hloserve.models.names import check_model_name

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry, ModelHost

__all__ = ["LocalRepositoryPlane", "RepositoryPlane", "cuda_region_status", "index_of", "no_cuda_regions"]


class RepositoryPlane(Protocol):
    """What the adapters serve of the repository and the client's regions (see the module
    docstring)."""

    async def index(self, message: kserve.RepositoryIndexRequest) -> hot.RepositoryIndexResponse:
        """The models served (and, unless `message.ready`, the bundles that are not)."""
        ...

    async def load(self, message: kserve.RepositoryModelLoadRequest) -> kserve.RepositoryModelLoadResponse:
        """Load (or reload) a model, with the settings and files the message carries."""
        ...

    async def unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse: ...

    async def register_region(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse: ...

    async def region_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        """Every region, or the one named (NOT_FOUND when it is not registered)."""
        ...

    async def unregister_region(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        """Unregister the region named, or every region."""
        ...

    def close(self) -> None:
        """Let go of what it holds (the shared-memory regions)."""
        ...


def no_cuda_regions(rpc: str) -> Unimplemented:
    """The refusal of a CUDA region's registration: hloserve has none, as Triton without a GPU
    (whose other CUDA RPCs answer as for no region, so that clients can clean up)."""
    return Unimplemented(
        rpc,
        "hloserve has no CUDA shared memory (as Triton built without GPU support); "
        "use system shared memory (--allow-client-shm)",
    )


def cuda_region_status(name: str) -> None:
    """CudaSharedMemoryStatus: no region (NOT_FOUND for one named)."""
    if name:
        raise ShmRegionNotFound(name)  # nothing is: hloserve has no CUDA shared memory


async def index_of(
    models: Mapping[str, ModelEntry], config: Config, statistics: Statistics, ready: bool
) -> hot.RepositoryIndexResponse:
    """RepositoryIndex over a model table: its models (only those ready, with `ready`) and,
    without `ready`, the repository's bundles not being served (as Triton). As upstream, the
    models a meta model calls are its parts, listed through it alone (still addressable). A
    protobuf (upb) message, which the node's controller reads from every worker each round
    (`hloserve.api.grpc_service`)."""
    parts = {callee for e in models.values() if e.ready for callee in e.calls}
    index: list[hot.RepositoryIndexResponse.ModelIndex] = []
    if not ready:
        unserved = await asyncio.to_thread(_unserved_bundles, config.server.model_repository, set(models))
        index = [
            hot.RepositoryIndexResponse.ModelIndex(
                name=name, version="1", state="UNAVAILABLE", reason="unloaded"
            )
            for name in unserved
        ]
    for entry in sorted(models.values(), key=lambda e: e.name):
        if entry.name in parts:
            continue
        reason = not_ready_because(entry, config, statistics)
        if reason is None or not ready:
            index.append(
                hot.RepositoryIndexResponse.ModelIndex(
                    name=entry.name,
                    version="1",
                    state="READY" if reason is None else "UNAVAILABLE",
                    reason=reason or "",
                )
            )
    index.sort(key=lambda m: m.name)
    return hot.RepositoryIndexResponse(models=index)


def _unserved_bundles(repository: Path, served: AbstractSet[str]) -> list[str]:
    """The names of the repository's bundle directories (each holding a manifest) not `served`.
    Only those cost a look for their manifest: at 10,000 served models, one stat each took 160 ms."""
    try:
        with os.scandir(repository) as entries:
            candidates = [e.name for e in entries if e.name not in served and e.is_dir()]
    except OSError:
        return []
    return [name for name in candidates if (repository / name / MANIFEST).is_file()]


class LocalRepositoryPlane:
    """The repository plane in the engine, over its model table and its host (which loads and
    unloads); the client's regions in `shm` (None: not allowed)."""

    def __init__(
        self,
        *,
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

    async def index(self, message: kserve.RepositoryIndexRequest) -> hot.RepositoryIndexResponse:
        return await index_of(self._models, self._config, self._statistics, message.ready)

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

    async def register_region(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        self._registry().register(message.name, message.key, message.offset, message.byte_size)
        return kserve.SystemSharedMemoryRegisterResponse()

    async def region_status(
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

    async def unregister_region(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        self._registry().unregister(message.name)
        return kserve.SystemSharedMemoryUnregisterResponse()

    async def load(self, message: kserve.RepositoryModelLoadRequest) -> kserve.RepositoryModelLoadResponse:
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

    async def unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        await trio_asyncio.trio_as_aio(self._host.unload_model)(message.model_name)
        return kserve.RepositoryModelUnloadResponse()
