"""The engine's end of a frontend's link (`hloserve.frontends.protocol`): `EngineLink`, an actor
like the queues and the dispatcher, turns each `Run` into the `Infer` the engine's data plane
queues (`execute_on_queue`) and answers each request once; `EngineCall`s reach the engine's
planes (`hloserve.frontends.pool.engine_calls`), and `push` sends a frontend the changes of the
model table."""

from __future__ import annotations

import math
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import numpy as np
import trio
import trio_asyncio
from grpclib.const import Status

from hloserve.actors.messages import Infer, QueueAddress
from hloserve.api.status import to_grpc_error
from hloserve.errors import ModelNotFound, ModelNotReady
from hloserve.frontends.protocol import (
    ALIGNMENT,
    FORWARD,
    Applied,
    ArenaTensor,
    ClientLeft,
    Counted,
    EngineCall,
    Errored,
    FrameReader,
    Hello,
    Listening,
    Ran,
    Released,
    Returned,
    Run,
    frame,
    send_frames,
)

if TYPE_CHECKING:
    from hloserve.engine.model_table import ModelEntry
    from hloserve.engine.tracing import RequestSpans, Tracing

__all__ = ["EngineLink", "EngineServices"]


@dataclass(frozen=True, slots=True)
class EngineServices:
    """What a link reaches of the engine beyond its queues: `count` a frontend's finished call
    (model, status, seconds), the service methods an `EngineCall` may name (asyncio coroutines), and
    `admit`, which raises `Overloaded` when the worker holds `server.max_inflight_requests`
    requests from all its frontends together."""

    count: Callable[[str, str, float], None]
    calls: Mapping[str, Callable[[Any], Awaitable[Any]]]
    admit: Callable[[ModelEntry | None, int, float | None], object] = lambda entry, rows, deadline: None
    """Count a request in (a `Run` on `entry` of `rows` with a deadline, or with None a whole
    forwarded ModelInfer, which the engine's service admits itself) and return its ticket, or
    raise why not (`Overloaded`, `CannotMeetDeadline`)."""
    release: Callable[[object], None] = lambda ticket: None
    """Count a `Run`'s ticket out (answered, failed or dropped)."""
    tracing: Tracing | None = None
    """The engine's traces: a `Run` carrying a traceparent gets an `engine` span under it."""


@dataclass(eq=False, slots=True)
class _LinkReply:
    """The reply slot of an `Infer` from a frontend: its one final event (answered, failed, or
    found withdrawn and dropped) goes to the link's sender, once."""

    ident: int
    out: tuple[int, int]
    send: trio.MemorySendChannel[tuple[_LinkReply, object] | bytes]
    ticket: object = None
    """Its admission ticket, released with its final event."""
    withdrawn: bool = False
    finished: bool = False
    spans: RequestSpans | None = None
    """The engine's spans of a traced request, ended with its final event."""

    def _finish(self, event: object) -> None:
        if not self.finished:
            self.finished = True
            self.send.send_nowait((self, event))

    def set_result(self, result: object, /) -> None:
        self._finish(result)

    def set_exception(self, exception: BaseException, /) -> None:
        self._finish(exception)

    def cancelled(self) -> bool:
        # Asked only where a request is about to be dropped unread: that is its release.
        if self.withdrawn:
            self._finish(Released())
        return self.withdrawn

    def cancel(self) -> bool:
        """Its queue dropped it unread (withdrawn while it waited): the slot is the frontend's."""
        self._finish(Released())
        return True

    def done(self) -> bool:
        return self.finished


