"""The KServe V2 / Triton gRPC service: an adapter over the data plane (`hloserve.api.data_plane`)
for inference and readiness, and the metadata and repository RPCs; statistics, loads and
shared-memory regions through `hloserve.api.engine_rpcs` (the engine's, here or over a link).

ModelInfer bypasses the generated dataclass path: its handler is swapped in `__mapping__` for
one that parses with the google.protobuf classes compiled under `hloserve_hot` (same fields,
another package, so tritonclient's descriptors can share the process) and hands the request to
the data plane. Every other RPC uses the betterproto2 messages. Errors become statuses in
`hloserve.api.status` only.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from hloserve import dtypes
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve._version import __version__
from hloserve.api.codec import InferRequest
from hloserve.api.data_plane import DataPlane, find_entry, not_ready_because, ready_entry
from hloserve.api.engine_rpcs import EngineRpcs
from hloserve.api.status import grpc_errors as _rpc
from hloserve.api.status import to_grpc_error
from hloserve.config import Config
from hloserve.engine.statistics import Statistics
from hloserve.engine.tracing import settings, triton_trace_settings
from hloserve.errors import (
    ShmRegionNotFound,
    Unimplemented,
)
from hloserve.models.bundle import check_model_name
from hloserve.models.manifest import FILE as MANIFEST
from hloserve.models.manifest import TensorSpec

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry

__all__ = ["EXTENSIONS", "InferenceService"]

EXTENSIONS = ("model_configuration", "model_repository", "statistics", "system_shared_memory")
"""Triton protocol extensions hloserve implements, reported by ServerMetadata."""

_SERVICE = "/inference.GRPCInferenceService/"
_BUILT = {
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "RepositoryModelLoad", "RepositoryModelUnload",
    "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
    "TraceSetting", "CudaSharedMemoryRegister",
}  # fmt: skip


def _data_type(spec: TensorSpec) -> kserve.DataType:
    return kserve.DataType["TYPE_STRING" if spec.dtype is dtypes.BYTES else f"TYPE_{spec.dtype.wire}"]


class ServiceHost(Protocol):
    """What the service reads of its process's host: the configuration as loads changed it."""

    @property
    def config(self) -> Config: ...


