"""Dispatcher: the single dispatch loop; exactly one execution runs at a time.

Its inbox takes `QueueSummary` notices from every ModelQueue and control commands
(`SetPolicy`). Each turn it drains the inbox (control first), picks the next model from the
queue summaries, asks that queue for a `Batch`, executes it, and answers every request in the
batch. Only this actor runs executables. The loop never waits on the device: waiting for
results (and all the work of large batches) happens in a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog
import trio
from hloserve.actors.messages import Batch, Infer, QueueSummary, SetPolicy
from hloserve.actors.model_queue import ModelQueueHandle

from hloserve import _xla
from hloserve.batching import assemble, split_outputs
from hloserve.compiled import CompiledModel, ExecutionResult, Launched
from hloserve.errors import ExecutionFailed
from hloserve.statistics import Statistics

__all__ = ["Dispatcher"]

log = structlog.get_logger("hloserve.dispatcher")

INLINE_INPUT_BYTES = 256 << 10
"""Batches with at most this many input bytes are launched on the loop (see `_execute`)."""
POLL_S = 100e-6
"""How long to poll a launched execution before waiting for it in a thread (see `_collect`)."""


@dataclass(slots=True)
class _State:
    waiting: dict[str, QueueSummary] = field(default_factory=dict)  # models with queued requests
    weights: dict[str, float] = field(default_factory=dict)  # scheduling weight per model


class Dispatcher:
    """The actor; see the module docstring."""

    def __init__(
        self,
        models: Mapping[str, CompiledModel],
        device_weights: Mapping[str, list[_xla.DeviceArray]],
        statistics: Statistics,
    ) -> None:
        self._models = models
        self._device_weights = device_weights
        self._statistics = statistics
        self._queues: dict[str, ModelQueueHandle] = {}
        self._state = _State(weights=dict.fromkeys(models, 1.0))
        self.inbox, self._inbox = trio.open_memory_channel[object](float("inf"))
        self._batches_send, self._batches = trio.open_memory_channel[Batch](1)

    def attach(self, queue: ModelQueueHandle) -> None:
        """Give the dispatcher a model's queue (before `run`)."""
        self._queues[queue.model] = queue

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            while True:
                if not self._state.waiting:
                    self._on_message(await self._inbox.receive())
                self._drain_inbox()
                model = self._select()
                if model is None:
                    continue
                await self._queues[model].take(self._batches_send)
                batch = await self._batches.receive()
                self._drain_inbox()  # the queue's summary after the take
                if batch.requests:
                    await self._execute(batch)

    # -- inbox ---------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return
            self._on_message(message)

    def _on_message(self, message: object) -> None:
        match message:
            case QueueSummary():
                if message.depth:
                    self._state.waiting[message.model] = message
                else:
                    self._state.waiting.pop(message.model, None)
            case SetPolicy(model=model, weight=weight):
                if weight is not None:
                    self._state.weights[model] = weight
            case _:
                raise TypeError(f"Dispatcher got an unknown message {message!r}")

    # -- policy --------------------------------------------------------------------------------

    def _select(self) -> str | None:
        """The model to serve next: here the one whose oldest request arrived first."""
        if not self._state.waiting:
            return None
        return min(self._state.waiting.values(), key=lambda s: (s.front_enqueued_at, s.model)).model

    # -- execution -----------------------------------------------------------------------------

    async def _execute(self, batch: Batch) -> None:
        model = self._models[batch.model]
        weights = self._device_weights[batch.model]
        requests = batch.requests
        manifest = model.bundle.manifest
        try:
            if sum(a.nbytes for r in requests for a in r.inputs) <= INLINE_INPUT_BYTES:
                # Small inputs: joining and placing them costs less than a thread hop, and
                # launching does not wait; only a slow wait for results goes to a thread.
                inputs = assemble(manifest.executable_inputs, [r.inputs for r in requests], batch.batch_size)
                result = await _collect(model.launch(batch.batch_size, inputs, weights))
            else:
                result = await trio.to_thread.run_sync(
                    self._run_batch, model, batch.batch_size, requests, weights
                )
        except ExecutionFailed as e:
            log.error("execution failed", model=batch.model, batch_size=batch.batch_size, cause=e.cause)
            for request in requests:
                request.fail(e)
            return
        output_s = time.perf_counter()
        per_request = split_outputs(manifest.executable_outputs, result.outputs, [r.rows for r in requests])
        for request, outputs in zip(requests, per_request, strict=True):
            request.answer([outputs[i] for i in request.outputs])
        self._statistics[batch.model].record_execution(
            batch.batch_size,
            sum(r.rows for r in requests),
            result.input_s,
            result.infer_s,
            time.perf_counter() - output_s,
        )

    @staticmethod
    def _run_batch(
        model: CompiledModel, batch_size: int, requests: list[Infer], weights: list[_xla.DeviceArray]
    ) -> ExecutionResult:
        inputs = assemble(model.bundle.manifest.executable_inputs, [r.inputs for r in requests], batch_size)
        return model.execute(batch_size, inputs, weights)


async def _collect(launched: Launched) -> ExecutionResult:
    """The results of a launched execution, waiting in a worker thread only if they are slow.

    A small model finishes within microseconds of its launch; polling at loop checkpoints for up
    to `POLL_S` costs far less than handing the wait to a thread (about 0.13 ms of CPU a request).
    """
    give_up = time.perf_counter() + POLL_S
    while not launched.ready():
        if time.perf_counter() > give_up:
            return await trio.to_thread.run_sync(launched.collect)
        await trio.sleep(0)
    return launched.collect()
