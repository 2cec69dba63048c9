"""ModelQueue: the pending requests of one model, in arrival order.

Owns the FIFO of `Infer` requests of one model. Its inbox takes `Infer` (from the front end,
through `ModelQueueHandle.submit_nowait`) and `Take` (from the dispatcher). After every change
it sends a `QueueSummary` to the dispatcher; on `Take` it drops requests whose client went away
or whose deadline passed, and replies a `Batch` with what to execute now.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import final

import trio
from hloserve.actors.messages import Batch, Infer, QueueSummary, Take

from hloserve.errors import DeadlineExceeded, QueueFull, ShuttingDown
from hloserve.statistics import Statistics

__all__ = ["ModelQueue", "ModelQueueHandle"]


@final
class ModelQueueHandle:
    """The only way to reach a ModelQueue; made by `ModelQueue.open`, not by callers."""

    __slots__ = ("_send", "model")

    def __init__(self, model: str, send: trio.MemorySendChannel[Infer | Take]) -> None:
        self.model = model
        self._send = send

    def submit_nowait(self, request: Infer) -> None:
        """Queue a request without waiting; QueueFull when the inbox itself is full."""
        try:
            self._send.send_nowait(request)
        except trio.WouldBlock:
            raise QueueFull(self.model, self._send.statistics().current_buffer_used) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ShuttingDown() from None

    async def take(self, reply_to: trio.MemorySendChannel[Batch]) -> None:
        await self._send.send(Take(reply_to))

    def close(self) -> None:
        self._send.close()

    def __repr__(self) -> str:
        return f"<ModelQueueHandle {self.model!r} inbox={self._send.statistics().current_buffer_used}>"


@dataclass(slots=True)
class _State:
    pending: deque[Infer] = field(default_factory=deque)  # FIFO, oldest first
    rows: int = 0  # rows over `pending`


class ModelQueue:
    """The actor; see the module docstring."""

    def __init__(
        self,
        model: str,
        batch_sizes: Sequence[int],
        max_depth: int,
        dispatcher: trio.MemorySendChannel[object],
        statistics: Statistics,
    ) -> None:
        self.model = model
        self._batch_sizes = tuple(sorted(batch_sizes))
        self._max_depth = max_depth
        self._dispatcher = dispatcher
        self._statistics = statistics
        self._state = _State()
        # The inbox only needs to hold what arrives between two turns of this actor; depth is
        # enforced on the FIFO, where it can be answered with a precise error.
        self._send, self._receive = trio.open_memory_channel[Infer | Take](max(64, max_depth))

    def handle(self) -> ModelQueueHandle:
        return ModelQueueHandle(self.model, self._send.clone())

    async def run(self, *, task_status: trio.TaskStatus[ModelQueueHandle] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self.handle())
        try:
            async for message in self._receive:
                match message:
                    case Infer():
                        self._on_infer(message)
                    case Take():
                        self._on_take(message)
                    case _:
                        raise TypeError(f"ModelQueue got an unknown message {message!r}")
        finally:
            self._fail_everything(ShuttingDown())

    def _fail_everything(self, error: Exception) -> None:
        """Answer every queued request and everything still in the inbox, then close it."""
        for request in self._state.pending:
            request.fail(error)
        self._state.pending.clear()
        while True:
            try:
                message = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, Infer):
                message.fail(error)
        self._receive.close()

    def _on_infer(self, request: Infer) -> None:
        state = self._state
        if len(state.pending) >= self._max_depth:
            request.fail(QueueFull(self.model, len(state.pending)))
            return
        state.pending.append(request)
        state.rows += request.rows
        self._summarize()

    def _on_take(self, message: Take) -> None:
        taken = self._next_batch()
        self._summarize()
        batch_size = self._batch_size_for(taken[0].rows) if taken else 0
        message.reply_to.send_nowait(Batch(self.model, batch_size, taken))

    def _next_batch(self) -> list[Infer]:
        """The requests to run next: here the first live one, alone."""
        state = self._state
        now = time.monotonic()
        while state.pending:
            request = state.pending.popleft()
            state.rows -= request.rows
            if request.reply.cancelled():
                continue
            if request.deadline is not None and now >= request.deadline:
                request.fail(DeadlineExceeded(self.model, now - request.deadline))
                continue
            self._statistics[self.model].queue.add(now - request.enqueued_at)
            return [request]
        return []

    def _batch_size_for(self, rows: int) -> int:
        if self._batch_sizes == (0,):
            return 0
        return next((b for b in self._batch_sizes if b >= rows), self._batch_sizes[-1])

    def _summarize(self) -> None:
        pending = self._state.pending
        self._statistics[self.model].queue_depth = len(pending)
        deadlines = [r.deadline for r in pending if r.deadline is not None]
        self._dispatcher.send_nowait(
            QueueSummary(
                self.model,
                len(pending),
                self._state.rows,
                pending[0].enqueued_at if pending else math.inf,
                min(deadlines) if deadlines else None,
            )
        )
