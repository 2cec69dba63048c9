"""ModelQueue: the pending requests of one model, in arrival order.

Owns the FIFO of `Infer` requests of one model; a meta model's sub-calls (`committed`) go ahead
of the rest, in their own arrival order, so a meta request already running finishes first. Its
inbox takes `Infer` and `Withdraw` (from the front end, through `ModelQueueHandle`) and `Take`
(from the dispatcher). After each turn (every message that arrived together) it sends one
`QueueSummary` to the dispatcher; on `Take` it drops requests whose client went away or whose
deadline passed, plans the batch (`hloserve.engine.policy.plan_batch`) and replies a `Batch`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TypeAlias, final

import trio

from hloserve.actors.messages import (
    Batch,
    DispatcherMessage,
    Infer,
    QueueAddress,
    QueueSummary,
    Retire,
    Take,
    Withdraw,
)
from hloserve.engine.policy import BatchPlan, Pending, drop_reason, plan_batch, queue_delay
from hloserve.engine.statistics import Statistics
from hloserve.errors import BatchTooLarge, DeadlineExceeded, QueueFull, ShuttingDown

__all__ = ["ModelQueue", "ModelQueueHandle", "QueueSettings"]

_Message: TypeAlias = Infer | Take | Withdraw | Retire


@final
class ModelQueueHandle:
    """The only way to reach a ModelQueue; made by the actor, not by callers."""

    __slots__ = ("_send", "_successor", "model")

    def __init__(self, model: str, send: trio.MemorySendChannel[_Message]) -> None:
        self.model = model
        self._send = send
        self._successor: QueueAddress | Exception | None = None

    def submit_nowait(self, request: Infer) -> None:
        """Queue a request without waiting; QueueFull when the inbox itself is full. A request
        for a queue that handed over to a reloaded model's queue goes there; one for a queue
        retired with an error (its model was unloaded) raises that error."""
        try:
            self._send.send_nowait(request)
        except trio.WouldBlock:
            raise QueueFull(self.model, self._send.statistics().current_buffer_used) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if self._successor is None:
                raise ShuttingDown() from None
            if isinstance(self._successor, Exception):
                raise self._successor.with_traceback(None) from None
            self._successor.submit_nowait(request)

    def withdraw_nowait(self, request: Infer) -> None:
        """Forget a request whose client went away (best effort: a full inbox skips it)."""
        try:
            self._send.send_nowait(Withdraw(request))
        except trio.WouldBlock:
            pass  # it will be skipped when it reaches the front
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if self._successor is not None and not isinstance(self._successor, Exception):
                self._successor.withdraw_nowait(request)

    def forward_to(self, successor: QueueAddress | Exception) -> None:
        """From now on, send what arrives to `successor` (the queue of a reloaded model), or
        answer it with `successor`, an error (the model was unloaded, or reloaded with other
        tensors), rather than as if the server were shutting down."""
        self._successor = successor

    async def take(self, message: Take) -> None:
        await self._send.send(message)

    async def retire(self, then: QueueAddress | Exception) -> None:
        """Stop the queue: what it holds goes to `then`, the queue of the model's new version,
        or is answered with `then`, an error (see `Retire`)."""
        await self._send.send(Retire(then))

    def __repr__(self) -> str:
        return f"<ModelQueueHandle {self.model!r} inbox={self._send.statistics().current_buffer_used}>"


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """How one model's queue plans and admits."""

    batch_sizes: tuple[int, ...]
    """Compiled sizes, ascending; `(0,)` for a single unbatched module."""
    coalescable: bool
    """Every executable input and output has a batch axis, so requests can be joined."""
    max_depth: int
    max_batch_size: int | None = None
    max_queue_delay_s: float = 0.0


@dataclass(slots=True)
class _State:
    pending: deque[Infer] = field(default_factory=deque)  # oldest first
    rows: int = 0  # rows over `pending`


def _pending(request: Infer) -> Pending:
    return Pending(request.rows, request.enqueued_at, request.deadline)


