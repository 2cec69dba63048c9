"""Dispatcher: the single dispatch loop; exactly one execution runs at a time.

Its inbox takes `QueueSummary` notices from every ModelQueue and control commands
(`SetPolicy`; `Compact` and `SetResidency`, passed on to the weight cache, whose only client
it is). Each turn it drains the inbox (so control is applied before any selection), picks the
next model among the queues with a batch ready (meta models' sub-calls first, then
`hloserve.engine.policy.select`: fair, fifo or edf, latency budgets first), asks that queue for a
`Batch`, asks the weight cache for the model's weights, executes the batch, answers every
request, and learns the model's cost. It owns the per-model policy state; only it runs
executables. A batch with small inputs expected to take under `INLINE_WORK_S` runs on the
loop's own thread; any other runs in a worker thread, so the loop never waits long on the device.

While an execution runs in a worker thread the dispatcher keeps reading its inbox, and asks
the weight cache to start copying the weights of every other model with requests queued
(`Prefetch`, unless `overlap_loads` is off), naming those models and the executing one as not
to be evicted: the cache copies what fits the budget beside the execution, so those models'
loads hide behind it. Only the dispatcher asks for loads, so it stays the sole residency mutator.
A model that is not on the device has its load time (its bytes at the cache's measured seconds
per byte) counted in its edf laxity and latency budget, and every load is charged to the
model that caused it in fair share's recent compute.

A request larger than every compiled size runs one chunk per turn (`_Split`), ahead of its
model's queue: other models' batches interleave by the normal selection, and its client going
away or its deadline passing stops it before the next chunk, so no request holds the loop
for longer than one execution.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import outcome
import structlog
import trio

from hloserve.actors import INLINE_WORK_S
from hloserve.actors.messages import (
    AddModel,
    AddWeights,
    Batch,
    Compact,
    DispatcherMessage,
    DropWeights,
    EngineTrace,
    Infer,
    QueueAddress,
    QueueSummary,
    RemoveModel,
    SetPolicy,
    SetResidency,
    Take,
    answer,
)
from hloserve.actors.weight_cache import WeightCacheHandle
from hloserve.engine.batching import assemble, join_outputs, slice_rows, split_outputs
from hloserve.engine.policy import (
    Candidate,
    Pending,
    Policies,
    PolicyParams,
    charge,
    drop_reason,
    record_execution,
    select,
)
from hloserve.engine.statistics import Statistics
from hloserve.errors import DeadlineExceeded, ExecutionFailed, ModelNotFound, ModelNotReady, NotResident
from hloserve.models.compiled import CompiledModel, ExecutionResult
from hloserve.types import Discipline

__all__ = ["Dispatcher"]

log = structlog.get_logger("hloserve.dispatcher")


INLINE_INPUT_BYTES = 256 << 10
"""Batches with at most this many input bytes and an expected cost within `INLINE_WORK_S` run
on the loop's thread (see `_run`)."""
QUIET_PASSES = 8
"""Event-loop passes without a new message after which the dispatcher stops gathering arrivals
(fewer stop while a burst is still being parsed: measured, 2 gave half the gain of 8)."""


@dataclass(slots=True, eq=False)
class _Split:
    """A request larger than every compiled size, part-way through its executions."""

    model: CompiledModel
    request: Infer
    chunks: deque[tuple[int, int]]
    """(rows, compiled size) of each execution still to run, in order."""
    done: int = 0
    """Rows already run."""
    parts: list[list[np.ndarray]] = field(default_factory=list)
    """Outputs of the executions run so far."""

    def summary(self, now: float) -> QueueSummary:
        """How the split stands for selection: always ready, ahead of its model's queue."""
        request = self.request
        return QueueSummary(
            request.model,
            1,
            request.rows - self.done,
            self.chunks[0][1],
            request.enqueued_at,
            request.deadline,
            now,
            request.committed,
        )


@dataclass(slots=True)
class _State:
    discipline: Discipline
    policies: Policies  # scheduling state per model (weights, recent compute, costs), with its sums
    waiting: dict[str, QueueSummary] = field(default_factory=dict)  # models with queued requests
    for_weight_cache: list[Compact | SetResidency | AddWeights | DropWeights] = field(default_factory=list)
    """Control messages to pass on to the weight cache."""
    removals: list[RemoveModel] = field(default_factory=list)  # models to stop serving
    retiring: list[tuple[QueueAddress, QueueAddress | Exception]] = field(default_factory=list)
    """Queues of replaced models, each with the queue it hands its requests to or the error it
    answers them with."""
    splits: dict[str, _Split] = field(default_factory=dict)
    """Per model, its split request in progress; the model's queue waits behind it."""


