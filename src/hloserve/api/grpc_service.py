"""The KServe V2 / Triton gRPC service: an adapter over the planes, translating nothing but the
protocol: inference and readiness through the data plane (`hloserve.api.data_plane`), metadata,
configuration, statistics and trace settings through the model plane (`hloserve.api.model_plane`),
the repository and shared-memory regions through the repository plane
(`hloserve.api.repository_plane`).

ModelInfer bypasses the generated dataclass path: its handler is swapped in `__mapping__` for
one that parses with the google.protobuf classes compiled under `hloserve_hot` (same fields,
another package, so tritonclient's descriptors can share the process) and hands the request to
the data plane. RepositoryIndex answers with the same package's protobuf message: the node's
controller asks every worker for it each round, and at 10,000 models building it in betterproto2
and copying it into its upb mirror took 76 ms, against 38 ms built in upb. Every other RPC
uses the betterproto2 messages. Errors become statuses in `hloserve.api.status` only.
"""

from __future__ import annotations

import functools
import time

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._proto.hot import hot_status_pb2 as hot_status
from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve.api.data_plane import DataPlane
from hloserve.api.model_plane import EXTENSIONS, ModelPlane
from hloserve.api.repository_plane import RepositoryPlane, cuda_region_status, no_cuda_regions
from hloserve.api.status import grpc_errors as _rpc
from hloserve.api.status import to_grpc_error
from hloserve.api.tensor_codec import InferRequest
from hloserve.errors import Unimplemented

__all__ = ["EXTENSIONS", "InferenceService"]

_SERVICE = "/inference.GRPCInferenceService/"
_BUILT = {
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "RepositoryModelLoad", "RepositoryModelUnload",
    "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
    "TraceSetting", "CudaSharedMemoryRegister",
}  # fmt: skip


class InferenceService(kserve.GrpcInferenceServiceBase):
    """`inference.GRPCInferenceService` over a process's three planes."""

    def __init__(self, *, data: DataPlane, models: ModelPlane, repository: RepositoryPlane) -> None:
        self._data = data
        self._models = models
        self._repository = repository

    def close(self) -> None:
        self._repository.close()

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
        index = mapping[_SERVICE + "RepositoryIndex"]
        mapping[_SERVICE + "RepositoryIndex"] = index._replace(reply_type=hot_status.RepositoryIndexResponse)
        return mapping

    async def _unimplemented(self, rpc: str, stream: object) -> None:
        raise GRPCError(
            Status.UNIMPLEMENTED, str(Unimplemented(rpc, "not built in this version of hloserve"))
        )

    # -- ModelInfer (hot path) -----------------------------------------------------------------

    async def _model_infer(self, stream: Stream[InferRequest, hot.ModelInferResponse]) -> None:
        received = time.monotonic_ns()
        request = await stream.recv_message()
        assert request is not None  # a unary call carries one (`grpclib_patches` answers one without)
        assert stream.metadata is not None  # a server's stream has its request's headers
        traceparent = stream.metadata.get("traceparent")
        try:
            with self._data.call("ModelInfer", request.model_name, traceparent, received) as call:
                response = await self._data.infer(request, stream.deadline, call.spans)
                await _grpclib_patches.send_reply(stream, response)
        except Exception as e:
            raise to_grpc_error(e, "ModelInfer") from None

    # -- health and metadata -------------------------------------------------------------------

    @_rpc("ServerLive")
    async def server_live(self, message: kserve.ServerLiveRequest) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    @_rpc("ServerReady")
    async def server_ready(self, message: kserve.ServerReadyRequest) -> kserve.ServerReadyResponse:
        return kserve.ServerReadyResponse(ready=await self._data.ready())

    @_rpc("ModelReady")
    async def model_ready(self, message: kserve.ModelReadyRequest) -> kserve.ModelReadyResponse:
        return kserve.ModelReadyResponse(ready=await self._data.model_ready(message.name, message.version))

    @_rpc("ServerMetadata")
    async def server_metadata(self, message: kserve.ServerMetadataRequest) -> kserve.ServerMetadataResponse:
        return await self._models.server_metadata()

    @_rpc("ModelMetadata")
    async def model_metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        return await self._models.metadata(message)

    @_rpc("ModelConfig")
    async def model_config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        return await self._models.config(message)

    @_rpc("TraceSetting")
    async def trace_setting(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        return await self._models.trace_settings(message)

    @_rpc("ModelStatistics")
    async def model_statistics(
        self, message: kserve.ModelStatisticsRequest
    ) -> kserve.ModelStatisticsResponse:
        return await self._models.statistics(message)

    # -- system shared memory ------------------------------------------------------------------

    @_rpc("SystemSharedMemoryRegister")
    async def system_shared_memory_register(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        return await self._repository.register_region(message)

    @_rpc("SystemSharedMemoryStatus")
    async def system_shared_memory_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        return await self._repository.region_status(message)

    @_rpc("SystemSharedMemoryUnregister")
    async def system_shared_memory_unregister(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        return await self._repository.unregister_region(message)

    # -- CUDA shared memory: none, as Triton without a GPU (so clients can clean up) ----------

    @_rpc("CudaSharedMemoryRegister")
    async def cuda_shared_memory_register(
        self, message: kserve.CudaSharedMemoryRegisterRequest
    ) -> kserve.CudaSharedMemoryRegisterResponse:
        raise no_cuda_regions("CudaSharedMemoryRegister")

    @_rpc("CudaSharedMemoryStatus")
    async def cuda_shared_memory_status(
        self, message: kserve.CudaSharedMemoryStatusRequest
    ) -> kserve.CudaSharedMemoryStatusResponse:
        cuda_region_status(message.name)
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
        return await self._repository.load(message)

    @_rpc("RepositoryModelUnload")
    async def repository_model_unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        return await self._repository.unload(message)

    @_rpc("RepositoryIndex")
    async def repository_index(  # type: ignore[override]  # the reply type `__mapping__` sets
        self, message: kserve.RepositoryIndexRequest
    ) -> hot_status.RepositoryIndexResponse:
        return await self._repository.index(message)
