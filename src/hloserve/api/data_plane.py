"""The data plane: what every protocol adapter (the gRPC servicer, the REST routes, health) serves
requests through, whichever process it runs in.

`DataPlane` is the protocol; `LocalDataPlane` its implementation over a model table: decode,
limits, admission, `model.py` hooks and meta models, execute, encode, and the per-model counts.
Its `Execute` step is where executable inputs go: the model's queue in the engine
(`execute_on_queue`), the link in a frontend (`hloserve.frontends.frontend_end.execute_over`). A frontend
and a node implement the protocol too (`hloserve.frontends.process.LinkedDataPlane`,
`hloserve.fleet.services.NodeDataPlane`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, TypeVarTuple

import numpy as np
import trio
import trio_asyncio
from grpclib.metadata import Deadline
from prometheus_client import Counter, Histogram

from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.actors.messages import Infer
from hloserve.api.codec import InferRequest, decode_request, encode_response, request_deadline
from hloserve.api.shm_registry import ShmRegistry
from hloserve.config import Config
from hloserve.engine.admission import Admission, Ticket
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.pipeline import Route
from hloserve.engine.statistics import Statistics
from hloserve.errors import CannotMeetDeadline, InvalidInput, ModelNotFound, ModelNotReady, Overloaded, clip
from hloserve.models import _xla

if TYPE_CHECKING:
    from hloserve.actors.model_queue import ModelQueueHandle
    from hloserve.engine.model_table import ModelEntry
    from hloserve.engine.tracing import RequestSpans, Tracing

__all__ = [
    "VERSIONS",
    "DataPlane",
    "Execute",
    "LocalDataPlane",
    "check_version",
    "execute_on_queue",
    "find_entry",
    "not_ready_because",
    "ready_entry",
]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

Execute = Callable[
    ["ModelEntry", list[np.ndarray], int, list[int], float | None, float, "RequestSpans | None"],
    Awaitable[list[np.ndarray]],
]
"""How executable inputs reach the engine: `(entry, inputs, rows, outputs, deadline, now, spans)`
to the outputs. `spans` is the request's trace, None when it is not traced."""

VERSIONS = ("", "1")
"""Every model has exactly one version, "1" ("" asks for the latest)."""

_TRACEPARENT_MAX = 256  # a W3C traceparent is 55 characters; anything much longer is not one


class DataPlane(Protocol):
    """What a protocol adapter needs to serve inference, readiness and a model's metadata."""

    @property
    def tracing(self) -> Tracing | None:
        """The process's traces (None: off)."""
        ...

    @property
    def platform(self) -> str:
        """The platform models run on (ModelMetadata, ModelConfig)."""
        ...

    def trace_request(self, model: str, traceparent: object, started_ns: int) -> RequestSpans | None: ...

    async def infer(
        self, request: InferRequest, deadline: Deadline | None, spans: RequestSpans | None = None
    ) -> hot.ModelInferResponse:
        """The answer to a ModelInfer; `deadline` is the transport's (gRPC's), if any."""
        ...

    def count(self, model: str, status: str, elapsed_s: float) -> None:
        """Count one ModelInfer call that ended with `status` after `elapsed_s`."""
        ...

    async def ready(self) -> bool: ...

    async def model_ready(self, name: str, version: str = "") -> bool: ...


def check_version(model: str, version: str) -> None:
    """As Triton: a version is empty (the latest) or an integer > 0, else INVALID_ARGUMENT."""
    if version and not (version.isascii() and version.isdigit() and int(version) > 0):
        raise InvalidInput(
            model,
            f"failed to get model version from specified version string {clip(version)}: "
            "a version is an integer > 0 (hloserve serves version '1')",
        )


def find_entry(models: Mapping[str, ModelEntry], name: str, version: str = "") -> ModelEntry:
    """Model `name`'s entry, at a version it has; `ModelNotFound` if none."""
    entry = models.get(name)
    if entry is None:
        raise ModelNotFound(name, f"serving {sorted(models)}")
    check_version(name, version)
    if version not in VERSIONS:
        raise ModelNotFound(name, "the only version is '1'", version)
    return entry


def ready_entry(models: Mapping[str, ModelEntry], name: str, version: str = "") -> ModelEntry:
    """`find_entry`, loaded; `ModelNotReady` if it is not."""
    entry = find_entry(models, name, version)
    if not entry.ready:
        raise ModelNotReady(name, entry.error or "not loaded")
    return entry


async def execute_on_queue(
    entry: ModelEntry,
    inputs: list[np.ndarray],
    rows: int,
    outputs: list[int],
    deadline: float | None,
    now: float,
    spans: RequestSpans | None = None,
) -> list[np.ndarray]:
    """`Execute` in the engine: queue executable inputs on the model's queue, await its outputs.
    A client that cancels or disconnects cancels the awaiting task, and so withdraws them."""
    queue = entry.queue
    assert queue is not None
    reply: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
    queued = Infer(entry.name, inputs, rows, outputs, reply, now, deadline)
    if spans is not None:
        return await _execute_traced(queue, queued, spans)
    queue.submit_nowait(queued)
    reply.add_done_callback(lambda f: queue.withdraw_nowait(queued) if f.cancelled() else None)
    return await reply


async def _execute_traced(queue: ModelQueueHandle, queued: Infer, spans: RequestSpans) -> list[np.ndarray]:
    """`execute_on_queue` of a traced request: the dispatcher notes its phases in `queued.trace`."""
    record = queued.trace = spans.engine
    if record is not None:
        record.enqueued_at = time.monotonic()
    reply = queued.reply
    queue.submit_nowait(queued)
    reply.add_done_callback(lambda f: queue.withdraw_nowait(queued) if f.cancelled() else None)
    try:
        outputs: list[np.ndarray] = await reply
        return outputs
    finally:
        spans.record_engine()