class InferenceService(kserve.GrpcInferenceServiceBase):
    """`inference.GRPCInferenceService` over a process's model table and data plane; what only the
    engine answers, through `engine`."""

    def __init__(
        self,
        plane: DataPlane,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        host: ServiceHost,
        engine: EngineRpcs,
    ) -> None:
        self._plane = plane
        self._config = config
        self._models = models
        self._statistics = statistics
        self._host = host
        self._engine = engine
        """Where the RPCs that only the engine answers go (statistics, loads, regions)."""

    def close(self) -> None:
        self._engine.close()

    # -- routing -------------------------------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        mapping = dict(super().__mapping__())
        for path in mapping:
            rpc = path.removeprefix(_SERVICE)
            if rpc not in _BUILT:
                handler = mapping[path]
                mapping[path] = Handler(
                    functools.partial(self._unimplemented, rpc),
                    handler.cardinality,
                    handler.request_type,
                    handler.reply_type,
                )
        mapping[_SERVICE + "ModelInfer"] = Handler(
            self._model_infer, Cardinality.UNARY_UNARY, hot.ModelInferRequest, hot.ModelInferResponse
        )
        return mapping

    async def _unimplemented(self, rpc: str, stream: object) -> None:
        raise GRPCError(
            Status.UNIMPLEMENTED, str(Unimplemented(rpc, "not built in this version of hloserve"))
        )

    def _entry(self, name: str, version: str = "") -> ModelEntry:
        return find_entry(self._models, name, version)

    def _ready_entry(self, name: str, version: str = "") -> ModelEntry:
        return ready_entry(self._models, name, version)

    # -- ModelInfer (hot path) -----------------------------------------------------------------

    async def _model_infer(self, stream: Stream[InferRequest, hot.ModelInferResponse]) -> None:
        received = 0 if self._plane.tracing is None else time.monotonic_ns()
        request = await stream.recv_message()
        assert request is not None  # a unary call carries one (`grpclib_patches` answers one without)
        started = time.perf_counter()
        name = request.model_name
        label = name if name in self._models else "<unknown>"
        plane = self._plane
        spans = None
        if plane.tracing is not None:
            assert stream.metadata is not None  # a server's stream has its request's headers
            spans = plane.trace_request(label, stream.metadata.get("traceparent"), received)
        try:
            response = await plane.infer(request, stream.deadline, spans)
        except Exception as e:
            error = to_grpc_error(e, "ModelInfer")
            plane.count(label, error.status.name, time.perf_counter() - started)
            if spans is not None:
                spans.end(error.status.name)
            raise error from None
        except asyncio.CancelledError:  # the client cancelled or went away: not counted, but traced
            if spans is not None:
                spans.end("CANCELLED")
            raise
        plane.count(label, "OK", time.perf_counter() - started)
        await _grpclib_patches.send_reply(stream, response)
        if spans is not None:
            spans.mark("reply")
            spans.end()

    # -- health and metadata -------------------------------------------------------------------

    @_rpc("ServerLive")
    async def server_live(self, message: kserve.ServerLiveRequest) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    @_rpc("ServerReady")
    async def server_ready(self, message: kserve.ServerReadyRequest) -> kserve.ServerReadyResponse:
        return kserve.ServerReadyResponse(ready=await self._plane.ready())

    @_rpc("ModelReady")
    async def model_ready(self, message: kserve.ModelReadyRequest) -> kserve.ModelReadyResponse:
        return kserve.ModelReadyResponse(ready=await self._plane.model_ready(message.name, message.version))

    @_rpc("ServerMetadata")
    async def server_metadata(self, message: kserve.ServerMetadataRequest) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(
            name="hloserve", version=__version__, extensions=list(EXTENSIONS)
        )

    @_rpc("ModelMetadata")
    async def model_metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        entry = self._ready_entry(message.name, message.version)
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
            platform=self._plane.platform,
            inputs=tensors(manifest.inputs),
            outputs=tensors(manifest.outputs),
        )

    @_rpc("ModelConfig")
    async def model_config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        entry = self._ready_entry(message.name, message.version)
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
                platform=self._plane.platform,
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

    @_rpc("TraceSetting")
    async def trace_setting(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        """The trace settings in Triton's keys (the same for every model: `model_name`, if any,
        must be served). They are fixed at start (the tracing section, OTEL_* variables): a
        request that changes any is refused."""
        if message.model_name:
            self._entry(check_model_name(message.model_name))
        if message.settings:
            raise Unimplemented(
                "TraceSetting",
                "changing trace settings while serving; they are set at start by the tracing "
                "section of the configuration or the OTEL_* variables",
            )
        current = self.trace_settings()
        return kserve.TraceSettingResponse(
            {k: kserve.TraceSettingResponseSettingValue(v) for k, v in current.items()}
        )

    def trace_settings(self) -> dict[str, list[str]]:
        """This worker's trace settings, in the keys of Triton's TraceSetting."""
        return triton_trace_settings(settings(self._config.tracing))

    @_rpc("ModelStatistics")
    async def model_statistics(
        self, message: kserve.ModelStatisticsRequest
    ) -> kserve.ModelStatisticsResponse:
        return await self._engine.model_statistics(message)

    # -- system shared memory ------------------------------------------------------------------

    @_rpc("SystemSharedMemoryRegister")
    async def system_shared_memory_register(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        return await self._engine.system_shared_memory_register(message)

    @_rpc("SystemSharedMemoryStatus")
    async def system_shared_memory_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        return await self._engine.system_shared_memory_status(message)

    @_rpc("SystemSharedMemoryUnregister")
    async def system_shared_memory_unregister(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        return await self._engine.system_shared_memory_unregister(message)

    # -- CUDA shared memory: none, as Triton without a GPU (so clients can clean up) ----------

    @_rpc("CudaSharedMemoryRegister")
    async def cuda_shared_memory_register(
        self, message: kserve.CudaSharedMemoryRegisterRequest
    ) -> kserve.CudaSharedMemoryRegisterResponse:
        raise Unimplemented(
            "CudaSharedMemoryRegister",
            "hloserve has no CUDA shared memory (as Triton built without GPU support); "
            "use system shared memory (--allow-client-shm)",
        )

    @_rpc("CudaSharedMemoryStatus")
    async def cuda_shared_memory_status(
        self, message: kserve.CudaSharedMemoryStatusRequest
    ) -> kserve.CudaSharedMemoryStatusResponse:
        if message.name:
            raise ShmRegionNotFound(message.name)  # nothing is: hloserve has no CUDA shared memory
        return kserve.CudaSharedMemoryStatusResponse()

    @_rpc("CudaSharedMemoryUnregister")
    async def cuda_shared_memory_unregister(
        self, message: kserve.CudaSharedMemoryUnregisterRequest
    ) -> kserve.CudaSharedMemoryUnregisterResponse:
        return kserve.CudaSharedMemoryUnregisterResponse()  # nothing is registered: done

    # -- model repository ----------------------------------------------------------------------

    @_rpc("RepositoryModelLoad")
    async def repository_model_load(
        self, message: kserve.RepositoryModelLoadRequest
    ) -> kserve.RepositoryModelLoadResponse:
        return await self._engine.repository_model_load(message)

    @_rpc("RepositoryModelUnload")
    async def repository_model_unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        return await self._engine.repository_model_unload(message)

    @_rpc("RepositoryIndex")
    async def repository_index(
        self, message: kserve.RepositoryIndexRequest
    ) -> kserve.RepositoryIndexResponse:
        engines = await self._engine.repository_index(message)
        if engines is not None:
            return engines
        # As upstream: the models a meta model calls are its parts, listed through it alone
        # (still addressable by name).
        parts = {callee for e in self._models.values() if e.ready for callee in e.calls}
        index = []
        if not message.ready:  # as Triton: bundles not being served are listed too
            repository = self._config.server.model_repository
            on_disk = await asyncio.to_thread(_bundle_names, repository)
            index = [
                kserve.RepositoryIndexResponseModelIndex(
                    name=name, version="1", state="UNAVAILABLE", reason="unloaded"
                )
                for name in on_disk
                if name not in self._models
            ]
        for entry in sorted(self._models.values(), key=lambda e: e.name):
            if entry.name in parts:
                continue
            reason = not_ready_because(entry, self._config, self._statistics)
            if reason is None or not message.ready:
                index.append(
                    kserve.RepositoryIndexResponseModelIndex(
                        name=entry.name,
                        version="1",
                        state="READY" if reason is None else "UNAVAILABLE",
                        reason=reason or "",
                    )
                )
        return kserve.RepositoryIndexResponse(models=sorted(index, key=lambda m: m.name))


def _bundle_names(repository: Path) -> list[str]:
    """The names of the repository's bundle directories (each holding a manifest)."""
    try:
        return [p.name for p in repository.iterdir() if (p / MANIFEST).is_file()]
    except OSError:
        return []
