"""The data plane: what every protocol adapter (the gRPC servicer, the REST routes, health) serves
inference and readiness through, whichever process it runs in.

`DataPlane` is the protocol; `LocalDataPlane` its implementation over a model table: decode,
limits, admission, `model.py` hooks and meta models, execute, encode, and the per-model counts.
Its `Execute` step is where executable inputs go: the model's queue in the engine
(`execute_on_queue`), the link in a frontend (`hloserve.frontends.frontend_link.execute_over`). A frontend
and a node implement the protocol too (`hloserve.frontends.frontend.LinkedDataPlane`,
`hloserve.fleet.services.NodeDataPlane`).

Every call an adapter serves is one `Call` (`with plane.call(rpc, model, traceparent) as call:`):
the one place that labels, counts, times and traces a call, and ends its spans.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar, TypeVarTuple, final

import numpy as np
import trio
import trio_asyncio
from grpclib.metadata import Deadline
from prometheus_client import Counter, Histogram

from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.actors.messages import Infer
from hloserve.api.shm_registry import ShmRegistry
from hloserve.api.status import status_of
from hloserve.api.tensor_codec import InferRequest, decode_request, encode_response, request_deadline
from hloserve.config import Config
from hloserve.engine.admission import Admission, Ticket
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.pipeline import Route
from hloserve.engine.statistics import Statistics
from hloserve.errors import CannotMeetDeadline, InvalidInput, ModelNotFound, ModelNotReady, Overloaded, clip

if TYPE_CHECKING:
    from hloserve.actors.model_queue import ModelQueueHandle
    from hloserve.engine.model_table import ModelEntry
    from hloserve.engine.tracing import RequestSpans, Tracing

__all__ = [
    "UNKNOWN",
    "VERSIONS",
    "Call",
    "DataPlane",
    "Execute",
    "Job",
    "LocalDataPlane",
    "Record",
    "check_version",
    "execute_on_queue",
    "find_entry",
    "not_ready_because",
    "ready_entry",
]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@dataclass(frozen=True, slots=True)
class Job:
    """A request's executable inputs on their way to the engine (`Execute`)."""

    inputs: list[np.ndarray]
    rows: int
    outputs: list[int]
    """The executable outputs asked for, by index."""
    deadline: float | None
    """When it must be answered (`time.monotonic()`; None: no deadline)..."""
    now: float
    """...as of when it was admitted."""
    spans: RequestSpans | None = None
    """The request's trace; None when it is not traced."""


Execute = Callable[["ModelEntry", Job], Awaitable[list[np.ndarray]]]
"""How executable inputs reach the engine: a model's entry and a `Job` to the outputs."""

VERSIONS = ("", "1")
"""Every model has exactly one version, "1" ("" asks for the latest)."""

UNKNOWN = "<unknown>"
"""The model label of a call naming a model the table does not have (bounds the labels)."""

_TRACEPARENT_MAX = 256  # a W3C traceparent is 55 characters; anything much longer is not one

Record = Callable[[str, str, float], None]
"""Where a finished call is counted: `(model label, status name, seconds)`."""


def _uncounted(model: str, status: str, elapsed_s: float) -> None:
    """A plane that counts nothing (a node's front: its workers count)."""


@final
class Call:
    """One call an adapter serves, from `with plane.call(...) as call:` to the block's end: the
    only place a call is labelled, counted, timed and traced.

    On leaving the block the call is counted under its model's label (`UNKNOWN` for a model the
    table lacks) with the status of what ended it: OK, the status its error stands for
    (`hloserve.api.status.status_of`; INTERNAL when unexpected), or none at all when the client
    went away (a cancellation, or an error whose status is CANCELLED), which is traced but not
    counted. Its spans (`spans`, None when it is not traced) end with that status."""

    __slots__ = ("_record", "_started", "model", "spans")

    def __init__(self, model: str, spans: RequestSpans | None, record: Record) -> None:
        self.model = model
        """Its label: the model's name, or `UNKNOWN`."""
        self.spans = spans
        self._record = record
        self._started = 0.0

    def __enter__(self) -> Call:
        self._started = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        elapsed = time.perf_counter() - self._started
        if error is None:
            status = "OK"
        elif isinstance(error, Exception):
            known = status_of(error)
            status = "INTERNAL" if known is None else known.name
        else:
            status = "CANCELLED"  # a cancellation (asyncio's or trio's): the client went away
        if status != "CANCELLED":
            self._record(self.model, status, elapsed)
        spans = self.spans
        if spans is not None:
            if error is None:
                spans.mark("reply")
            spans.end(status)