def not_ready_because(entry: ModelEntry, config: Config, statistics: Statistics) -> str | None:
    """Why a model cannot serve now: it failed to load, or (externally managed) it is not on the
    device; None when it can."""
    if not entry.ready:
        return entry.error or "not loaded"
    if not config.weights.externally_managed:
        return None
    if entry.meta_run is not None:
        away = [m for m in entry.calls if not statistics[m].resident]
        return f"called models {away} not resident; residency is externally managed" if away else None
    if not statistics[entry.name].resident:
        return "not resident; residency is externally managed"
    return None


class LocalDataPlane:
    """The data plane over a model table (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        metrics: Metrics,
        metas: MetaModels,
        execute: Execute = execute_on_queue,
        *,
        shm: ShmRegistry | None = None,
        tracing: Tracing | None = None,
        platform: str | None = None,
    ) -> None:
        self._config = config
        self._models = models
        self._statistics = statistics
        self._metrics = metrics
        self._metas = metas
        self._execute = execute
        self._shm = shm
        self._tracing = tracing
        self._platform = f"stablehlo_{platform or _xla.device().platform}"
        self._counters: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        """(model, status) → its call counter and its model's duration histogram: prometheus's
        `labels()` lookup costs more than the count itself."""
        self._inflight = 0
        self._admission = Admission(
            lambda callback, arg: asyncio.get_running_loop().call_soon(callback, arg),
            config.server.admission_fraction,
        )

    @property
    def tracing(self) -> Tracing | None:
        return self._tracing

    @property
    def platform(self) -> str:
        return self._platform

    def trace_request(self, model: str, traceparent: object, started_ns: int) -> RequestSpans | None:
        """The spans of a ModelInfer call that began at `started_ns` (`time.monotonic_ns()`),
        parented by the client's `traceparent` header if it sent one; None when tracing is off."""
        if self._tracing is None:
            return None
        if not isinstance(traceparent, str) or len(traceparent) > _TRACEPARENT_MAX:
            traceparent = None
        return self._tracing.request("ModelInfer", model, traceparent, started_ns)

    def count(self, model: str, status: str, elapsed_s: float) -> None:
        counters = self._counters.get((model, status))
        if counters is None:
            metrics = self._metrics
            counters = self._counters[model, status] = (
                metrics.requests.labels(model, status),
                metrics.request_seconds.labels(model),
            )
        calls, seconds = counters
        calls.inc()
        seconds.observe(elapsed_s)
        if model in self._models:
            stats = self._statistics[model]
            (stats.success if status == "OK" else stats.fail).add(elapsed_s)

    def forget(self, model: str) -> None:
        """Drop what is counted for `model`, unloaded: its statistics and metric series."""
        for key in [key for key in self._counters if key[0] == model]:
            del self._counters[key]
        self._metrics.forget(model)
        self._statistics.forget(model)

    async def infer(
        self, request: InferRequest, deadline: Deadline | None, spans: RequestSpans | None = None
    ) -> hot.ModelInferResponse:
        entry = ready_entry(self._models, request.model_name, request.model_version)
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
        remaining = None if deadline is None else deadline.time_remaining()
        until = request_deadline(decoded.timeout_s, remaining, now)
        ticket = self.admit(entry, decoded.rows, now, until)
        if spans is not None:
            spans.mark("admission")
        self._inflight += 1
        try:
            if meta_run is not None:
                infer_meta = trio_asyncio.trio_as_aio(self._metas.infer)
                outputs = await infer_meta(entry, decoded.inputs, decoded.rows, until)
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
                    entry, inputs, rows, route.executable_outputs, until, now, spans
                )
                outputs = await _run_hook(hooks.postprocess, route.outward, outputs, decoded.rows)
                if spans is not None:
                    spans.mark("postprocess")
            else:
                outputs = await self._execute(
                    entry, decoded.inputs, decoded.rows, decoded.outputs, until, now, spans
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
        sizes = entry.batch_sizes
        try:
            return self._admission.admit(
                entry.name,
                rows,
                now,
                deadline,
                executed=stats.inference_count,
                costs=stats.cost,
                backlog_rows=max(sizes[-1], 1) if sizes else 1,
                load_s=0.0
                if stats.resident or not stats.residency
                else stats.weight_bytes * self._statistics.seconds_per_weight_byte,
            )
        except CannotMeetDeadline:
            stats.drops["cannot_meet_deadline"] += 1
            raise

    def release(self, ticket: Ticket) -> None:
        self._admission.release(ticket)

    async def ready(self) -> bool:
        return bool(self._models) and all(e.ready for e in self._models.values())

    async def model_ready(self, name: str, version: str = "") -> bool:
        check_version(name, version)
        entry = self._models.get(name)
        return (
            entry is not None
            and not_ready_because(entry, self._config, self._statistics) is None
            and version in VERSIONS
        )


_in_thread = trio_asyncio.trio_as_aio(trio.to_thread.run_sync)


async def _run_hook(hook: object, step: Callable[[*Ts], T], *args: *Ts) -> T:
    """A pipeline step: in a worker thread when it runs a hook (arbitrary, blocking Python),
    inline when the hook is omitted and the step only checks tensors."""
    result: T = await _in_thread(step, *args) if hook is not None else step(*args)
    return result
