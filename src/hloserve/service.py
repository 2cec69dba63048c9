"""The KServe V2 / Triton gRPC service: decode, hand to the actors, await, encode.

ModelInfer bypasses the generated dataclass path: its handler is swapped in `__mapping__` for
one that parses with the google.protobuf classes compiled under `hloserve_hot` (same fields,
another package, so tritonclient's descriptors can share the process) and reaches the model's
queue actor with a non-blocking send plus an asyncio future (no trio task per request). Every
other RPC uses the betterproto2 messages. Errors become statuses in `hloserve._status` only.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import betterproto2
import trio
import trio_asyncio
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

import hloserve
from hloserve import _grpclib_patches, _xla, dtypes
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._status import grpc_errors as _rpc
from hloserve._status import to_grpc_error
from hloserve.actors.messages import Infer
from hloserve.admission import Admission, Ticket
from hloserve.bundle import check_model_name
from hloserve.codec import decode_request, encode_response, request_deadline
from hloserve.config import Config, ModelSettings
from hloserve.errors import (
    CannotMeetDeadline,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    ShmDisabled,
    ShmRegionNotFound,
    Unimplemented,
    clip,
)
from hloserve.load_files import FILE_PREFIX, check_files
from hloserve.load_override import CONFIG_PARAM, apply_config
from hloserve.manifest import FILE as MANIFEST
from hloserve.manifest import TensorSpec
from hloserve.meta import MetaModels
from hloserve.metrics import Metrics
from hloserve.pipeline import Route
from hloserve.shm_registry import Region, ShmRegistry
from hloserve.statistics import Duration, ExecutionTimes, Statistics
from hloserve.tracing import settings, triton_trace_settings

if TYPE_CHECKING:
    from hloserve.model_table import ModelEntry, ModelHost
    from hloserve.tracing import RequestSpans, Tracing

__all__ = ["EXTENSIONS", "Execute", "InferenceService"]

T = TypeVar("T")

Execute = Callable[
    ["ModelEntry", list[Any], int, list[int], float | None, float, "RequestSpans | None"],
    Awaitable[list[Any]],
]
"""How executable inputs reach the engine: `(entry, inputs, rows, outputs, deadline, now, spans)`
to the outputs; in-process, the model's queue (`InferenceService._execute`). `spans` is the
request's trace, None when it is not traced."""

_TRACEPARENT_MAX = 256  # a W3C traceparent is 55 characters; anything much longer is not one

EXTENSIONS = ("model_configuration", "model_repository", "statistics", "system_shared_memory")
"""Triton protocol extensions hloserve implements, reported by ServerMetadata."""

_SERVICE = "/inference.GRPCInferenceService/"
_BUILT = {
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "RepositoryModelLoad", "RepositoryModelUnload",
    "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
    "TraceSetting",
}  # fmt: skip
_VERSIONS = ("", "1")  # every model has exactly one version, "1"


def _check_version(model: str, version: str) -> None:
    """As Triton: a version is empty (the latest) or an integer > 0, else INVALID_ARGUMENT."""
    if version and not (version.isascii() and version.isdigit() and int(version) > 0):
        raise InvalidInput(
            model,
            f"failed to get model version from specified version string {clip(version)}: "
            "a version is an integer > 0 (hloserve serves version '1')",
        )


def _duration(d: Duration) -> kserve.StatisticDuration:
    return kserve.StatisticDuration(count=d.count, ns=d.ns)


def _data_type(spec: TensorSpec) -> kserve.DataType:
    return kserve.DataType["TYPE_STRING" if spec.dtype is dtypes.BYTES else f"TYPE_{spec.dtype.wire}"]