def uncounted_call(rpc: str, model: str, traceparent: object = None, received_ns: int | None = None) -> Call:
    """`DataPlane.call` of a plane that neither counts nor traces (a node's front)."""
    return Call(UNKNOWN, None, _uncounted)


class DataPlane(Protocol):
    """What a protocol adapter needs to serve inference and readiness."""

    def call(self, rpc: str, model: str, traceparent: object = None, received_ns: int | None = None) -> Call:
        """The accounting of one call of `rpc` naming `model`: use it as `with plane.call(...) as
        call:` around the whole call (see `Call`). Traced when tracing is on, under the client's
        `traceparent` header if it sent one, from `received_ns` (`time.monotonic_ns()`; None: now)."""
        ...

    async def infer(
        self, request: InferRequest, deadline: Deadline | None, spans: RequestSpans | None = None
    ) -> hot.ModelInferResponse:
        """The answer to a ModelInfer; `deadline` is the transport's (gRPC's), if any; `spans`
        its call's (`Call.spans`)."""
        ...

    async def ready(self) -> bool: ...

    async def model_ready(self, name: str, version: str = "") -> bool: ...

    def serves(self, name: str) -> bool:
        """Whether `name` is a model of this plane's table, ready or not (health's question)."""
        ...


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


async def execute_on_queue(entry: ModelEntry, job: Job) -> list[np.ndarray]:
    """`Execute` in the engine: queue executable inputs on the model's queue, await its outputs.
    A client that cancels or disconnects cancels the awaiting task, and so withdraws them."""
    queue = entry.queue
    assert queue is not None
    reply: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
    queued = Infer(entry.name, job.inputs, job.rows, job.outputs, reply, job.now, job.deadline)
    if job.spans is not None:
        return await _execute_traced(queue, queued, job.spans)
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
    """The data plane over a model table (see the module docstring). Its calls are counted in
    this process's metrics and statistics (`record`), or by `record` when given (a frontend's
    go to the engine over the link)."""

    def __init__(
        self,
        *,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        metrics: Metrics,
        metas: MetaModels,
        execute: Execute = execute_on_queue,
        shm: ShmRegistry | None = None,
        tracing: Tracing | None = None,
        record: Record | None = None,
    ) -> None:
        self._config = config
        self._models = models
        self._statistics = statistics
        self._metrics = metrics
        self._metas = metas
        self._execute = execute
        self._shm = shm
        self._tracing = tracing
        self._record = record or self.record
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
        """The process's traces (None: off); the engine's link spans a frontend's `Run` with them."""
        return self._tracing

    def call(self, rpc: str, model: str, traceparent: object = None, received_ns: int | None = None) -> Call:
        label = model if model in self._models else UNKNOWN
        spans = None
        if self._tracing is not None:
            if not isinstance(traceparent, str) or len(traceparent) > _TRACEPARENT_MAX:
                traceparent = None
            started_ns = time.monotonic_ns() if received_ns is None else received_ns
            spans = self._tracing.request(rpc, label, traceparent, started_ns)
        return Call(label, spans, self._record)

    def record(self, model: str, status: str, elapsed_s: float) -> None:
        """Count a finished call (`Record`) in this process's metrics and per-model statistics:
        what every `Call` of this plane ends with, and what a frontend's link reports."""
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
                    entry, Job(inputs, rows, route.executable_outputs, until, now, spans)
                )
                outputs = await _run_hook(hooks.postprocess, route.outward, outputs, decoded.rows)
                if spans is not None:
                    spans.mark("postprocess")
            else:
                job = Job(decoded.inputs, decoded.rows, decoded.outputs, until, now, spans)
                outputs = await self._execute(entry, job)
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

    def serves(self, name: str) -> bool:
        return name in self._models

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