class Dispatcher:
    """The actor; see the module docstring."""

    def __init__(
        self,
        statistics: Statistics,
        *,
        discipline: Discipline,
        params: PolicyParams,
        gather_passes: int = 0,
        overlap_loads: bool = True,
    ) -> None:
        """An empty dispatcher: each model joins it with `AddModel`."""
        self._models: dict[str, CompiledModel] = {}
        self._overlap_loads = overlap_loads
        self._gather_passes = gather_passes
        self._weights: WeightCacheHandle | None = None
        self._statistics = statistics
        self._params = params
        self._queues: dict[str, QueueAddress] = {}
        self._state = _State(discipline, Policies({}, params.ema_halflife_s))
        # Unbounded on purpose: its senders may not wait. A model queue reports with send_nowait
        # from its own loop; waiting there could deadlock (the dispatcher waits on that queue's
        # bounded inbox in `take`), and dropping a summary would strand the requests it reports.
        # What it holds is bounded by its senders: each summary reports a change to a queue whose
        # requests are bounded (max_queue_depth, admission), each control message has its asker
        # waiting on the reply, and every turn drains it all.
        self.inbox, self._inbox = trio.open_memory_channel[DispatcherMessage](math.inf)
        self._batches_send, self._batches = trio.open_memory_channel[Batch](1)

    def use_weights(self, weights: WeightCacheHandle) -> None:
        """Give the dispatcher the weight cache, of which it is the only client (before `run`)."""
        self._weights = weights

    def attach(self, queue: QueueAddress) -> None:
        """Give the dispatcher a model's queue (before `run`)."""
        self._queues[queue.model] = queue

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            while True:
                await self._gather_arrivals()
                self._drain_inbox()
                while self._state.for_weight_cache:  # control first: between executions, never during one
                    assert self._weights is not None
                    await self._weights.forward(self._state.for_weight_cache.pop(0))
                while self._state.removals:
                    await self._remove(self._state.removals.pop(0))
                while self._state.retiring:
                    old, then = self._state.retiring.pop(0)
                    await old.retire(then)
                model = self._select()
                if model is None:
                    await self._wait_for_work()
                    continue
                split = self._state.splits.get(model)
                if split is not None:
                    await self._run_chunk(split)
                    continue
                policy = self._state.policies[model]
                edf = (policy.discipline or self._state.discipline) == "edf"
                take = Take(self._batches_send, edf, dict(policy.cost), self._load_seconds(model))
                await self._queues[model].take(take)
                batch = await self._batches.receive()
                if batch.requests:
                    try:
                        await self._execute(batch)
                    except Exception as e:  # a bug fails this batch (INTERNAL), not the loop
                        log.exception("batch failed", model=batch.model, batch_size=batch.batch_size)
                        for request in batch.requests:
                            request.fail(e)

    # -- inbox ---------------------------------------------------------------------------------

    def _drain_inbox(self) -> int:
        """Handle every message waiting; returns how many there were."""
        handled = 0
        while True:
            try:
                message = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return handled
            self._on_message(message)
            handled += 1

    async def _wait_for_work(self) -> None:
        """Sleep until a message arrives, or until a held partial batch is due."""
        due = min((s.ready_at for s in self._state.waiting.values()), default=math.inf)
        if due == math.inf:  # nothing held: no timer to set up (the common idle case)
            self._on_message(await self._inbox.receive())
            return
        with trio.move_on_after(max(0.0, due - time.monotonic())):
            self._on_message(await self._inbox.receive())

    def _on_message(self, message: DispatcherMessage) -> None:
        """Apply one message; one that fails is answered with the error (INTERNAL) and logged,
        and the loop carries on.

        A model's AddModel and RemoveModel come one at a time (`ModelTable` serializes them per
        model, and waits for a RemoveModel's reply), so they never overtake one another here.
        """
        try:
            self._apply(message)
        except Exception as e:
            log.exception("dispatcher message failed", message=type(message).__name__)
            if not isinstance(message, QueueSummary):
                answer(message.reply_to, outcome.Error(e))

    def _apply(self, message: DispatcherMessage) -> None:
        match message:
            case QueueSummary() if self._queues.get(message.model) is not message.queue:
                pass  # the last words of a queue retired meanwhile (its successor speaks for itself)
            case QueueSummary():
                if message.depth:
                    self._state.waiting[message.model] = message
                else:
                    self._state.waiting.pop(message.model, None)
            case SetPolicy(model=None, discipline=discipline):
                if discipline is not None:
                    self._state.discipline = discipline
                answer(message.reply_to, outcome.Value(None))
            case SetPolicy(model=str() as model) if model not in self._state.policies:
                answer(message.reply_to, outcome.Error(ModelNotFound(model, "it was unloaded")))
            case SetPolicy(model=str() as model, weight=weight, discipline=discipline):
                policy = self._state.policies[model]
                if weight is not None:
                    policy.weight = weight
                    self._state.policies.reweigh()
                    self._statistics[model].weight = weight
                if discipline is not None:
                    policy.discipline = discipline
                log.info("policy changed", model=model, weight=policy.weight, discipline=policy.discipline)
                answer(message.reply_to, outcome.Value(None))
            case Compact() | SetResidency():
                self._state.for_weight_cache.append(message)
            case AddModel() if message.name in self._queues:
                self._replace(message)
            case AddModel():
                self._models[message.name] = message.compiled
                self._state.policies[message.name] = message.policy
                message.policy.charged_load_s = self._statistics[message.name].weight_load_seconds
                self._statistics[message.name].weight = message.policy.weight
                self._queues[message.name] = message.queue
                self._state.for_weight_cache.append(
                    AddWeights(message.name, message.compiled.bundle, message.floor, message.reply_to)
                )
                log.info("model added", model=message.name)
            case RemoveModel():
                self._state.removals.append(message)
            case _:
                raise TypeError(f"Dispatcher got an unknown message {message!r}")

    def _replace(self, message: AddModel) -> None:
        """A reloaded model: its new version takes the name at once (new requests queue there);
        before the next selection the old queue hands over what it holds (or, when the tensors
        changed, answers it UNAVAILABLE: retry against the new version) and the weight cache
        swaps the weights."""
        name = message.name
        old_queue, old_model = self._queues[name], self._models[name]
        same_tensors = (
            old_model.bundle.manifest.executable_inputs == message.compiled.bundle.manifest.executable_inputs
            and old_model.bundle.manifest.executable_outputs
            == message.compiled.bundle.manifest.executable_outputs
        )
        self._models[name] = message.compiled
        self._queues[name] = message.queue
        self._state.policies[name] = message.policy
        message.policy.charged_load_s = self._statistics[name].weight_load_seconds  # the old one's
        self._statistics[name].weight = message.policy.weight
        self._state.waiting.pop(name, None)  # the old queue's; the new one reports its own
        then = (
            message.queue
            if same_tensors
            else ModelNotReady(
                name, "it was reloaded with other tensors while this request was queued; send it again"
            )
        )
        self._state.retiring.append((old_queue, then))
        self._state.for_weight_cache.append(DropWeights(name))  # the cache keeps the order: drop, add
        self._state.for_weight_cache.append(
            AddWeights(name, message.compiled.bundle, message.floor, message.reply_to)
        )
        log.info("model replaced", model=name, queued_requests_kept=same_tensors)

    async def _remove(self, message: RemoveModel) -> None:
        """Stop serving a model: its queue answers what it holds with NOT_FOUND, weights go."""
        queue = self._queues.pop(message.name, None)
        self._state.waiting.pop(message.name, None)
        self._state.policies.pop(message.name, None)
        self._models.pop(message.name, None)
        if queue is not None:
            await queue.retire(ModelNotFound(message.name, "it was unloaded"))
        assert self._weights is not None
        await self._weights.forward(DropWeights(message.name, message.reply_to))
        log.info("model removed", model=message.name)

    async def _gather_arrivals(self) -> None:
        """Let the event loop run before each turn while requests keep arriving, so that those
        whose bytes are already here are parsed, queued, and join the batch instead of the next.

        The front end shares this thread: without this the dispatcher takes each request the
        moment it is queued (about 1.1 rows per execution at concurrency 16). Each pass is one
        poll of the sockets; it stops after `QUIET_PASSES` passes that bring nothing (what a lone
        client pays: microseconds) or after `gather_passes`. Control messages handled here are
        applied by the turn that follows, before anything is chosen.
        """
        quiet = 0
        for _ in range(self._gather_passes):
            await trio.lowlevel.cancel_shielded_checkpoint()
            quiet = 0 if self._drain_inbox() else quiet + 1
            if quiet == QUIET_PASSES:
                return

    def _select(self) -> str | None:
        now = time.monotonic()
        summaries: Iterable[QueueSummary] = self._state.waiting.values()
        if self._state.splits:  # a model's split in progress stands for it, ahead of its queue
            self._end_orphaned_splits()
            splits = self._state.splits
            summaries = [
                *(s for s in summaries if s.model not in splits),
                *(split.summary(now) for split in splits.values()),
            ]
        committed = [s for s in summaries if s.committed]
        if committed:  # meta sub-calls go ahead of the discipline, oldest first
            first: str = min(committed, key=lambda s: s.front_enqueued_at).model
            return first
        ready = [
            Candidate(
                s.model, s.batch_size, s.front_enqueued_at, s.earliest_deadline, self._load_seconds(s.model)
            )
            for s in summaries
            if s.ready_at <= now
        ]
        return select(self._state.discipline, ready, self._state.policies, now, self._params)

    def _load_seconds(self, model: str) -> float:
        """What loading a model's weights would take now: 0 when they are on the device (or the
        cache does not manage them), else its bytes at the measured seconds per byte (0 until a
        load was measured)."""
        stats = self._statistics[model]
        if stats.resident or not stats.residency:
            return 0.0
        return stats.weight_bytes * self._statistics.seconds_per_weight_byte

    # -- execution -----------------------------------------------------------------------------

    async def _execute(self, batch: Batch) -> None:
        model = self._models[batch.model]
        requests = batch.requests
        if batch.chunks:  # runs one chunk per turn from now on
            split = _Split(model, requests[0], deque(batch.chunks))
            self._state.splits[batch.model] = split
            await self._run_chunk(split)
            return
        try:
            inputs = [r.inputs for r in requests]
            result = await self._run(model, batch.batch_size, inputs, sum(r.rows for r in requests), requests)
            per_request = split_outputs(
                model.bundle.manifest.executable_outputs, result.outputs, [r.rows for r in requests]
            )
        except (ExecutionFailed, NotResident) as e:
            _log_failure(batch.model, batch.batch_size, e)
            for request in requests:
                request.fail(e)
            return
        for request, outputs in zip(requests, per_request, strict=True):
            request.answer([outputs[i] for i in request.outputs])
        self._statistics[batch.model].requests_served += len(requests)

    async def _run(
        self,
        model: CompiledModel,
        batch_size: int,
        inputs: list[list[np.ndarray]],
        rows: int,
        requests: list[Infer],
    ) -> ExecutionResult:
        """One execution at `batch_size` of the joined inputs; records its cost and statistics
        (and, for the traced ones among its `requests`, their phases: `_record_phases`)."""
        assert self._weights is not None, "use_weights before run"
        stats = self._statistics[model.name]
        policy = self._state.policies[model.name]
        acquiring = time.monotonic()
        loads_before = stats.weight_loads
        weights = await self._weights.acquire(model.name)
        acquired = time.monotonic()
        if stats.weight_load_seconds > policy.charged_load_s:  # loads since its last turn: its own
            charged = stats.weight_load_seconds - policy.charged_load_s
            charge(policy, charged, acquired, self._params)
            self._state.policies.record(charged, acquired)
            policy.charged_load_s = stats.weight_load_seconds
        specs = model.bundle.manifest.executable_inputs

        def execute() -> ExecutionResult:
            return model.execute(batch_size, assemble(specs, inputs, batch_size), weights)

        if (
            sum(a.nbytes for request in inputs for a in request) <= INLINE_INPUT_BYTES
            and policy.expected_cost(batch_size, self._params) <= INLINE_WORK_S
        ):
            # A thread hop costs ~0.1 ms of CPU, more than a small batch's whole execution; the
            # loop waits for it, as it would wait for the one execution in flight anyway.
            result = execute()
        elif self._overlap_loads:
            result = await self._overlapping(model.name, execute)
        else:
            result = await trio.to_thread.run_sync(execute)
        ended = time.monotonic()
        seconds = result.input_s + result.infer_s
        record_execution(policy, batch_size, seconds, ended, self._params)
        self._state.policies.record(seconds, ended)
        stats.record_execution(batch_size, rows, result.input_s, result.infer_s, 0.0)
        stats.cost = dict(policy.cost)
        loaded = stats.weight_loads > loads_before
        if loaded:  # every request of the batch waited for the load
            stats.load_wait_seconds += (acquired - acquiring) * len(inputs)
        for request in requests:
            if request.trace is not None:  # tracing is on (a loop, not a list: the off path is cheaper)
                execution = (acquired, ended, batch_size, rows)
                _record_phases(request.trace, acquiring, stats.last_load, execution, request.rows)
        return result

    async def _overlapping(self, running: str, execute: Callable[[], ExecutionResult]) -> ExecutionResult:
        """Run `execute` in a worker thread while reading the inbox and prefetching the weights
        of the models with requests queued, so that their loads overlap this execution."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._prefetch_arrivals, running)
            result = await trio.to_thread.run_sync(execute)
            nursery.cancel_scope.cancel()
        return result

    async def _prefetch_arrivals(self, running: str) -> None:
        """Prefetch what is queued now, then what arrives, until cancelled (the execution ended).
        Messages are only recorded here, as between turns: control applies after the execution."""
        assert self._weights is not None
        asked: set[str] = {running}
        while True:
            waiting = self._state.waiting
            keep = frozenset((running, *waiting, *self._state.splits))
            for summary in sorted(waiting.values(), key=lambda s: s.front_enqueued_at):
                if summary.model not in asked:
                    asked.add(summary.model)
                    await self._weights.prefetch(summary.model, keep)
            self._on_message(await self._inbox.receive())
            self._drain_inbox()

    async def _run_chunk(self, split: _Split) -> None:
        """The next execution of a split request, unless its client went away or its deadline
        passed; the last one answers it."""
        request = split.request
        name = request.model
        rows, size = split.chunks[0]
        if self._split_is_dead(split, size):
            del self._state.splits[name]
            return
        manifest = split.model.bundle.manifest
        inputs = slice_rows(manifest.executable_inputs, request.inputs, split.done, rows)
        try:
            result = await self._run(split.model, size, [inputs], rows, [request])
        except (ExecutionFailed, NotResident) as e:
            _log_failure(name, size, e)
            del self._state.splits[name]
            request.fail(e)
            return
        split.chunks.popleft()
        split.parts.append(split_outputs(manifest.executable_outputs, result.outputs, [rows])[0])
        split.done += rows
        if split.chunks:
            return
        del self._state.splits[name]
        outputs = join_outputs(manifest.executable_outputs, split.parts)
        request.answer([outputs[i] for i in request.outputs])
        self._statistics[name].requests_served += 1

    def _split_is_dead(self, split: _Split, size: int) -> bool:
        """Whether a split request must stop (counted, and answered unless its client is gone),
        as the queue drops a request before its execution: its client went away, or its
        deadline passed (under edf, it cannot finish its next chunk in time)."""
        request = split.request
        stats = self._statistics[request.model]
        if request.reply.cancelled():
            stats.drops["cancelled"] += 1
            return True
        policy = self._state.policies[request.model]
        edf = (policy.discipline or self._state.discipline) == "edf" and not request.committed
        now = time.monotonic()
        pending = Pending(request.rows, request.enqueued_at, request.deadline)
        expected = policy.cost.get(size, 0.0) + self._load_seconds(request.model)
        if drop_reason(pending, now, edf=edf, expected_cost_s=expected):
            assert request.deadline is not None
            stats.drops["deadline"] += 1
            request.fail(DeadlineExceeded(request.model, now - request.deadline))
            return True
        return False

    def _end_orphaned_splits(self) -> None:
        """Answer split requests whose model was unloaded or reloaded since they started."""
        for name, split in list(self._state.splits.items()):
            current = self._models.get(name)
            if current is split.model:
                continue
            del self._state.splits[name]
            split.request.fail(
                ModelNotFound(name, "it was unloaded")
                if current is None
                else ModelNotReady(name, "it was reloaded while this request ran; send it again")
            )


def _record_phases(
    record: EngineTrace,
    dequeued_at: float,
    load: tuple[float, float, int, bool] | None,
    execution: tuple[float, float, int, int],
    rows: int,
) -> None:
    """Note an execution in a traced request's record, and the model's latest `load` if it began
    after the request was queued: the load it waited for, or one hidden behind another model's
    execution while it was queued (a prefetch, `overlapped`)."""
    if not record.dequeued_at:
        record.dequeued_at = dequeued_at
    if load is not None and load[0] >= record.enqueued_at and load not in record.loads:
        record.loads.append(load)
    record.executions.append((*execution, rows))


def _log_failure(model: str, batch_size: int, error: Exception) -> None:
    if isinstance(error, ExecutionFailed):
        log.error("execution failed", model=model, batch_size=batch_size, cause=error.cause)
