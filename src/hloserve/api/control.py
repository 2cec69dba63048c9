"""hloserve's control service over gRPC (`hloserve_control.ControlService`): the control plane's
calls (`hloserve.api.control_plane`), each with the gRPC status its errors map to."""

from __future__ import annotations

from hloserve._proto import hloserve_control as hc
from hloserve.api.control_plane import ControlPlane
from hloserve.api.status import grpc_errors

__all__ = ["ControlService"]


class ControlService(hc.ControlServiceBase):
    """`hloserve_control.ControlService` over a control plane (the engine's, or a frontend's)."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    @grpc_errors("ModelControlStatus")
    async def model_control_status(
        self, message: hc.ModelControlStatusRequest
    ) -> hc.ModelControlStatusResponse:
        return await self._plane.status(message)

    @grpc_errors("SetModelResidency")
    async def set_model_residency(self, message: hc.SetModelResidencyRequest) -> hc.SetModelResidencyResponse:
        return await self._plane.set_residency(message)

    @grpc_errors("SetModelPolicy")
    async def set_model_policy(self, message: hc.SetModelPolicyRequest) -> hc.SetModelPolicyResponse:
        return await self._plane.set_policy(message)

    @grpc_errors("CompactMemory")
    async def compact_memory(self, message: hc.CompactMemoryRequest) -> hc.CompactMemoryResponse:
        return await self._plane.compact(message)
