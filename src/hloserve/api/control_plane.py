"""The control plane: hloserve's own control of a worker (status, residency, policy, compaction),
in the `hloserve_control` messages the control service carries as they are.

`ControlPlane` is the protocol; `LocalControlPlane` its implementation over the engine's
`ModelHost`, where each change is a message to the dispatch loop (applied between executions,
so nothing here touches residency or policy state itself). A frontend asks the engine's over the
link (`hloserve.frontends.frontend.LinkedControlPlane`). Handlers run on asyncio (grpclib) and
reach the trio side with `trio_asyncio.trio_as_aio`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import trio_asyncio

from hloserve._proto import hloserve_control as hc
from hloserve._proto.hot import hot_status_pb2 as hot
from hloserve.errors import InvalidInput, clip
from hloserve.types import DISCIPLINES, Residency

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelHost

__all__ = ["ControlPlane", "LocalControlPlane"]

_FLOORS: dict[hc.Residency, Residency] = {
    hc.Residency.UNPINNED: "unpinned",
    hc.Residency.SYSTEM: "system",
    hc.Residency.DEVICE: "device",
}
_RESIDENCY: dict[str, hc.Residency] = {floor: residency for residency, floor in _FLOORS.items()}
_ORDER = {hc.Residency.UNPINNED: 0, hc.Residency.SYSTEM: 1, hc.Residency.DEVICE: 2}


class ControlPlane(Protocol):
    """What the control service serves (see the module docstring)."""

    async def status(self, message: hc.ModelControlStatusRequest) -> hot.ModelControlStatusResponse:
        """Every ready model's residency, policy and counters, and the worker's budget. A protobuf
        (upb) message, which the node's controller reads from every worker each round
        (`hloserve.api.control`)."""
        ...

    async def set_residency(self, message: hc.SetModelResidencyRequest) -> hc.SetModelResidencyResponse:
        """Pin a model's weights on the device or in host memory, or unpin them."""
        ...

    async def set_policy(self, message: hc.SetModelPolicyRequest) -> hc.SetModelPolicyResponse:
        """A model's (or the default) scheduling weight and discipline."""
        ...

    async def compact(self, message: hc.CompactMemoryRequest) -> hc.CompactMemoryResponse:
        """Drop the device's weights and load the named models' back, contiguously."""
        ...


class LocalControlPlane:
    """The control plane of the engine's process, over its `ModelHost`."""

    def __init__(self, host: ModelHost) -> None:
        self._host = host

    async def status(self, message: hc.ModelControlStatusRequest) -> hot.ModelControlStatusResponse:
        host = self._host
        config = host.config
        ready = {name: e for name, e in host.models.items() if e.ready and e.bundle is not None}
        # As upstream: a meta model is reported as one unit over the models it calls, which
        # are not listed on their own.
        parts = {callee for e in ready.values() for callee in e.calls}
        models = []
        for name, entry in sorted(ready.items()):
            if name in parts:
                continue
            s = host.statistics[name]
            policy = config.scheduler.models.get(name)
            compute = s.compute.compute_input.ns + s.compute.compute_infer.ns + s.compute.compute_output.ns
            ready_parts = [c for c in entry.calls if c in ready]
            status = hot.ModelStatus(
                name=name,
                residency=_RESIDENCY.get(s.residency, hc.Residency.RESIDENCY_UNSPECIFIED),
                device_resident=s.resident,
                host_resident=s.host_resident,
                weight_nbytes=s.weight_bytes,
                weight=s.weight,
                queue_depth=s.queue_depth,
                total_compute_seconds=compute / 1e9,
                requests_served=s.requests_served,
                dispatch_count=s.execution_count,
                max_batch_size=0 if entry.compiled is None else max(entry.compiled.batch_sizes),
                rows_served=s.inference_count,
                loads=s.weight_loads,
                evictions=s.weight_evictions,
                discipline=(policy.discipline if policy else None) or "",
                meta=entry.compiled is None,
                parts=entry.calls,
                ready_parts=ready_parts,
            )
            calls = [host.statistics[c] for c in ready_parts]
            if status.meta and calls:
                status.weight_nbytes = sum(c.weight_bytes for c in calls)
                status.residency = min(
                    (_RESIDENCY.get(c.residency, hc.Residency.RESIDENCY_UNSPECIFIED) for c in calls),
                    key=lambda r: _ORDER.get(r, -1),
                )
                status.device_resident = all(c.resident for c in calls)
                status.host_resident = all(c.host_resident for c in calls)
            models.append(status)
        return hot.ModelControlStatusResponse(
            residency_mode="externally_managed" if config.weights.externally_managed else "self_managed",
            discipline=config.scheduler.discipline,
            weight_cache_max_bytes=host.weight_budget or 0,
            models=models,
            resident_bytes=sum(
                s.weight_bytes
                for name, e in ready.items()
                if e.compiled is not None
                for s in [host.statistics[name]]
                if s.resident
            ),
            compactions=host.statistics.compactions,
        )

    async def set_residency(self, message: hc.SetModelResidencyRequest) -> hc.SetModelResidencyResponse:
        floor = _FLOORS.get(message.target)
        if floor is None:
            raise InvalidInput(
                message.name, "target residency is unspecified; expected UNPINNED, SYSTEM or DEVICE"
            )
        new_floor, on_device = await trio_asyncio.trio_as_aio(self._host.set_residency)(message.name, floor)
        return hc.SetModelResidencyResponse(residency=_RESIDENCY[new_floor], device_resident=on_device)

    async def set_policy(self, message: hc.SetModelPolicyRequest) -> hc.SetModelPolicyResponse:
        if message.has_weight and not (message.weight > 0 and math.isfinite(message.weight)):
            raise InvalidInput(message.name, f"weight must be > 0 and finite, got {message.weight}")
        if message.discipline and message.discipline not in DISCIPLINES:
            raise InvalidInput(
                message.name, f"discipline {clip(message.discipline)}; expected fair, fifo or edf"
            )
        await trio_asyncio.trio_as_aio(self._host.set_policy)(
            message.name,
            weight=message.weight if message.has_weight else None,
            discipline=message.discipline or None,
        )
        return hc.SetModelPolicyResponse()

    async def compact(self, message: hc.CompactMemoryRequest) -> hc.CompactMemoryResponse:
        done = await trio_asyncio.trio_as_aio(self._host.compact)(list(message.reload_models))
        return hc.CompactMemoryResponse(
            reloaded_models=list(done.reloaded), resident_bytes_after=done.resident_bytes
        )
