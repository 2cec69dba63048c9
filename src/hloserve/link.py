"""The link between a frontend process and the engine (docs/frontends.md, "The link").

One Unix stream socket per frontend carries frames: a `<IQ` header (payload length, request
id), then the message pickled. Both ends are processes of one worker started from one
installation over a socketpair nobody else holds, so the messages are trusted. Tensors never
travel in a frame: the frontend owns an arena (a `BufferPool` in POSIX shared memory), copies a
request's inputs into a slot once and names them by `TensorRef`; the engine maps the arena, queues
views of it and writes the outputs back into the region of the slot the frontend reserved.

`EngineLink` is the engine's actor for one frontend; `FrontendLink` is the frontend's end.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import pickle
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

import numpy as np
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve._status import to_grpc_error
from hloserve.actors.messages import Infer
from hloserve.buffer_pool import BufferPool, PoolSlot
from hloserve.errors import ModelNotFound, ModelNotReady

if TYPE_CHECKING:
    from hloserve.model_table import ModelEntry
    from hloserve.service import Execute

__all__ = [
    "FORWARD",
    "MAX_FRAME_BYTES",
    "Applied",
    "Call",
    "Counted",
    "EngineLink",
    "EngineServices",
    "Failed",
    "FrontendLink",
    "Hello",
    "Listening",
    "Ran",
    "Released",
    "Returned",
    "Run",
    "TableChanged",
    "TensorRef",
    "Withdraw",
    "execute_over",
]

HEADER = struct.Struct("<IQ")
MAX_FRAME_BYTES = 3 << 30
"""Largest payload: tensors are in the arena, so only a request forwarded whole (a meta model's,
bounded by `server.max_message_bytes`) or an output that did not fit comes near it."""
FORWARD = "model_infer"
"""The `Call` that forwards a whole ModelInfer to the engine (meta models, client regions)."""
_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor in the frontend's arena: `shape` of `dtype` at byte `offset`."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Hello:
    """frontend → engine, first frame: the arena to map (`/dev/shm` + `key`, `size` bytes)."""

    key: str
    size: int


@dataclass(frozen=True, slots=True)
class Listening:
    """frontend → engine: it listens on the public port (the engine is ready once all do)."""


@dataclass(frozen=True, slots=True)
class Run:
    """frontend → engine: execute `inputs` on `model`'s queue; write outputs into `out`
    (offset, bytes) of the arena. `timeout_s` is what remains of the client's deadline."""

    model: str
    inputs: list[TensorRef]
    rows: int
    outputs: list[int]
    timeout_s: float | None
    out: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Withdraw:
    """frontend → engine: the client of request `id` went away."""


@dataclass(frozen=True, slots=True)
class Counted:
    """frontend → engine, a notice: a ModelInfer call ended with `status` after `elapsed_s`
    (the engine's statistics and metrics count every frontend's calls)."""

    model: str
    status: str
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class Call:
    """frontend → engine: answer the engine's own `method` of the service for `message` (an
    RPC whose answer is the engine's, such as ModelStatistics)."""

    method: str
    message: object


@dataclass(frozen=True, slots=True)
class TableChanged:
    """engine → frontend, with an id of the engine's: `name`'s entry of the engine's model table
    is now `summary` (None: unloaded). The frontend applies it, then answers `Applied`."""

    name: str
    summary: object | None


@dataclass(frozen=True, slots=True)
class Applied:
    """frontend → engine: the `TableChanged` of this id is applied."""


@dataclass(frozen=True, slots=True)
class Returned:
    """engine → frontend: a `Call`'s answer."""

    value: object


@dataclass(frozen=True, slots=True)
class Ran:
    """engine → frontend: the outputs, each in the arena or (did not fit) inline."""

    outputs: list[TensorRef | np.ndarray]


@dataclass(frozen=True, slots=True)
class Failed:
    """engine → frontend: the gRPC status and message the request fails with (as with K=0)."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class Released:
    """engine → frontend: a withdrawn request was dropped; its slot is the frontend's again."""