@final
class EngineLink:
    """The engine's actor for one frontend: a trio task reading its frames, turning `Run` into
    the `Infer` the engine's data plane queues, and sending each request's one final frame.

    A withdrawn request is marked and withdrawn from its queue, as at K=0. The queue drops it at
    once if it still waits (the reply's `cancel()`); one already taken for a batch is dropped
    unread where the dispatcher asks (its `cancelled()`). Either way the final frame says
    `Released` only once nothing reads its slot, which the frontend then reuses.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        models: Mapping[str, ModelEntry],
        services: EngineServices | None = None,
    ) -> None:
        self._stream = stream
        self._models = models
        self._services = services
        self._nursery: trio.Nursery | None = None
        self._pending: dict[int, tuple[Infer, _LinkReply, QueueAddress]] = {}
        self._calls: dict[int, trio.CancelScope] = {}
        self._forwarded = 0
        self._pushes: dict[int, trio.Event] = {}
        self._next_push = 1
        self._closed = False
        self._send, self._outbound = trio.open_memory_channel[tuple[_LinkReply, object] | bytes](math.inf)
        self._arena: np.ndarray | None = None
        self.listening = trio.Event()

    @property
    def inflight(self) -> int:
        """Requests of this frontend the engine holds: queued or running, and forwarded whole."""
        return len(self._pending) + self._forwarded

    def push(self, message: object) -> trio.Event:
        """Send the frontend `message` (after everything sent before it); the event is set once
        it answers `Applied`, or once the link is closed."""
        done = trio.Event()
        if self._closed:
            done.set()
            return done
        ident, self._next_push = self._next_push, self._next_push + 1
        self._pushes[ident] = done
        self._send.send_nowait(frame(ident, message))
        return done

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        reader = FrameReader(self._stream)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_finals, self._outbound)
                self._nursery = nursery
                task_status.started()
                while (received := await reader.receive()) is not None:
                    for ident, message in received:
                        self._on_message(ident, message)
                nursery.cancel_scope.cancel()
        finally:
            self.close_pushes()
            for _, reply, _ in self._pending.values():
                reply.withdrawn = True  # its frontend is gone: the queues drop them unread
                if self._services is not None:
                    self._services.release(reply.ticket)
            self._pending.clear()
            self._arena = None  # unmapped when the last view of it goes
            await self._stream.aclose()

    def close_pushes(self) -> None:
        """The frontend is gone (or never came): nothing pushed waits on it any more."""
        self._closed = True
        for done in self._pushes.values():
            done.set()
        self._pushes.clear()

    def _on_message(self, ident: int, message: object) -> None:
        match message:
            case Run():
                reply = _LinkReply(ident, message.out, self._send)
                try:
                    request, queue = self._submit(message, reply)
                except Exception as e:
                    reply.set_exception(e)
                else:
                    self._pending[ident] = (request, reply, queue)
            case ClientLeft():
                if (pending := self._pending.get(ident)) is not None:
                    request, reply, queue = pending
                    reply.withdrawn = True  # dropped unread by whoever holds it next
                    queue.withdraw_nowait(request)  # out of the queue now, as at K=0
                if (scope := self._calls.get(ident)) is not None:
                    scope.cancel()
            case Hello(key=key, size=size):
                self._arena = _map_arena(key, size)
            case Listening():
                self.listening.set()
            case Applied():
                if (done := self._pushes.pop(ident, None)) is not None:
                    done.set()
            case Counted(calls=calls) if self._services is not None:
                for model, status, elapsed_s in calls:
                    self._services.count(model, status, elapsed_s)
            case EngineCall(method=method, message=argument) if self._services is not None:
                assert self._nursery is not None
                self._nursery.start_soon(self._call, ident, method, argument)
            case _:
                raise TypeError(f"link got an unknown message {message!r}")

    async def _call(self, ident: int, method: str, argument: object) -> None:
        """Answer an `EngineCall`; a forwarded ModelInfer counts as in flight, and the frontend's
        `ClientLeft` (its client went away) cancels it as a cancelled handler is at K=0."""
        assert self._services is not None
        reply = _LinkReply(ident, (0, 0), self._send)
        forwarded = method == FORWARD
        with trio.CancelScope() as scope:
            self._calls[ident] = scope
            try:
                if forwarded:
                    self._services.admit(None, 0, None)
                    self._forwarded += 1
                try:
                    handler = self._services.calls[method]
                    reply.set_result(Returned(await trio_asyncio.aio_as_trio(handler)(argument)))
                finally:
                    self._forwarded -= forwarded
            except Exception as e:
                reply.set_exception(e)
            finally:
                del self._calls[ident]

    def _submit(self, run: Run, reply: _LinkReply) -> tuple[Infer, QueueAddress]:
        entry = self._models.get(run.model)
        if entry is None:
            raise ModelNotFound(run.model, f"serving {sorted(self._models)}")
        if not entry.ready or entry.queue is None:
            raise ModelNotReady(run.model, entry.error or "not loaded")
        assert self._arena is not None, "a frontend sends Hello before Run"
        arena = self._arena
        inputs = [arena[t.offset : t.offset + t.nbytes].view(t.dtype).reshape(t.shape) for t in run.inputs]
        now = time.monotonic()
        deadline = None if run.timeout_s is None else now + run.timeout_s
        if self._services is not None:
            reply.ticket = self._services.admit(entry, run.rows, deadline)
        request = Infer(run.model, inputs, run.rows, run.outputs, reply, now, deadline)
        if run.traceparent and self._services is not None and self._services.tracing is not None:
            spans = reply.spans = self._services.tracing.engine_request(run.model, run.traceparent)
            request.trace = spans.engine
        try:
            entry.queue.submit_nowait(request)
        except BaseException:
            if self._services is not None:
                self._services.release(reply.ticket)
            raise
        return request, entry.queue

    async def _send_finals(
        self, receive: trio.MemoryReceiveChannel[tuple[_LinkReply, object] | bytes]
    ) -> None:
        """Each request's final frame and each push; those ready together go in one write."""
        async for first in receive:
            frames = [self._final(*first) if isinstance(first, tuple) else first]
            while True:
                try:
                    item = receive.receive_nowait()
                except trio.WouldBlock:
                    break
                frames.append(self._final(*item) if isinstance(item, tuple) else item)
            await send_frames(self._stream, b"".join(frames))

    def _final(self, reply: _LinkReply, event: object) -> bytes:
        try:
            return self._final_frame(reply, event)
        except ValueError as e:  # too large for a frame: said, not a dead link
            return frame(reply.ident, Errored(Status.RESOURCE_EXHAUSTED.value, str(e)))

    def _final_frame(self, reply: _LinkReply, event: object) -> bytes:
        if self._pending.pop(reply.ident, None) is not None and self._services is not None:
            self._services.release(reply.ticket)
        if reply.spans is not None:
            reply.spans.record_engine()
            reply.spans.end(_status_name(event))
        match event:
            case Released() | Returned():
                message: object = event
            case BaseException():
                error = to_grpc_error(event, "ModelInfer")  # type: ignore[arg-type]
                message = Errored(error.status.value, error.message or "")
            case list():
                message = Ran(self._write_outputs(event, reply.out))
            case _:
                raise TypeError(f"a link reply got {event!r}")
        return frame(reply.ident, message)

    def _write_outputs(
        self, outputs: list[np.ndarray], out: tuple[int, int]
    ) -> list[ArenaTensor | np.ndarray]:
        """Copy each output into the reserved region while it fits; the rest travel inline."""
        written: list[ArenaTensor | np.ndarray] = []
        cursor, end = out[0], out[0] + out[1]
        for array in outputs:
            array = np.ascontiguousarray(array)
            cursor += -cursor % ALIGNMENT
            if self._arena is None or cursor + array.nbytes > end:
                written.append(array)
                continue
            self._arena[cursor : cursor + array.nbytes] = array.reshape(-1).view(np.uint8)
            written.append((cursor, array.dtype.str, array.shape))
            cursor += array.nbytes
        return written


def _status_name(event: object) -> str:
    """The gRPC status name a final event stands for (a traced request's)."""
    if isinstance(event, Released):
        return "CANCELLED"
    if isinstance(event, Exception):
        return to_grpc_error(event, "ModelInfer").status.name
    return "OK"


def _map_arena(key: str, size: int) -> np.ndarray:
    """Map the frontend's arena and unlink its name: the memory lives while either process maps
    it, and nothing is left in /dev/shm whichever of them dies, however."""
    path = f"/dev/shm{key}"
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
