"""The RPCs no single worker can answer, served by the controller behind the node's public port.

Envoy sends here every request its routes do not give to a model's workers: the server-wide
RPCs, the fan-outs, the control services, and requests for a model no worker serves. They are
the node's planes (`NodeDataPlane`, `NodeModelPlane`, `NodeRepositoryPlane`, `NodeControlPlane`),
served by the same adapters as a worker's: `InferenceService` and `ControlService` over gRPC,
`rest.build_app` over REST; only the gateway's own service (`GatewayFront`) is the node's. A worker's
error reaches the client with the worker's status and message (prefixed with the worker's name
where several answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpclib
from grpclib.const import Status
from grpclib.metadata import Deadline

from hloserve._proto import hloserve_control as control
from hloserve._proto import hloserve_gateway as gateway
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._proto.hot import hot_status_pb2 as hot_status
from hloserve._version import __version__
from hloserve.api.data_plane import Call, uncounted_call
from hloserve.api.tensor_codec import InferRequest
from hloserve.fleet import placement as lpt
from hloserve.fleet.controller import Controller, WorkerLink

__all__ = [
    "GatewayFront",
    "NodeControlPlane",
    "NodeDataPlane",
    "NodeModelPlane",
    "NodeRepositoryPlane",
    "merge_control_status",
    "node_readiness",
    "replicas_ready",
]

T = TypeVar("T")
_MAX_REPACK_WAIT_S = 120.0


def replicas_ready(controller: Controller) -> tuple[bool, list[str]]:
    """Whether some worker is ready and every model that is or was READY on a worker has a
    ready replica now; the models that have none."""
    wanted = {m for w in controller.workers for m, state in w.models.items() if state == "READY"}
    serving = controller.serving()
    missing = sorted(m for m in wanted if not serving.get(m))
    return any(w.ready for w in controller.workers) and not missing, missing


def node_readiness(controller: Controller) -> tuple[bool, list[str]]:
    """Ready when the replicas are (`replicas_ready`) and the router has applied their routes
    since start-up; otherwise also the models that have no ready replica."""
    ready, missing = replicas_ready(controller)
    return ready and controller.routes_applied, missing


async def _fan_out(
    workers: Iterable[WorkerLink], call: Callable[[WorkerLink], Awaitable[T]]
) -> list[tuple[WorkerLink, T | grpclib.GRPCError]]:
    """Call every worker at once; each result, or the error it answered (as a GRPCError)."""

    async def one(worker: WorkerLink) -> T | grpclib.GRPCError:
        try:
            return await call(worker)
        except grpclib.GRPCError as e:
            return e
        except Exception as e:  # no answer: a dead connection, a timeout, a reset stream
            return grpclib.GRPCError(Status.UNAVAILABLE, f"{worker.name} did not answer: {e!r}")

    chosen = list(workers)
    return list(zip(chosen, await asyncio.gather(*(one(w) for w in chosen)), strict=True))


def _failure(results: list[tuple[WorkerLink, Any]]) -> grpclib.GRPCError | None:
    """The first worker error, its message naming the worker."""
    for worker, result in results:
        if isinstance(result, grpclib.GRPCError):
            return grpclib.GRPCError(result.status, f"{worker.name}: {result.message}")
    return None


def _ready(controller: Controller) -> list[WorkerLink]:
    ready = [w for w in controller.workers if w.ready]
    if not ready:
        raise grpclib.GRPCError(Status.UNAVAILABLE, "no worker of this node is ready")
    return ready


def _not_served(name: str) -> grpclib.GRPCError:
    return grpclib.GRPCError(
        Status.NOT_FOUND, f"model {name[:256]!r} is not served by any worker of this node"
    )


def _add_durations(
    into: kserve.InferStatistics | kserve.InferBatchStatistics,
    more: kserve.InferStatistics | kserve.InferBatchStatistics,
) -> None:
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        if hasattr(into, key) and getattr(more, key, None) is not None:
            mine = getattr(into, key) or kserve.StatisticDuration()
            extra = getattr(more, key)
            setattr(
                into, key, kserve.StatisticDuration(count=mine.count + extra.count, ns=mine.ns + extra.ns)
            )


def merge_statistics(answers: Iterable[kserve.ModelStatisticsResponse]) -> kserve.ModelStatisticsResponse:
    """Per model, the sums of every worker's counters (the latest `last_inference`)."""
    merged: dict[str, kserve.ModelStatistics] = {}
    for answer in answers:
        for stats in answer.model_stats:
            into = merged.setdefault(
                stats.name,
                kserve.ModelStatistics(
                    name=stats.name, version=stats.version, inference_stats=kserve.InferStatistics()
                ),
            )
            into.inference_count += stats.inference_count
            into.execution_count += stats.execution_count
            into.last_inference = max(into.last_inference, stats.last_inference)
            if stats.inference_stats is not None:
                assert into.inference_stats is not None
                _add_durations(into.inference_stats, stats.inference_stats)
            batches = {b.batch_size: b for b in into.batch_stats}
            for batch in stats.batch_stats:
                if batch.batch_size in batches:
                    _add_durations(batches[batch.batch_size], batch)
                else:
                    into.batch_stats.append(batch)
                    batches[batch.batch_size] = batch
    return kserve.ModelStatisticsResponse(model_stats=[merged[m] for m in sorted(merged)])


