"""hloserve's own async KServe V2 client, over grpclib.

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
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.config import Configuration

from hloserve import dtypes
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.codec import TIMEOUT_NS_PARAM

__all__ = ["Client"]

_INFER = "/inference.GRPCInferenceService/ModelInfer"


class Client:
    """One connection to a worker; use as `async with` or call `close()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8001) -> None:
        self._channel = Channel(
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
        request = hot.ModelInferRequest(model_name=model, id=request_id)
        for name, array in inputs.items():
            array = np.ascontiguousarray(array)
            tensor = request.inputs.add()
            tensor.name = name
            tensor.datatype = _wire(array.dtype)
            tensor.shape.extend(array.shape)
            request.raw_input_contents.append(array.tobytes())
        for name in outputs:
            request.outputs.add().name = name
        if timeout is not None:
            request.parameters[TIMEOUT_NS_PARAM].int64_param = max(1, int(timeout * 1e9))
        response = await self._infer(request, timeout=timeout)
        return decode_response(response)


def _wire(dtype: np.dtype[Any]) -> str:
    wire = dtypes.by_numpy(dtype).wire
    if wire is None:
        raise TypeError(f"{dtype} has no KServe datatype; it cannot be sent")
    return wire


def decode_response(response: Any) -> dict[str, np.ndarray]:
    """The outputs of a ModelInferResponse as numpy arrays (raw or typed contents)."""
    result: dict[str, np.ndarray] = {}
    raw = response.raw_output_contents
    for i, tensor in enumerate(response.outputs):
        dtype = dtypes.by_wire(tensor.datatype)
        shape = tuple(tensor.shape)
        if raw:
            result[tensor.name] = np.frombuffer(raw[i], dtype=dtype.numpy).reshape(shape)
        else:
            assert dtype.contents_field is not None, f"{tensor.datatype} arrives only as raw contents"
            values = getattr(tensor.contents, dtype.contents_field)
            result[tensor.name] = np.asarray(values, dtype=dtype.numpy).reshape(shape)
    return result
