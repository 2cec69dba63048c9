"""Every message the actors exchange, in one place; each says who sends it to whom.

Commands are verbs, replies and notices are nouns. Requests carry their own reply slot (an
object with `set_result`/`set_exception`/`cancelled`, in practice the asyncio future the gRPC
handler awaits), so the actor that finishes the work answers the caller directly. Control
messages carry a `reply_to` channel of trio's `outcome` values (the answer, or the error to
raise): the asker `unwrap()`s what it receives.

A leaf of the actors: it imports no actor, so a model queue is named by `QueueAddress`, the
protocol its `ModelQueueHandle` satisfies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import numpy as np
import outcome
import trio

from hloserve.types import Discipline, Residency

if TYPE_CHECKING:  # JAX's types: a frontend builds these messages without importing JAX
    from hloserve.engine.policy import ModelPolicy
    from hloserve.models._xla import DeviceArray
    from hloserve.models.bundle import Bundle
    from hloserve.models.compiled import CompiledModel

__all__ = [
    "Acquire",
    "AddModel",
    "AddWeights",
    "Batch",
    "Compact",
    "Compacted",
    "DispatcherMessage",
    "DropWeights",
    "EngineTrace",
    "Infer",
    "Prefetch",
    "QueueAddress",
    "QueueSummary",
    "RemoveModel",
    "Reply",
    "Retire",
    "SetPolicy",
    "SetResidency",
    "Take",
    "WeightCacheMessage",
    "Withdraw",
    "answer",
]

T = TypeVar("T")


def answer(reply_to: trio.MemorySendChannel[outcome.Outcome[T]] | None, result: outcome.Outcome[T]) -> None:
    """Answer a control message on its reply channel, if it has one whose reader still waits."""
    if reply_to is not None:
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            reply_to.send_nowait(result)


class Reply(Protocol):
    """Where a request's answer goes (an `asyncio.Future` satisfies it)."""

    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...
    def cancelled(self) -> bool: ...
    def done(self) -> bool: ...
    def cancel(self) -> bool:
        """Its queue dropped it unread (withdrawn); an already cancelled future ignores it."""
        ...


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
    committed: bool = False
    """A meta model's sub-call: queued ahead of other requests, never dropped for laxity."""
    trace: EngineTrace | None = None
    """Where the dispatcher records this request's phases for its trace (None: not traced)."""

    def answer(self, result: list[np.ndarray]) -> None:
        if not self.reply.done():
            self.reply.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(error)


@dataclass(slots=True)
class EngineTrace:
    """A traced request's phases in the engine, filled by the dispatcher (monotonic seconds) and
    read by whoever made the spans once the request is answered (`hloserve.engine.tracing`)."""

    enqueued_at: float = 0.0
    dequeued_at: float = 0.0
    """When the dispatcher took its batch (0: it never ran)."""
    loads: list[tuple[float, float, int, bool]] = field(default_factory=list)
    """(start, end, bytes, overlapped) of each weight load it waited for."""
    executions: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    """(start, end, compiled batch size, rows in the batch, rows of this request) of each."""


@dataclass(frozen=True, slots=True)
class Withdraw:
    """front end → ModelQueue: the client of `request` went away; forget it."""

    request: Infer


class QueueAddress(Protocol):
    """How messages name a model's queue (its `ModelQueueHandle`)."""

    @property
    def model(self) -> str: ...
    def submit_nowait(self, request: Infer, /) -> None: ...
    def withdraw_nowait(self, request: Infer, /) -> None: ...
    async def take(self, message: Take, /) -> None: ...
    async def retire(self, then: QueueAddress | Exception, /) -> None: ...


@dataclass(frozen=True, slots=True)
class QueueSummary:
    """ModelQueue → Dispatcher: what this queue holds now (sent after every change)."""

    model: str
    depth: int
    rows: int
    batch_size: int
    """The compiled size its next batch would run at."""
    front_enqueued_at: float
    earliest_deadline: float | None
    ready_at: float
    """When the next batch should go (later than now while max_queue_delay waits for rows)."""
    committed: bool = False
    """The front request is a meta model's sub-call: the dispatcher takes it first."""
    queue: QueueAddress | None = None
    """The sender's `ModelQueueHandle`: the last words of a queue replaced by a reload (or of
    an unloaded model's, loaded again since) are told from its successor's by it."""