class NodeDataPlane:
    """The node's data plane, behind Envoy (REST's and health's): a request Envoy sends here
    names a model no worker serves; readiness is the node's."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def call(self, rpc: str, model: str, traceparent: object = None, received_ns: int | None = None) -> Call:
        """Neither counted nor traced: its workers (and Envoy) count and trace."""
        return uncounted_call(rpc, model)

    def serves(self, name: str) -> bool:
        return False

    async def infer(
        self, request: InferRequest, deadline: Deadline | None, spans: object = None
    ) -> hot.ModelInferResponse:
        raise _not_served(request.model_name)

    async def ready(self) -> bool:
        return node_readiness(self._controller)[0]

    async def model_ready(self, name: str, version: str = "") -> bool:
        return False


class NodeModelPlane:
    """The node's model plane: a ready worker's server metadata and trace settings (every worker
    has the node's), every worker's statistics summed; a model's metadata and configuration are
    asked here only for a model no worker serves (Envoy routes the others to its workers)."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    async def server_metadata(self) -> kserve.ServerMetadataResponse:
        worker = _ready(self._controller)[0]
        answer = await worker.inference.server_metadata(
            kserve.ServerMetadataRequest(), timeout=self._controller.node.probe_timeout_s
        )
        return kserve.ServerMetadataResponse(
            name="hloserve", version=__version__, extensions=answer.extensions
        )

    async def metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        raise _not_served(message.name)

    async def config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        raise _not_served(message.name)

    async def statistics(self, message: kserve.ModelStatisticsRequest) -> kserve.ModelStatisticsResponse:
        """Every worker's counters for the model (or for all), summed: a node's statistics."""
        targets = [w for w in _ready(self._controller) if not message.name or message.name in w.models]
        if not targets:
            raise _not_served(message.name)
        timeout = self._controller.node.probe_timeout_s
        results = await _fan_out(targets, lambda w: w.inference.model_statistics(message, timeout=timeout))
        answers = [r for _, r in results if isinstance(r, kserve.ModelStatisticsResponse)]
        if not answers:
            raise _failure(results) or _not_served(message.name)
        return merge_statistics(answers)

    async def trace_settings(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        return await _ready(self._controller)[0].inference.trace_setting(
            message, timeout=self._controller.node.probe_timeout_s
        )


class NodeRepositoryPlane:
    """The node's repository plane: the union of its workers' indexes, loads and unloads on the
    workers a model is placed on, and shared-memory regions held by every worker (registered
    again on a worker that restarts: `restore_regions`)."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller
        self.regions: dict[str, kserve.SystemSharedMemoryRegisterRequest] = {}
        """Regions registered through the node, registered again on a worker that restarts."""

    def close(self) -> None:
        """Nothing: the regions are the workers'."""

    async def index(self, message: kserve.RepositoryIndexRequest) -> hot_status.RepositoryIndexResponse:
        """The union; as on a worker, a meta's parts are listed through the meta alone."""
        serving = self._controller.serving()
        parts = {p for w in self._controller.workers for ps in w.parts.values() for p in ps}
        index = hot_status.RepositoryIndexResponse()
        for model in sorted(serving.keys() - parts):
            if serving[model]:
                index.models.add(name=model, version="1", state="READY")
            elif not message.ready:
                states = {
                    w.name: (w.models.get(model, "UNAVAILABLE") if w.ready else "worker down")
                    for w in self._controller.workers
                }
                reason = "; ".join(f"{name}: {state}" for name, state in sorted(states.items()))
                index.models.add(
                    name=model, version="1", state="UNAVAILABLE", reason=f"no ready replica ({reason})"
                )
        return index

    async def load(self, message: kserve.RepositoryModelLoadRequest) -> kserve.RepositoryModelLoadResponse:
        """Loads on the workers the model is placed on, else on every ready worker."""
        controller = self._controller
        placed = set(controller.placed.get(message.model_name, ()))
        targets = [w for w in _ready(controller) if not placed or w.name in placed]
        results = await _fan_out(targets, lambda w: w.inference.repository_model_load(message))
        await controller.refresh()
        if error := _failure(results):
            raise error
        return kserve.RepositoryModelLoadResponse()

    async def unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        controller = self._controller
        targets = [w for w in _ready(controller) if message.model_name in w.models]
        if not targets:
            raise _not_served(message.model_name)
        results = await _fan_out(targets, lambda w: w.inference.repository_model_unload(message))
        await controller.refresh()
        if error := _failure(results):
            raise error
        return kserve.RepositoryModelUnloadResponse()

    async def register_region(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        """All workers or none: a worker that refuses (or is down) undoes the others'."""
        timeout = self._controller.node.probe_timeout_s
        results = await _fan_out(
            self._controller.workers,
            lambda w: w.inference.system_shared_memory_register(message, timeout=timeout),
        )
        error = _failure(results)
        if error is None:
            self.regions[message.name] = message
            return kserve.SystemSharedMemoryRegisterResponse()
        done = [w for w, r in results if not isinstance(r, grpclib.GRPCError)]
        undo = kserve.SystemSharedMemoryUnregisterRequest(name=message.name)
        await _fan_out(done, lambda w: w.inference.system_shared_memory_unregister(undo, timeout=timeout))
        raise error

    async def region_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        worker = _ready(self._controller)[0]
        return await worker.inference.system_shared_memory_status(
            message, timeout=self._controller.node.probe_timeout_s
        )

    async def unregister_region(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        timeout = self._controller.node.probe_timeout_s
        results = await _fan_out(
            _ready(self._controller),
            lambda w: w.inference.system_shared_memory_unregister(message, timeout=timeout),
        )
        if message.name:
            self.regions.pop(message.name, None)
        else:
            self.regions.clear()
        if error := _failure(results):
            raise error
        return kserve.SystemSharedMemoryUnregisterResponse()

    async def restore_regions(self, worker: WorkerLink) -> None:
        """Register again on a worker that came back what it held before it went."""
        for region in list(self.regions.values()):
            try:
                await worker.inference.system_shared_memory_register(
                    region, timeout=self._controller.node.probe_timeout_s
                )
            except grpclib.GRPCError as e:
                if e.status != Status.ALREADY_EXISTS:
                    raise


_SUMMED = frozenset(
    (
        "queue_depth",
        "total_compute_seconds",
        "requests_served",
        "dispatch_count",
        "rows_served",
        "loads",
        "evictions",
    )
)
_ANY = frozenset(("device_resident", "host_resident"))
_LARGEST = frozenset(("weight_nbytes", "max_batch_size"))


def merge_control_status(
    answers: Iterable[hot_status.ModelControlStatusResponse],
) -> hot_status.ModelControlStatusResponse:
    """A node's status: per model, the workers' counters summed (resident where any holds it);
    budgets, resident bytes and compactions summed.

    The first answer's models are copied whole and each later one's fields that are set folded
    in (`ListFields`: an idle model's counters are not visited): at 10,000 models on two workers
    this took 120-150 ms against 220-270 ms for a copy and seven counters per model."""
    answers = list(answers)
    total = hot_status.ModelControlStatusResponse()
    for answer in answers:
        total.residency_mode = total.residency_mode or answer.residency_mode
        total.discipline = total.discipline or answer.discipline
        total.weight_cache_max_bytes += answer.weight_cache_max_bytes
        total.resident_bytes += answer.resident_bytes
        total.compactions += answer.compactions
    if not answers:
        return total
    total.models.extend(answers[0].models)
    merged = {model.name: model for model in total.models}
    for answer in answers[1:]:
        for model in answer.models:
            into = merged.get(model.name)
            if into is None:
                merged[model.name] = into = total.models.add()
                into.CopyFrom(model)
                continue
            for field, value in model.ListFields():
                name = field.name
                if name in _SUMMED:
                    setattr(into, name, getattr(into, name) + value)
                elif name in _ANY:
                    setattr(into, name, True)
                elif name in _LARGEST:
                    setattr(into, name, max(getattr(into, name), value))
                elif name == "parts":
                    into.parts[:] = sorted({*into.parts, *value})
    total.models.sort(key=lambda model: model.name)
    return total


class NodeControlPlane:
    """hloserve's control plane for the whole node: the calls that name a model go to the
    workers that serve it, the others to every ready worker."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def _serving(self, name: str) -> list[WorkerLink]:
        targets = [w for w in _ready(self._controller) if w.serves(name)]
        if not targets:
            raise _not_served(name)
        return targets

    async def _all(self, targets: list[WorkerLink], call: Callable[[WorkerLink], Awaitable[T]]) -> list[T]:
        """Every target's answer; the first failure (naming its worker) if any failed."""
        results = await _fan_out(targets, call)
        if error := _failure(results):
            raise error
        return [r for _, r in results if not isinstance(r, grpclib.GRPCError)]

    async def status(
        self, message: control.ModelControlStatusRequest
    ) -> hot_status.ModelControlStatusResponse:
        timeout = self._controller.node.probe_timeout_s
        answers = await self._all(_ready(self._controller), lambda w: w.control_status(timeout))
        # 0.1 s and more at 10,000 models: off the loop that routes every other call
        return await asyncio.get_running_loop().run_in_executor(None, merge_control_status, answers)

    async def set_policy(self, message: control.SetModelPolicyRequest) -> control.SetModelPolicyResponse:
        """A model's policy on the workers that serve it; the global discipline (no name) on all."""
        targets = self._serving(message.name) if message.name else _ready(self._controller)
        timeout = self._controller.node.probe_timeout_s
        await self._all(targets, lambda w: w.control.set_model_policy(message, timeout=timeout))
        return control.SetModelPolicyResponse()

    async def set_residency(
        self, message: control.SetModelResidencyRequest
    ) -> control.SetModelResidencyResponse:
        """On every worker that serves the model; on the device if it is on any of them."""
        timeout = 60 * self._controller.node.probe_timeout_s
        answers = await self._all(
            self._serving(message.name), lambda w: w.control.set_model_residency(message, timeout=timeout)
        )
        return control.SetModelResidencyResponse(
            residency=answers[0].residency, device_resident=any(a.device_resident for a in answers)
        )

    async def compact(self, message: control.CompactMemoryRequest) -> control.CompactMemoryResponse:
        timeout = 60 * self._controller.node.probe_timeout_s
        results = await _fan_out(
            _ready(self._controller), lambda w: w.control.compact_memory(message, timeout=timeout)
        )
        answers = [r for _, r in results if isinstance(r, control.CompactMemoryResponse)]
        if not answers:
            raise _failure(results) or grpclib.GRPCError(Status.UNAVAILABLE, "no worker answered")
        return control.CompactMemoryResponse(
            reloaded_models=sorted({m for a in answers for m in a.reloaded_models}),
            resident_bytes_after=sum(a.resident_bytes_after for a in answers),
        )


_POLICY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "rebalance_compute_seconds": lambda v: v > 0,
    "first_rebalance_compute_seconds": lambda v: v >= 0,
    "hysteresis": lambda v: 0 <= v < 1,
    "default_replicas": lambda v: v == -1 or v >= 1,
    "forbid_memory_oversubscription": lambda v: True,
    "compaction_mode": lambda v: v in ("off", "eager", "scheduled"),
    "compaction_interval": lambda v: v >= 1,
}


class GatewayFront(gateway.GatewayControlServiceBase):
    """Placement status and knobs (`lpt_packing`); nothing is persisted."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def _policy(self) -> gateway.SchedulingPolicy:
        return gateway.SchedulingPolicy(
            mode=self._controller.node.scheduling,
            generation=self._controller.generation,
            **self._controller.policy,
        )

    def _repack_status(self) -> gateway.RepackStatus:
        c = self._controller
        r = c.repack
        return gateway.RepackStatus(
            count=r.count,
            last_repack_unix=r.last_unix,
            trigger=r.trigger,
            models_placed=r.models_placed,
            models_moved=r.models_moved,
            held_by_hysteresis=r.held_by_hysteresis,
            compute_accumulated_seconds=c.compute_accumulated,
            active_threshold_seconds=c.threshold(),
            repacks_since_compaction=r.repacks_since_compaction,
            compactions_sent=r.compactions_sent,
        )

    def _require_lpt(self) -> None:
        if self._controller.node.scheduling != "lpt_packing":
            raise grpclib.GRPCError(
                Status.FAILED_PRECONDITION,
                f"placement is set only under node.scheduling=lpt_packing (this node: "
                f"{self._controller.node.scheduling})",
            )

    async def get_scheduling_status(
        self, message: gateway.GetSchedulingStatusRequest
    ) -> gateway.GetSchedulingStatusResponse:
        c = self._controller
        serving = c.serving()
        by_address = {w.address: w.name for w in c.workers}
        models = []
        for model in sorted(serving):
            routed = [by_address[a] for a in c.routes.get(model, ())]
            learned = c.learned.get(model)
            models.append(
                gateway.ModelRow(
                    name=model,
                    configured_replicas=c.replicas.get(model, 0),
                    effective_replicas=len(routed),
                    replicas=[gateway.Replica(worker=w, weight=1 / len(routed)) for w in routed],
                    serving_workers=serving[model],
                    utilization=(learned.utilization or 0.0) if learned else 0.0,
                    weight_nbytes=learned.weight_nbytes if learned else 0,
                    placed=model in c.placed,
                    drifted=0 < len(serving[model]) < len([w for w in c.workers if w.ready]),
                )
            )
        workers = []
        for worker in c.workers:
            budget = worker.status.weight_cache_max_bytes if worker.status else 0
            assigned = c.plan.memory.get(worker.name, 0)
            workers.append(
                gateway.WorkerRow(
                    name=worker.name,
                    address=worker.address,
                    ready=worker.ready,
                    models_placed=sorted(m for m, ws in c.placed.items() if worker.name in ws),
                    assigned_utilization=c.plan.compute.get(worker.name, 0.0),
                    assigned_bytes=assigned,
                    budget_bytes=budget,
                    oversubscribed=budget > 0 and assigned > budget,
                )
            )
        return gateway.GetSchedulingStatusResponse(
            policy=self._policy(),
            repack=self._repack_status(),
            models=models,
            workers=workers,
            warnings=list(c.warnings),
        )

    async def set_scheduling_policy(
        self, message: gateway.SetSchedulingPolicyRequest
    ) -> gateway.SetSchedulingPolicyResponse:
        self._require_lpt()
        if not message.update_mask or message.policy is None:
            raise grpclib.GRPCError(
                Status.INVALID_ARGUMENT, "name the fields to change in update_mask, with policy"
            )
        changes = {}
        for name in message.update_mask:
            check = _POLICY_FIELDS.get(name)
            if check is None:
                raise grpclib.GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"{name[:64]!r} cannot be changed while running; "
                    f"expected some of {', '.join(_POLICY_FIELDS)}",
                )
            value = getattr(message.policy, name)
            if not check(value):
                raise grpclib.GRPCError(Status.INVALID_ARGUMENT, f"{name} = {value!r} is out of range")
            changes[name] = value
        self._controller.policy.update(changes)
        self._controller.generation += 1
        return gateway.SetSchedulingPolicyResponse(
            applied=self._policy(), warnings=["takes effect at the next repack"]
        )

    async def set_model_replicas(
        self, message: gateway.SetModelReplicasRequest
    ) -> gateway.SetModelReplicasResponse:
        self._require_lpt()
        c = self._controller
        if message.replicas < -1:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, f"replicas {message.replicas}: expected >= -1")
        if message.name not in c.known and not message.allow_unknown_model:
            raise _not_served(message.name)
        if message.replicas:
            c.replicas[message.name] = message.replicas
        else:
            c.replicas.pop(message.name, None)
        count = lpt.replica_count(message.replicas, c.policy["default_replicas"], len(c.workers))
        return gateway.SetModelReplicasResponse(
            effective_replicas=count, warnings=["takes effect at the next repack"]
        )

    async def repack(self, message: gateway.RepackRequest) -> gateway.RepackResponse:
        self._require_lpt()
        if message.wait_seconds < 0:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, "wait_seconds must be >= 0")
        if message.wait_seconds > 0:
            _ready(self._controller)
        sequence, completed, waited = await self._controller.request_repack(
            min(message.wait_seconds, _MAX_REPACK_WAIT_S)
        )
        return gateway.RepackResponse(
            sequence=sequence,
            completed_sequence=self._controller.completed,
            completed=completed,
            waited_seconds=waited,
            status=self._repack_status(),
        )
