"""hloserve's own async KServe V2 client, over grpclib, with the codec helpers it uses.

It runs on asyncio; from trio, call it inside `trio_asyncio.open_loop()` through
`trio_asyncio.aio_as_trio`. ModelInfer uses the same google.protobuf hot-path messages as the
server; the other RPCs use the generated betterproto2 stub. Errors arrive as
`grpclib.exceptions.GRPCError` carrying the server's status and message.

    async with Client("127.0.0.1", 8001) as client:
        outputs = await client.infer("mlp", {"INPUT0": np.zeros((4, 16), np.float32)})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
from grpclib.client import UnaryUnaryMethod
from grpclib.config import Configuration

from hloserve import dtypes
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._transport.grpclib_patches import BigFrameChannel
from hloserve.api.tensor_codec import SHM_BYTE_SIZE, SHM_OFFSET, SHM_REGION, TIMEOUT_NS_PARAM
from hloserve.api.tensor_codec import InputTensor as _InputTensor
from hloserve.api.tensor_codec import RequestedOutput as _RequestedOutput
from hloserve.engine.buffer_pool import BufferPool as BufferPool  # register_pool's and encode_request_shm's

__all__ = [
    "BufferPool",
    "Client",
    "deadline_params",
    "decode_response",
    "encode_request",
    "encode_request_shm",
]

_INFER = "/inference.GRPCInferenceService/ModelInfer"


class Client:
    """One connection to a worker; use as `async with` or call `close()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8001) -> None:
        self._channel = BigFrameChannel(
            host,
            port,
            config=Configuration(http2_connection_window_size=16 << 20, http2_stream_window_size=16 << 20),
        )
        self._stub = kserve.GrpcInferenceServiceStub(self._channel)
        self._infer = UnaryUnaryMethod(self._channel, _INFER, hot.ModelInferRequest, hot.ModelInferResponse)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # -- health and metadata -------------------------------------------------------------------

    async def is_server_live(self) -> bool:
        return (await self._stub.server_live(kserve.ServerLiveRequest())).live

    async def is_server_ready(self) -> bool:
        return (await self._stub.server_ready(kserve.ServerReadyRequest())).ready

    async def is_model_ready(self, model: str) -> bool:
        return (await self._stub.model_ready(kserve.ModelReadyRequest(name=model))).ready

    async def server_metadata(self) -> kserve.ServerMetadataResponse:
        return await self._stub.server_metadata(kserve.ServerMetadataRequest())

    async def model_metadata(self, model: str) -> kserve.ModelMetadataResponse:
        return await self._stub.model_metadata(kserve.ModelMetadataRequest(name=model))

    async def model_config(self, model: str) -> kserve.ModelConfig:
        config = (await self._stub.model_config(kserve.ModelConfigRequest(name=model))).config
        assert config is not None, "ModelConfig answered without a config"
        return config

    async def model_statistics(self, model: str = "") -> kserve.ModelStatisticsResponse:
        return await self._stub.model_statistics(kserve.ModelStatisticsRequest(name=model))

    async def repository_index(self, ready_only: bool = False) -> kserve.RepositoryIndexResponse:
        return await self._stub.repository_index(kserve.RepositoryIndexRequest(ready=ready_only))

    # -- system shared memory ------------------------------------------------------------------

    async def register_system_shared_memory(
        self, name: str, key: str, byte_size: int, offset: int = 0
    ) -> None:
        await self._stub.system_shared_memory_register(
            kserve.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        )

    async def register_pool(self, pool: BufferPool, name: str) -> None:
        """Register a shared-memory staging pool as the region `name`."""
        if pool.key is None:
            raise ValueError("an inline pool (use_shm=False) cannot be registered; send tensors inline")
        await self.register_system_shared_memory(name, pool.key, pool.n_bytes)

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        await self._stub.system_shared_memory_unregister(
            kserve.SystemSharedMemoryUnregisterRequest(name=name)
        )

    async def system_shared_memory_status(self, name: str = "") -> dict[str, tuple[str, int, int]]:
        """Registered regions: name → (key, offset, byte_size)."""
        reply = await self._stub.system_shared_memory_status(
            kserve.SystemSharedMemoryStatusRequest(name=name)
        )
        return {n: (r.key, r.offset, r.byte_size) for n, r in reply.regions.items()}

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str = "",
    ) -> dict[str, np.ndarray]:
        """Run one request inline (raw contents); returns the outputs by name.

        `timeout` (seconds) is sent both as the gRPC deadline and as the relative
        `hloserve_timeout_ns` budget, so the server drops the request once it cannot be useful.
        """
        request = encode_request(model, inputs, outputs=outputs, request_id=request_id, timeout=timeout)
        return decode_response(await self._infer(request, timeout=timeout))

    async def infer_message(
        self, request: hot.ModelInferRequest, timeout: float | None = None
    ) -> hot.ModelInferResponse:
        """Send a ready ModelInferRequest (see `encode_request`, `encode_request_shm`)."""
        return await self._infer(request, timeout=timeout)


def deadline_params(budget_s: float) -> dict[str, int]:
    """Request parameters carrying a remaining budget (relative, so clocks need not agree).

    A budget of zero or less means no deadline: an empty map.
    """
    return {TIMEOUT_NS_PARAM: int(budget_s * 1e9)} if budget_s > 0 else {}


def _new_request(model: str, request_id: str, timeout: float | None) -> hot.ModelInferRequest:
    request = hot.ModelInferRequest(model_name=model, id=request_id)
    for key, value in deadline_params(timeout or 0.0).items():
        request.parameters[key].int64_param = value
    return request


def _add_input(request: hot.ModelInferRequest, name: str, array: np.ndarray) -> _InputTensor:
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = _wire(array.dtype)
    tensor.shape.extend(array.shape)
    return tensor


def encode_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    *,
    outputs: Sequence[str] = (),
    request_id: str = "",
    timeout: float | None = None,
) -> hot.ModelInferRequest:
    """A ModelInferRequest with every input inline in `raw_input_contents`."""
    request = _new_request(model, request_id, timeout)
    for name, array in inputs.items():
        array = np.ascontiguousarray(array)
        _add_input(request, name, array)
        request.raw_input_contents.append(array.tobytes())
    for name in outputs:
        request.outputs.add().name = name
    return request


def encode_request_shm(
    model: str,
    pool: BufferPool,
    region: str,
    inputs: Mapping[str, np.ndarray],
    *,
    outputs: Mapping[str, np.ndarray] | None = None,
    request_id: str = "",
    timeout: float | None = None,
) -> hot.ModelInferRequest:
    """A ModelInferRequest whose inputs are ALL arrays carved from `pool` (registered as
    `region`), and whose `outputs`, if given, are written by the server into pool arrays too.

    All or nothing: no input travels inline, so the server never mixes raw and shared inputs.
    """
    request = _new_request(model, request_id, timeout)
    for name, array in inputs.items():
        _shm_params(_add_input(request, name, array), region, pool.array_offset(array), array.nbytes)
    for name, array in (outputs or {}).items():
        output = request.outputs.add()
        output.name = name
        _shm_params(output, region, pool.array_offset(array), array.nbytes)
    return request


def _shm_params(tensor: _InputTensor | _RequestedOutput, region: str, offset: int, byte_size: int) -> None:
    tensor.parameters[SHM_REGION].string_param = region
    tensor.parameters[SHM_OFFSET].int64_param = offset
    tensor.parameters[SHM_BYTE_SIZE].int64_param = byte_size


def _wire(dtype: np.dtype[Any]) -> str:
    wire = dtypes.by_numpy(dtype).wire
    if wire is None:
        raise TypeError(f"{dtype} has no KServe datatype; it cannot be sent")
    return wire


def decode_response(response: hot.ModelInferResponse) -> dict[str, np.ndarray]:
    """The inline outputs of a ModelInferResponse as numpy arrays (raw or typed contents).

    Outputs the server wrote to shared memory are not included: read them from the pool.
    """
    result: dict[str, np.ndarray] = {}
    raw = response.raw_output_contents
    for i, tensor in enumerate(response.outputs):
        if SHM_REGION in tensor.parameters:
            continue
        dtype = dtypes.by_wire(tensor.datatype)
        shape = tuple(tensor.shape)
        if raw:
            result[tensor.name] = np.frombuffer(raw[i], dtype=dtype.numpy).reshape(shape)
        else:
            assert dtype.contents_field is not None, f"{tensor.datatype} arrives only as raw contents"
            values = getattr(tensor.contents, dtype.contents_field)
            result[tensor.name] = np.asarray(values, dtype=dtype.numpy).reshape(shape)
    return result