@dataclass(frozen=True, slots=True)
class Take:
    """Dispatcher → ModelQueue: hand over the next batch; reply a `Batch` on `reply_to`.

    `edf` asks for laxity drops using `costs` (learned seconds per batch size) plus `load_s`,
    the time the model's weights take to load when they are not on the device.
    """

    reply_to: trio.MemorySendChannel[Batch]
    edf: bool = False
    costs: Mapping[int, float] = field(default_factory=dict)
    load_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Batch:
    """ModelQueue → Dispatcher: the requests to execute together (may be empty).

    `chunks` is set when one request is larger than the largest compiled size: (rows, compiled
    size) per execution, in order.
    """

    model: str
    batch_size: int
    requests: list[Infer] = field(default_factory=list)
    chunks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """control → Dispatcher: change a model's weight or discipline, or (model None) the global
    discipline; None leaves a field as it is. Replies None, or ModelNotFound, on `reply_to`."""

    model: str | None
    weight: float | None = None
    discipline: Discipline | None = None
    reply_to: trio.MemorySendChannel[outcome.Outcome[None]] | None = None


@dataclass(frozen=True, slots=True)
class Acquire:
    """Dispatcher → WeightCache: make `model` resident; reply its weights (or the error)."""

    model: str
    reply_to: trio.MemorySendChannel[outcome.Outcome[list[DeviceArray]]]


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Dispatcher → WeightCache: start copying `model`'s weights to the device now, without
    waiting, so the load overlaps the execution in flight; an `Acquire` of it later waits for
    the copy to end. The cache may evict to make room, but never a model in `keep` (the one
    executing, those with requests queued) nor one whose copy is in flight; when that leaves
    no room it starts nothing. No reply."""

    model: str
    keep: frozenset[str]
    reply_to: None = None


@dataclass(frozen=True, slots=True)
class Compact:
    """control → Dispatcher → WeightCache: free every resident unpinned model, then load
    `reload`; reply `Compacted` on `reply_to`."""

    reload: tuple[str, ...]
    reply_to: trio.MemorySendChannel[outcome.Outcome[Compacted]]


@dataclass(frozen=True, slots=True)
class Compacted:
    """WeightCache → control: what a compaction reloaded and the resident bytes after it."""

    reloaded: tuple[str, ...]
    resident_bytes: int


@dataclass(frozen=True, slots=True)
class SetResidency:
    """control → Dispatcher → WeightCache: give `model` the floor `floor` (unpinned, system or
    device; externally managed residency only); reply the new floor and whether it is on the
    device, or the error, on `reply_to`."""

    model: str
    floor: Residency
    reply_to: trio.MemorySendChannel[outcome.Outcome[tuple[Residency, bool]]]


@dataclass(frozen=True, slots=True)
class AddModel:
    """control → Dispatcher: start serving a newly compiled model from `queue`; a model of that
    name already served is replaced (its queue retired into the new one, its weights swapped).
    Replies None on `reply_to` once its weights are at their floor."""

    name: str
    compiled: CompiledModel
    policy: ModelPolicy
    queue: QueueAddress
    floor: Residency
    reply_to: trio.MemorySendChannel[outcome.Outcome[None]]


@dataclass(frozen=True, slots=True)
class RemoveModel:
    """control → Dispatcher: stop serving `name`: retire its queue, drop its weights; reply
    None on `reply_to` once done."""

    name: str
    reply_to: trio.MemorySendChannel[outcome.Outcome[None]]


@dataclass(frozen=True, slots=True)
class Retire:
    """Dispatcher → ModelQueue: stop; what is queued goes, in order, to `then` when it is a queue
    (the model's new version, with the same tensors), or is answered with `then`, an error
    (the model was unloaded, or reloaded with other tensors)."""

    then: QueueAddress | Exception


@dataclass(frozen=True, slots=True)
class AddWeights:
    """Dispatcher → WeightCache: take on a new model's weights at residency `floor`; reply None
    on `reply_to`, if given, once they are there."""

    name: str
    bundle: Bundle
    floor: Residency
    reply_to: trio.MemorySendChannel[outcome.Outcome[None]] | None = None


@dataclass(frozen=True, slots=True)
class DropWeights:
    """Dispatcher → WeightCache: forget a model, freeing its device buffers; reply None on
    `reply_to` if given."""

    name: str
    reply_to: trio.MemorySendChannel[outcome.Outcome[None]] | None = None


DispatcherMessage: TypeAlias = QueueSummary | SetPolicy | Compact | SetResidency | AddModel | RemoveModel
"""What the dispatcher's inbox takes."""
WeightCacheMessage: TypeAlias = Acquire | Prefetch | Compact | SetResidency | AddWeights | DropWeights
"""What the weight cache's inbox takes (all from the dispatcher)."""
