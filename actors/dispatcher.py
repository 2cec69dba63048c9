"""Dispatcher: the single dispatch loop; exactly one execution runs at a time.

Its inbox takes `QueueSummary` notices from every ModelQueue and control commands
(`SetPolicy`). Each turn it drains the inbox (control first), picks the next model from the
queue summaries, asks that queue for a `Batch`, executes it in a worker thread, and answers
every request in the batch. Only this actor runs executables.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import structlog
import trio
from hloserve.actors.messages import Batch, Infer, QueueSummary, SetPolicy
from hloserve.actors.model_queue import ModelQueueHandle

from hloserve import _xla
from hloserve.batching import assemble, split_outputs
from hloserve.compiled import CompiledModel, ExecutionResult
from hloserve.errors import ExecutionFailed
from hloserve.statistics import Statistics

__all__ = ["Dispatcher"]

log = structlog.get_logger("hloserve.dispatcher")


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
        try:
            result, per_request = await trio.to_thread.run_sync(
                self._run_batch, model, batch.batch_size, batch.requests, self._device_weights[batch.model]
            )
        except ExecutionFailed as e:
            log.error("execution failed", model=batch.model, batch_size=batch.batch_size, cause=e.cause)
            for request in batch.requests:
                request.fail(e)
            return
        rows = sum(r.rows for r in batch.requests)
        output_s = time.perf_counter()
        for request, outputs in zip(batch.requests, per_request, strict=True):
            request.answer([outputs[i] for i in request.outputs])
        self._statistics[batch.model].record_execution(
            batch.batch_size, rows, result.input_s, result.infer_s, time.perf_counter() - output_s
        )

    @staticmethod
    def _run_batch(
        model: CompiledModel, batch_size: int, requests: list[Infer], weights: list[_xla.DeviceArray]
    ) -> tuple[ExecutionResult, list[list[np.ndarray]]]:
        specs = model.bundle.manifest.executable_inputs
        inputs = assemble(specs, [r.inputs for r in requests], batch_size)
        result = model.execute(batch_size, inputs, weights)
        per_request = split_outputs(
            model.bundle.manifest.executable_outputs, result.outputs, [r.rows for r in requests]
        )
        return result, per_request
