"""Every message the actors exchange, in one place; each says who sends it to whom.

Commands are verbs, replies and notices are nouns. Requests carry their own reply slot (an
object with `set_result`/`set_exception`/`cancelled`, in practice the asyncio future the gRPC
handler awaits), so the actor that finishes the work answers the caller directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

__all__ = [
    "Batch",
    "Infer",
    "QueueSummary",
    "Reply",
    "SetPolicy",
    "Take",
]


class Reply(Protocol):
    """Where a request's answer goes (an `asyncio.Future` satisfies it)."""

    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...
    def cancelled(self) -> bool: ...
    def done(self) -> bool: ...


@dataclass(slots=True, eq=False)
class Infer:
    """front end → ModelQueue: run these executable inputs; answer on `reply`.

    `inputs` are in the manifest's executable-input order, already validated; `rows` is the
    extent of the batch axis (1 for an unbatched model). Times are `time.monotonic()` seconds.
    """

    model: str
    inputs: list[np.ndarray]
    rows: int
    outputs: list[int]
    """Indices of executable outputs to return, in the order the client asked for them."""
    reply: Reply
    enqueued_at: float
    deadline: float | None = None

    def answer(self, result: Any) -> None:
        if not self.reply.done():
            self.reply.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(error)


@dataclass(frozen=True, slots=True)
class QueueSummary:
    """ModelQueue → Dispatcher: what this queue holds now (sent after every change)."""

    model: str
    depth: int
    rows: int
    front_enqueued_at: float
    earliest_deadline: float | None


@dataclass(frozen=True, slots=True)
class Take:
    """Dispatcher → ModelQueue: hand over the next batch; reply a `Batch` on `reply_to`."""

    reply_to: trio.MemorySendChannel[Batch]


@dataclass(frozen=True, slots=True)
class Batch:
    """ModelQueue → Dispatcher: the requests to execute together at `batch_size` (may be empty)."""

    model: str
    batch_size: int
    requests: list[Infer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """control → Dispatcher: change a model's scheduling weight (None leaves it)."""

    model: str
    weight: float | None = None