class InferenceService(kserve.GrpcInferenceServiceBase):
    """`inference.GRPCInferenceService` over the worker's model table."""

    def __init__(
        self,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        metrics: Metrics,
        worker: ModelHost,
        metas: MetaModels,
        execute: Execute | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        if execute is not None:  # a frontend process: executable inputs go over its link
            self._execute = execute  # type: ignore[method-assign,assignment]
        self._config = config
        self._models = models
        self._statistics = statistics
        self._metrics = metrics
        self._counters: dict[tuple[str, str], tuple[Any, Any]] = {}
        """(model, status) → its call counter and its model's duration histogram: prometheus's
        `labels()` lookup costs more than the count itself."""
        self._inflight = 0
        self._admission = Admission(
            lambda callback, arg: asyncio.get_running_loop().call_soon(callback, arg),
            config.server.admission_fraction,
        )
        self._worker = worker
        self._metas = metas
        self._tracing = tracing
        """The worker's traces; None when tracing is off (then each phase costs one None check)."""
        server = config.server
        self._shm = (
            ShmRegistry(server.shm_max_regions, server.shm_max_bytes, server.shm_owner_uids)
            if server.allow_client_shm
            else None
        )

    @property
    def tracing(self) -> Tracing | None:
        """The worker's traces (None: off)."""
        return self._tracing

    def close(self) -> None:
        """Close every registered shared-memory region."""
        if self._shm is not None:
            self._shm.close()

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

    async def _unimplemented(self, rpc: str, stream: Any) -> None:
        detail = (
            "hloserve has no CUDA shared memory (as Triton built without GPU support); "
            "use system shared memory (--allow-client-shm)"
            if rpc == "CudaSharedMemoryRegister"
            else "not built in this version of hloserve"
        )
        raise GRPCError(Status.UNIMPLEMENTED, str(Unimplemented(rpc, detail)))

    def _entry(self, name: str, version: str = "") -> ModelEntry:
        entry = self._models.get(name)
        if entry is None:
            raise ModelNotFound(name, f"serving {sorted(self._models)}")
        _check_version(name, version)
        if version not in _VERSIONS:
            raise ModelNotFound(name, "the only version is '1'", version)
        return entry

    def _ready_entry(self, name: str, version: str = "") -> ModelEntry:
        entry = self._entry(name, version)
        if not entry.ready:
            raise ModelNotReady(name, entry.error or "not loaded")
        return entry

    # -- ModelInfer (hot path) -----------------------------------------------------------------

    async def _model_infer(self, stream: Any) -> None:
        received = 0 if self._tracing is None else time.monotonic_ns()
        request = await stream.recv_message()
        started = time.perf_counter()
        name = request.model_name
        label = name if name in self._models else "<unknown>"
        spans = None
        if self._tracing is not None:
            spans = self.trace_request(label, stream.metadata.get("traceparent"), received)
        try:
            response = await self._infer(request, stream.deadline, spans)
        except Exception as e:
            error = to_grpc_error(e, "ModelInfer")
            self._count(label, error.status.name, started)
            if spans is not None:
                spans.end(error.status.name)
            raise error from None
        except asyncio.CancelledError:  # the client cancelled or went away: not counted, but traced
            if spans is not None:
                spans.end("CANCELLED")
            raise
        self._count(label, "OK", started)
        await _grpclib_patches.send_reply(stream, response)
        if spans is not None:
            spans.mark("reply")
            spans.end()

    def trace_request(self, model: str, traceparent: Any, started_ns: int) -> RequestSpans | None:
        """The spans of a ModelInfer call that began at `started_ns` (`time.monotonic_ns()`),
        parented by the client's `traceparent` header if it sent one; None when tracing is off."""
        if self._tracing is None:
            return None
        if not isinstance(traceparent, str) or len(traceparent) > _TRACEPARENT_MAX:
            traceparent = None
        return self._tracing.request("ModelInfer", model, traceparent, started_ns)

    def _count(self, model: str, status: str, started: float) -> None:
        self.count_elapsed(model, status, time.perf_counter() - started)

    def count_elapsed(self, model: str, status: str, elapsed: float) -> None:
        """Count one ModelInfer call that ended with `status` (a frontend's, too)."""
        counters = self._counters.get((model, status))
        if counters is None:
            metrics = self._metrics
            counters = self._counters[model, status] = (
                metrics.requests.labels(model, status),
                metrics.request_seconds.labels(model),
            )
        calls, seconds = counters
        calls.inc()
        seconds.observe(elapsed)
        if model in self._models:
            stats = self._statistics[model]
            (stats.success if status == "OK" else stats.fail).add(elapsed)

    async def _infer(self, request: Any, grpc_deadline: Any, spans: RequestSpans | None = None) -> Any:
        entry = self._ready_entry(request.model_name, request.model_version)
        assert entry.bundle is not None
        manifest = entry.bundle.manifest
        hooks, meta_run = entry.hooks, entry.meta_run  # one registration per request (hot reload)
        transformed = hooks is not None or meta_run is not None
        decoded = decode_request(
            request,
            entry.name,
            manifest.inputs,
            manifest.outputs,
            None if transformed else entry.max_rows,
            self._shm,
        )
        server = self._config.server
        if decoded.rows > server.max_request_rows:
            raise InvalidInput(
                entry.name,
                f"batch of {decoded.rows} rows exceeds the server's limit of {server.max_request_rows} "
                "rows per request (server.max_request_rows); send it in smaller requests",
            )
        if self._inflight >= server.max_inflight_requests:
            raise Overloaded(server.max_inflight_requests)
        if spans is not None:
            spans.mark("decode", **{"hloserve.rows": decoded.rows})
        now = time.monotonic()
        remaining = None if grpc_deadline is None else grpc_deadline.time_remaining()
        deadline = request_deadline(decoded.timeout_s, remaining, now)
        ticket = self.admit(entry, decoded.rows, now, deadline)
        if spans is not None:
            spans.mark("admission")
        self._inflight += 1
        try:
            if meta_run is not None:
                infer_meta = trio_asyncio.trio_as_aio(self._metas.infer)
                outputs = await infer_meta(entry, decoded.inputs, decoded.rows, deadline)
                outputs = [outputs[i] for i in decoded.outputs]
                if spans is not None:
                    spans.mark("meta_model")
            elif hooks is not None:
                route = Route(entry.name, manifest, hooks, decoded.outputs)
                inputs, rows = await _run_hook(hooks.preprocess, route.inward, decoded.inputs, decoded.rows)
                if spans is not None:
                    spans.mark("preprocess", **{"hloserve.rows": rows})
                entry.check_rows(rows, "preprocess")
                outputs = await self._execute(
                    entry, inputs, rows, route.executable_outputs, deadline, now, spans
                )
                outputs = await _run_hook(hooks.postprocess, route.outward, outputs, decoded.rows)
                if spans is not None:
                    spans.mark("postprocess")
            else:
                outputs = await self._execute(
                    entry, decoded.inputs, decoded.rows, decoded.outputs, deadline, now, spans
                )
        finally:
            self._inflight -= 1
            self._admission.release(ticket)
        labels = entry.bundle.labels
        response = encode_response(request, entry.name, manifest.outputs, decoded, outputs, labels)
        if spans is not None:
            spans.mark("encode")
        return response

    def admit(self, entry: ModelEntry, rows: int, now: float, deadline: float | None) -> Ticket:
        """Count a request in, or refuse it if it cannot meet its deadline (`Admission`, from
        this process's measured figures); hand the ticket back to `release` when it is done."""
        stats = self._statistics[entry.name]
        compiled = entry.compiled
        try:
            return self._admission.admit(
                entry.name,
                rows,
                now,
                deadline,
                executed=stats.inference_count,
                costs=stats.cost,
                backlog_rows=1 if compiled is None else max(compiled.batch_sizes[-1], 1),
                load_s=0.0
                if stats.resident or not stats.residency
                else stats.weight_bytes * self._statistics.seconds_per_weight_byte,
            )
        except CannotMeetDeadline:
            stats.drops["cannot_meet_deadline"] += 1
            raise

    def release(self, ticket: Ticket) -> None:
        self._admission.release(ticket)

    async def _execute(
        self,
        entry: ModelEntry,
        inputs: list[Any],
        rows: int,
        outputs: list[int],
        deadline: float | None,
        now: float,
        spans: RequestSpans | None = None,
    ) -> list[Any]:
        """Queue executable inputs on the model's queue and await its outputs."""
        assert entry.queue is not None
        reply: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        queued = Infer(entry.name, inputs, rows, outputs, reply, now, deadline)
        queue = entry.queue
        if spans is not None:
            return await self._execute_traced(queue, queued, spans)
        queue.submit_nowait(queued)
        # A client that cancels or disconnects cancels this handler, and so the future.
        reply.add_done_callback(lambda f: queue.withdraw_nowait(queued) if f.cancelled() else None)
        return await reply

    async def _execute_traced(self, queue: Any, queued: Infer, spans: RequestSpans) -> list[Any]:
        """`_execute` of a traced request: the dispatcher notes its phases in `queued.trace`."""
        record = queued.trace = spans.engine
        if record is not None:
            record.enqueued_at = time.monotonic()
        reply = queued.reply
        queue.submit_nowait(queued)
        reply.add_done_callback(lambda f: queue.withdraw_nowait(queued) if f.cancelled() else None)
        try:
            return cast(list[Any], await reply)
        finally:
            spans.record_engine()

    # -- health and metadata -------------------------------------------------------------------

    def _platform(self) -> str:
        """The platform models run on (ModelMetadata, ModelConfig): this process's device."""
        return _platform()

    @_rpc("ServerLive")
    async def server_live(self, message: kserve.ServerLiveRequest) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    @_rpc("ServerReady")
    async def server_ready(self, message: kserve.ServerReadyRequest) -> kserve.ServerReadyResponse:
        ready = bool(self._models) and all(e.ready for e in self._models.values())
        return kserve.ServerReadyResponse(ready=ready)

    @_rpc("ModelReady")
    async def model_ready(self, message: kserve.ModelReadyRequest) -> kserve.ModelReadyResponse:
        _check_version(message.name, message.version)
        entry = self._models.get(message.name)
        return kserve.ModelReadyResponse(
            ready=entry is not None
            and self._not_ready_because(entry) is None
            and message.version in _VERSIONS
        )

    def _not_ready_because(self, entry: ModelEntry) -> str | None:
        """Why a model cannot serve now: it failed to load, or (externally managed) it is not
        on the device; None when it can."""
        if not entry.ready:
            return entry.error or "not loaded"
        if not self._config.weights.externally_managed:
            return None
        if entry.meta_run is not None:
            away = [m for m in entry.calls if not self._statistics[m].resident]
            return f"called models {away} not resident; residency is externally managed" if away else None
        if not self._statistics[entry.name].resident:
            return "not resident; residency is externally managed"
        return None

    @_rpc("ServerMetadata")
    async def server_metadata(self, message: kserve.ServerMetadataRequest) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(
            name="hloserve", version=hloserve.__version__, extensions=list(EXTENSIONS)
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
            platform=self._platform(),
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
        compiled_sizes = () if entry.compiled is None else entry.compiled.batch_sizes
        sizes = [b for b in compiled_sizes if b > 0]
        max_batch = sizes[-1] if leading and sizes else 0

        def dims(spec: TensorSpec) -> list[int]:
            shape = spec.metadata_shape
            return shape[1:] if max_batch and spec.batch_axis == 0 else shape

        policy = self._worker.config.scheduler.models.get(entry.name)  # with load overrides
        if policy is not None and policy.max_batch_size and max_batch:
            max_batch = min(max_batch, policy.max_batch_size)
            sizes = [b for b in sizes if b <= max_batch]
        if policy is not None and policy.preferred_batch_sizes:  # the sizes it runs
            sizes = [b for b in sizes if b in policy.preferred_batch_sizes]
        return kserve.ModelConfigResponse(
            config=kserve.ModelConfig(
                name=entry.name,
                platform=self._platform(),
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
        try:
            names = (
                [self._entry(message.name, message.version).name] if message.name else sorted(self._models)
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

    # -- system shared memory ------------------------------------------------------------------

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

    @_rpc("SystemSharedMemoryRegister")
    async def system_shared_memory_register(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        self._registry().register(message.name, message.key, message.offset, message.byte_size)
        return kserve.SystemSharedMemoryRegisterResponse()

    @_rpc("SystemSharedMemoryStatus")
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

    @_rpc("SystemSharedMemoryUnregister")
    async def system_shared_memory_unregister(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        self._registry().unregister(message.name)
        return kserve.SystemSharedMemoryUnregisterResponse()

    # -- CUDA shared memory: none, as Triton without a GPU (so clients can clean up) ----------

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
        name = check_model_name(message.model_name)
        chosen = {
            key: betterproto2.which_one_of(p, "parameter_choice") for key, p in message.parameters.items()
        }
        parameters = {
            key: value if kind == "string_param" else None
            for key, (kind, value) in chosen.items()
            if not key.startswith(FILE_PREFIX)
        }
        current = self._worker.config.scheduler.models.get(name, ModelSettings())
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
        await trio_asyncio.trio_as_aio(self._worker.load_model)(name, settings, files)
        return kserve.RepositoryModelLoadResponse()

    @_rpc("RepositoryModelUnload")
    async def repository_model_unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        await trio_asyncio.trio_as_aio(self._worker.unload_model)(message.model_name)
        return kserve.RepositoryModelUnloadResponse()

    @_rpc("RepositoryIndex")
    async def repository_index(
        self, message: kserve.RepositoryIndexRequest
    ) -> kserve.RepositoryIndexResponse:
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
            reason = self._not_ready_because(entry)
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


_in_thread = trio_asyncio.trio_as_aio(trio.to_thread.run_sync)


async def _run_hook(hook: object, step: Callable[..., T], *args: Any) -> T:
    """A pipeline step: in a worker thread when it runs a hook (arbitrary, blocking Python),
    inline when the hook is omitted and the step only checks tensors."""
    return await _in_thread(step, *args) if hook is not None else step(*args)


def _bundle_names(repository: Path) -> list[str]:
    """The names of the repository's bundle directories (each holding a manifest)."""
    try:
        return [p.name for p in repository.iterdir() if (p / MANIFEST).is_file()]
    except OSError:
        return []


def _platform() -> str:
    return f"stablehlo_{_xla.device().platform}"