class ModelQueue:
    """The actor; see the module docstring."""

    def __init__(
        self,
        model: str,
        settings: QueueSettings,
        dispatcher: trio.MemorySendChannel[DispatcherMessage],
        statistics: Statistics,
    ) -> None:
        self.model = model
        self._settings = settings
        self._dispatcher = dispatcher
        self._statistics = statistics
        self._state = _State()
        # The inbox only holds what arrives between two turns of this actor; depth is enforced
        # on the FIFO, where it can be answered with a precise error.
        self._send, self._receive = trio.open_memory_channel[_Message](max(64, settings.max_depth))
        self._handle = ModelQueueHandle(model, self._send.clone())

    async def run(self, *, task_status: trio.TaskStatus[ModelQueueHandle] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self._handle)
        try:
            async for message in self._receive:
                # Everything that arrived together (a link's read brings many requests) is
                # handled, then summarized for the dispatcher once: a summary plans a batch.
                while self._on_message(message):
                    try:
                        message = self._receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                else:
                    return
                self._summarize()
        finally:
            self._fail_everything(ShuttingDown())  # after Retire: nothing left, a no-op

    def _on_message(self, message: _Message) -> bool:
        """Apply one message; False once the queue has retired."""
        match message:
            case Infer():
                self._on_infer(message)
            case Take():
                self._on_take(message)
            case Withdraw():
                self._on_withdraw(message)
            case Retire(then=Exception() as error):
                self._fail_everything(error)
                return False
            case Retire(then=successor):
                self._hand_over(successor)
                return False
            case _:
                raise TypeError(f"ModelQueue got an unknown message {message!r}")
        return True

    def _hand_over(self, successor: QueueAddress) -> None:
        """Pass every queued request, in order, to the queue of the model's new version, and
        have this queue's handle send there what still arrives (a request that was in a hook)."""
        self._handle.forward_to(successor)
        for request in self._close():
            try:
                successor.submit_nowait(request)
            except (QueueFull, ShuttingDown) as e:
                request.fail(e)

    def _fail_everything(self, error: Exception) -> None:
        """Answer every queued request, everything still in the inbox and (unless the server
        is shutting down) what still arrives, with `error`."""
        if not isinstance(error, ShuttingDown):
            self._handle.forward_to(error)
        for request in self._close():
            request.fail(error)

    def _close(self) -> list[Infer]:
        """Close the inbox; every request queued or still in the inbox, oldest first."""
        requests = list(self._state.pending)
        self._state.pending.clear()
        while True:
            try:
                message = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, Infer):
                requests.append(message)
        self._receive.close()
        return requests

    # -- messages ------------------------------------------------------------------------------

    def _on_infer(self, request: Infer) -> None:
        state = self._state
        limit = self._settings.max_batch_size
        if limit is not None and request.rows > limit:  # as Triton; below it a large one is split
            request.fail(BatchTooLarge(self.model, request.rows, limit))
            return
        if len(state.pending) >= self._settings.max_depth:
            self._statistics[self.model].drops["queue_full"] += 1
            request.fail(QueueFull(self.model, len(state.pending)))
            return
        if request.committed:
            ahead = 0
            while ahead < len(state.pending) and state.pending[ahead].committed:
                ahead += 1
            state.pending.insert(ahead, request)
        else:
            state.pending.append(request)
        state.rows += request.rows

    def _on_withdraw(self, message: Withdraw) -> None:
        try:
            self._state.pending.remove(message.request)
        except ValueError:
            return  # already taken or dropped
        self._state.rows -= message.request.rows
        self._statistics[self.model].drops["cancelled"] += 1
        message.request.reply.cancel()  # a frontend's reply then frees its slot

    def _on_take(self, message: Take) -> None:
        plan, taken = self._next_batch(message)
        if plan is None:
            message.reply_to.send_nowait(Batch(self.model, 0))
            return
        message.reply_to.send_nowait(Batch(self.model, plan.batch_size, taken, plan.chunks))

    # -- planning ------------------------------------------------------------------------------

    def _drop_dead(self, request: Infer, now: float, message: Take, batch_size: int) -> bool:
        """Answer and count a request that must not run; True if it was dropped."""
        stats = self._statistics[self.model]
        if request.reply.cancelled():
            stats.drops["cancelled"] += 1
            return True
        cost = message.costs.get(batch_size, 0.0) + message.load_s
        edf = message.edf and not request.committed  # a sub-call is exempt from laxity drops
        if drop_reason(_pending(request), now, edf=edf, expected_cost_s=cost):
            stats.drops["deadline"] += 1
            assert request.deadline is not None
            request.fail(DeadlineExceeded(self.model, now - request.deadline))
            return True
        return False

    def _next_batch(self, message: Take) -> tuple[BatchPlan | None, list[Infer]]:
        """Plan the next batch over the live requests, dropping dead ones on the way."""
        state = self._state
        settings = self._settings
        now = time.monotonic()
        while True:
            plan = plan_batch(
                [_pending(r) for r in self._window()],
                settings.batch_sizes,
                coalescable=settings.coalescable,
                cap=settings.max_batch_size,
            )
            if plan is None:
                return None, []
            taken = [state.pending.popleft() for _ in range(plan.take)]
            state.rows -= sum(r.rows for r in taken)
            live = [r for r in taken if not self._drop_dead(r, now, message, plan.batch_size)]
            if len(live) == len(taken):
                break
            for request in reversed(live):  # re-plan without the dead ones
                state.pending.appendleft(request)
                state.rows += request.rows
        stats = self._statistics[self.model]
        for request in taken:
            waited = now - request.enqueued_at
            stats.queue.add(waited)
            stats.waits.append(waited)
        return plan, taken

    def _window(self) -> list[Infer]:
        """The requests planning may look at: enough to fill the largest batch."""
        largest = max(self._settings.batch_sizes)
        window, rows = [], 0
        for request in self._state.pending:
            window.append(request)
            rows += request.rows
            if rows >= largest:
                break
        return window

    def _tell_dispatcher(self, summary: QueueSummary) -> None:
        try:
            self._dispatcher.send_nowait(summary)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the dispatcher has stopped: shutting down, and this queue's end answers everyone

    def _summarize(self) -> None:
        state = self._state
        pending = state.pending
        self._statistics[self.model].queue_depth = len(pending)
        if not pending:
            self._tell_dispatcher(
                QueueSummary(self.model, 0, 0, 0, math.inf, None, math.inf, queue=self._handle)
            )
            return
        settings = self._settings
        plan = plan_batch(
            [_pending(r) for r in self._window()],
            settings.batch_sizes,
            coalescable=settings.coalescable,
            cap=settings.max_batch_size,
        )
        assert plan is not None
        now = time.monotonic()
        front = pending[0]
        wait = queue_delay(
            state.rows, settings.batch_sizes, now - front.enqueued_at, settings.max_queue_delay_s
        )
        deadlines = [r.deadline for r in pending if r.deadline is not None]
        earliest = min(deadlines) if deadlines else None
        # A partial batch is held for more rows, but never past a request's deadline, and a
        # sub-call is never held: its meta request is already running.
        ready_at = now + wait if earliest is None else min(now + wait, earliest)
        if front.committed:
            ready_at = now
        summary = QueueSummary(
            self.model,
            len(pending),
            state.rows,
            plan.batch_size,
            front.enqueued_at,
            earliest,
            ready_at,
            front.committed,
            self._handle,
        )
        self._tell_dispatcher(summary)