def frame(ident: int, message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"link message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload), ident) + payload


@final
class FrameReader:
    """Frames from a stream, one at a time; None at the end of the stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def _fill(self, n: int) -> bool:
        while len(self._buffer) < n:
            chunk = await self._stream.receive_some(max(n - len(self._buffer), 1 << 16))
            if not chunk:
                return False
            self._buffer += chunk
        return True

    async def receive(self) -> tuple[int, Any] | None:
        if not await self._fill(HEADER.size):
            return None
        length, ident = HEADER.unpack_from(self._buffer)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"link frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        if not await self._fill(HEADER.size + length):
            return None
        payload = bytes(self._buffer[HEADER.size : HEADER.size + length])
        del self._buffer[: HEADER.size + length]
        return ident, pickle.loads(payload)


# -- the engine's end --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineServices:
    """What a link reaches of the engine beyond its queues: `count` a frontend's finished call
    (model, status, seconds), the service methods a `Call` may name (asyncio coroutines), and
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

    def _finish(self, event: object) -> None:
        if not self.finished:
            self.finished = True
            self.send.send_nowait((self, event))

    def set_result(self, result: Any, /) -> None:
        self._finish(result)

    def set_exception(self, exception: BaseException, /) -> None:
        self._finish(exception)

    def cancelled(self) -> bool:
        # Asked only where a request is about to be dropped unread: that is its release.
        if self.withdrawn:
            self._finish(Released())
        return self.withdrawn

    def done(self) -> bool:
        return self.finished


@final
class EngineLink:
    """The engine's actor for one frontend: a trio task reading its frames, turning `Run` into
    the `Infer` the in-process front end sends, and sending each request's one final frame.

    A withdrawn request is marked and left to its queue, which drops it unread when it reaches
    it (the reply's `cancelled()`), so the frontend reuses the slot only once nothing reads it.
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
        self._pending: dict[int, tuple[Infer, _LinkReply]] = {}
        self._calls: dict[int, trio.CancelScope] = {}
        self._forwarded = 0
        self._pushes: dict[int, trio.Event] = {}
        self._next_push = 1
        self._closed = False
        self._send, self._outbound = trio.open_memory_channel[tuple[_LinkReply, object] | bytes](math.inf)
        self._arena: np.ndarray | None = None
        self.arena_key: str | None = None
        """The frontend's arena (its `/dev/shm` name), once it said; the engine unlinks it if the
        frontend dies."""
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
                    self._on_message(*received)
                nursery.cancel_scope.cancel()
        finally:
            self.close_pushes()
            for _, reply in self._pending.values():
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
                    request = self._submit(message, reply)
                except Exception as e:
                    reply.set_exception(e)
                else:
                    self._pending[ident] = (request, reply)
            case Withdraw():
                if (pending := self._pending.get(ident)) is not None:
                    pending[1].withdrawn = True
                if (scope := self._calls.get(ident)) is not None:
                    scope.cancel()
            case Hello(key=key, size=size):
                self._arena, self.arena_key = _map_arena(key, size), key
            case Listening():
                self.listening.set()
            case Applied():
                if (done := self._pushes.pop(ident, None)) is not None:
                    done.set()
            case Counted(model=model, status=status, elapsed_s=elapsed_s) if self._services is not None:
                self._services.count(model, status, elapsed_s)
            case Call(method=method, message=argument) if self._services is not None:
                assert self._nursery is not None
                self._nursery.start_soon(self._call, ident, method, argument)
            case _:
                raise TypeError(f"link got an unknown message {message!r}")

    async def _call(self, ident: int, method: str, argument: object) -> None:
        """Answer a `Call`; a forwarded ModelInfer counts as in flight, and the frontend's
        `Withdraw` (its client went away) cancels it as a cancelled handler is at K=0."""
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

    def _submit(self, run: Run, reply: _LinkReply) -> Infer:
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
        try:
            entry.queue.submit_nowait(request)
        except BaseException:
            if self._services is not None:
                self._services.release(reply.ticket)
            raise
        return request

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
            await self._stream.send_all(b"".join(frames))

    def _final(self, reply: _LinkReply, event: object) -> bytes:
        try:
            return self._final_frame(reply, event)
        except ValueError as e:  # too large for a frame: said, not a dead link
            return frame(reply.ident, Failed(Status.RESOURCE_EXHAUSTED.value, str(e)))

    def _final_frame(self, reply: _LinkReply, event: object) -> bytes:
        if self._pending.pop(reply.ident, None) is not None and self._services is not None:
            self._services.release(reply.ticket)
        match event:
            case Released() | Returned():
                message: object = event
            case BaseException():
                error = to_grpc_error(event, "ModelInfer")  # type: ignore[arg-type]
                message = Failed(error.status.value, error.message or "")
            case list():
                message = Ran(self._write_outputs(event, reply.out))
            case _:
                raise TypeError(f"a link reply got {event!r}")
        return frame(reply.ident, message)

    def _write_outputs(self, outputs: list[np.ndarray], out: tuple[int, int]) -> list[TensorRef | np.ndarray]:
        """Copy each output into the reserved region while it fits; the rest travel inline."""
        written: list[TensorRef | np.ndarray] = []
        cursor, end = out[0], out[0] + out[1]
        for array in outputs:
            array = np.ascontiguousarray(array)
            cursor += -cursor % _ALIGNMENT
            if self._arena is None or cursor + array.nbytes > end:
                written.append(array)
                continue
            self._arena[cursor : cursor + array.nbytes] = array.reshape(-1).view(np.uint8)
            written.append(TensorRef(cursor, array.dtype.str, array.shape))
            cursor += array.nbytes
        return written


def _with_queued(first: bytes, queue: trio.MemoryReceiveChannel[bytes]) -> bytes:
    """`first` and every frame queued behind it, for one write (one system call, not one per
    frame, when requests arrive together)."""
    frames = [first]
    while True:
        try:
            frames.append(queue.receive_nowait())
        except trio.WouldBlock:
            return b"".join(frames) if len(frames) > 1 else first


def _map_arena(key: str, size: int) -> np.ndarray:
    fd = os.open(f"/dev/shm{key}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    finally:
        os.close(fd)


# -- the frontend's end ------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Waiting:
    slot: PoolSlot | None
    done: trio.Event = field(default_factory=trio.Event)
    answer: object = None
    future: asyncio.Future[list[np.ndarray]] | None = None
    """Set for a request from asyncio (`submit`): resolved when the answer comes."""
    left: bool = False
    """Its caller went away: the slot is released when the engine's final frame comes."""


@final
class FrontendLink:
    """A frontend's end of the link: `submit` (from asyncio, no trio task per request) or `infer`
    (from trio) stage inputs in the arena and send `Run`; `run` (a task) reads the engine's
    frames and sends what is queued, in order. A caller that leaves sends `Withdraw` and leaves
    its slot held until the engine says nothing reads it."""

    def __init__(self, stream: trio.SocketStream, arena: BufferPool) -> None:
        assert arena.key is not None, "the arena is shared memory the engine maps"
        self._stream = stream
        self._arena = arena
        self._waiting: dict[int, _Waiting] = {}
        self._next_id = 1
        self.closed = trio.Event()
        """Set when the engine's end is gone."""
        self._outbound, self._outbound_queue = trio.open_memory_channel[bytes](math.inf)
        self._pushed, self.pushes = trio.open_memory_channel[tuple[int, TableChanged]](math.inf)
        """The engine's `TableChanged` notices (with their ids), in order; answer each with
        `applied`."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert self._arena.key is not None
        try:
            await self._stream.send_all(frame(0, Hello(self._arena.key, self._arena.n_bytes)))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_queued)
                task_status.started()
                reader = FrameReader(self._stream)
                while (received := await reader.receive()) is not None:
                    self._on_final(*received)
                nursery.cancel_scope.cancel()
        finally:
            for waiting in self._waiting.values():
                self._answer(waiting, Failed(Status.UNAVAILABLE.value, "the engine closed the link"))
            self._waiting.clear()
            self.closed.set()
            await self._stream.aclose()

    async def _send_queued(self) -> None:
        async for data in self._outbound_queue:
            await self._stream.send_all(_with_queued(data, self._outbound_queue))

    def _post(self, ident: int, message: object) -> None:
        """Queue a frame; the sender writes frames whole and in order."""
        self._outbound.send_nowait(frame(ident, message))

    def notify(self, message: object) -> None:
        """Send a notice (no request of its own) without waiting."""
        self._post(0, message)

    async def announce(self, message: object) -> None:
        self.notify(message)
        await trio.lowlevel.checkpoint()

    def _new_id(self) -> int:
        ident, self._next_id = self._next_id, self._next_id + 1
        return ident

    def applied(self, ident: int) -> None:
        """Tell the engine its `TableChanged` `ident` is applied."""
        self._post(ident, Applied())

    async def call(self, method: str, message: object) -> object:
        """The engine's answer to its service's `method` for `message`; a caller that leaves
        withdraws the call."""
        if self.closed.is_set():
            raise GRPCError(Status.UNAVAILABLE, "the engine closed the link")
        ident = self._new_id()
        try:
            data = frame(ident, Call(method, message))
        except ValueError as e:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(e)) from None
        waiting = self._waiting[ident] = _Waiting(None)
        self._outbound.send_nowait(data)
        try:
            await waiting.done.wait()
        except BaseException:
            if self._waiting.pop(ident, None) is not None:
                self._post(ident, Withdraw())
            raise
        finally:
            self._waiting.pop(ident, None)
        match waiting.answer:
            case Returned(value=value):
                return value
            case Failed(status=status, message=text):
                raise GRPCError(Status(status), text)
            case other:
                raise TypeError(f"link answered {other!r}")

    def _on_final(self, ident: int, message: object) -> None:
        if isinstance(message, TableChanged):
            self._pushed.send_nowait((ident, message))
            return
        waiting = self._waiting.pop(ident, None)
        if waiting is None:
            return
        if waiting.left or isinstance(message, Released):
            if waiting.slot is not None:
                self._arena.release(waiting.slot)
            return
        self._answer(waiting, message)

    def _answer(self, waiting: _Waiting, message: object) -> None:
        waiting.answer = message
        waiting.done.set()
        future = waiting.future
        if future is None or future.done():
            return
        try:
            future.set_result(self._outputs(waiting))
        except Exception as e:
            future.set_exception(e)

    def _outputs(self, waiting: _Waiting) -> list[np.ndarray]:
        """The answer's outputs (copies; the slot is released here), or its error raised."""
        slot = waiting.slot
        assert slot is not None
        try:
            match waiting.answer:
                case Ran(outputs=results):
                    memory = self._arena.view(slot)
                    return [self._copy_out(r, memory, slot) for r in results]
                case Failed(status=status, message=message):
                    raise GRPCError(Status(status), message)
                case other:
                    raise TypeError(f"link answered {other!r}")
        finally:
            self._arena.release(slot)

    def _stage(
        self,
        slot: PoolSlot,
        model: str,
        inputs: list[np.ndarray],
        rows: int,
        outputs: list[int],
        timeout_s: float | None,
        out_nbytes: int,
    ) -> tuple[int, _Waiting]:
        specs = [(a.shape, a.dtype) for a in inputs] + [((out_nbytes,), np.uint8)]
        staged = self._arena.scratch(slot, specs)
        for target, source in zip(staged, inputs, strict=False):
            target[...] = source
        refs = [TensorRef(self._arena.array_offset(a), a.dtype.str, a.shape) for a in staged[:-1]]
        out = (self._arena.array_offset(staged[-1]), out_nbytes)
        ident = self._new_id()
        waiting = self._waiting[ident] = _Waiting(slot)
        self._post(ident, Run(model, refs, rows, outputs, timeout_s, out))
        return ident, waiting

    def _span(self, inputs: list[np.ndarray], out_nbytes: int) -> int:
        return self._arena.span_for([(a.shape, a.dtype) for a in inputs] + [((out_nbytes,), np.uint8)])

    def _leave(self, ident: int) -> None:
        """The caller of request `ident` went away: withdraw it; its slot waits for the engine."""
        waiting = self._waiting.get(ident)
        if waiting is not None:
            waiting.left = True
            self._post(ident, Withdraw())

    def submit(
        self,
        model: str,
        inputs: list[np.ndarray],
        rows: int,
        outputs: list[int],
        timeout_s: float | None,
        out_nbytes: int,
        future: asyncio.Future[list[np.ndarray]],
    ) -> bool:
        """Send a request whose answer resolves `future` (cancelling it withdraws the request);
        False, and nothing sent, when the arena has no room now (the caller waits with `infer`)."""
        if self.closed.is_set():
            raise GRPCError(Status.UNAVAILABLE, "the engine closed the link")
        slot = self._arena.try_acquire_slot(self._span(inputs, out_nbytes))
        if slot is None:
            return False
        ident, waiting = self._stage(slot, model, inputs, rows, outputs, timeout_s, out_nbytes)
        waiting.future = future
        future.add_done_callback(lambda f: self._leave(ident) if f.cancelled() else None)
        return True

    async def infer(
        self,
        model: str,
        inputs: list[np.ndarray],
        rows: int,
        outputs: list[int],
        timeout_s: float | None,
        out_nbytes: int,
    ) -> list[np.ndarray]:
        """Run `inputs` on the engine, waiting in line for room in the arena; the outputs are
        copies (the slot is reused at once)."""
        if self.closed.is_set():
            raise GRPCError(Status.UNAVAILABLE, "the engine closed the link")
        slot = await self._arena.acquire_slot(self._span(inputs, out_nbytes))
        ident, waiting = self._stage(slot, model, inputs, rows, outputs, timeout_s, out_nbytes)
        try:
            await waiting.done.wait()
        except BaseException:
            self._leave(ident)
            raise
        return self._outputs(waiting)

    @staticmethod
    def _copy_out(result: TensorRef | np.ndarray, memory: np.ndarray, slot: PoolSlot) -> np.ndarray:
        if isinstance(result, np.ndarray):
            return result
        start = result.offset - slot.offset
        return memory[start : start + result.nbytes].view(result.dtype).reshape(result.shape).copy()


def execute_over(link: FrontendLink) -> Execute:
    """`InferenceService`'s execute step for a frontend: the inputs go to the engine over `link`
    (from the service's asyncio handlers, with no trio task unless the arena is full), with room
    reserved for the outputs."""
    infer = trio_asyncio.trio_as_aio(link.infer)

    async def execute(
        entry: ModelEntry,
        inputs: list[Any],
        rows: int,
        outputs: list[int],
        deadline: float | None,
        now: float,
    ) -> list[Any]:
        assert entry.bundle is not None
        specs = entry.bundle.manifest.executable_outputs
        out_nbytes = sum(_nbytes_bound(specs[i], rows) for i in outputs)
        timeout_s = None if deadline is None else deadline - time.monotonic()
        arrays = [np.asarray(a) for a in inputs]
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        if link.submit(entry.name, arrays, rows, outputs, timeout_s, out_nbytes, future):
            return await future
        return list(await infer(entry.name, arrays, rows, outputs, timeout_s, out_nbytes))

    return execute


def _nbytes_bound(spec: Any, rows: int) -> int:
    """The bytes of an output of `rows` rows, aligned; 0 when its shape depends on the data (it
    then travels inline)."""
    try:
        shape = spec.wire_shape(rows)
    except ValueError:
        return 0
    return math.prod(shape) * spec.dtype.itemsize + _ALIGNMENT
