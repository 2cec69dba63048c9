"""A frontend's end of its link (`hloserve.frontends.protocol`): `FrontendLink` stages a request's inputs in
the frontend's arena, sends `Run` and hands back the engine's answer; `execute_over` is the
service's execute step over it."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import numpy as np
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve.engine.buffer_pool import BufferPool, PoolSlot
from hloserve.frontends.protocol import (
    ALIGNMENT,
    Applied,
    ArenaTensor,
    ClientLeft,
    Counted,
    EngineCall,
    Errored,
    FrameReader,
    Hello,
    Ran,
    Released,
    Returned,
    Run,
    TableChanged,
    TensorRef,
    frame,
    send_frames,
)

if TYPE_CHECKING:
    from hloserve.api.data_plane import Execute, Job
    from hloserve.engine.model_table import ModelEntry
    from hloserve.models.manifest import TensorSpec

__all__ = ["FrontendLink", "execute_over"]


@dataclass(eq=False, slots=True)
class _Waiting:
    slot: PoolSlot | None
    done: trio.Event | None = None
    """Set for a caller in trio (`infer`, `call`): set when the answer comes."""
    future: asyncio.Future[list[np.ndarray]] | None = None
    """Set for a caller in asyncio (`submit`): resolved with the outputs when the answer comes."""
    answer: object = None
    left: bool = False
    """Its caller went away: the slot is released when the engine's final frame comes."""


@final
class FrontendLink:
    """A frontend's end of the link: `submit` (from asyncio, no trio task per request) or `infer`
    (from trio) stage inputs in the arena and send `Run`; `run` (a task) reads the engine's
    frames and sends what is queued, in order. A caller that leaves sends `ClientLeft` and leaves
    its slot held until the engine says nothing reads it."""

    def __init__(self, stream: trio.SocketStream, arena: BufferPool) -> None:
        assert arena.key is not None, "the arena is shared memory the engine maps"
        self._stream = stream
        self._arena = arena
        self._memory = arena.memory()
        self._waiting: dict[int, _Waiting] = {}
        self._next_id = 1
        self.closed = trio.Event()
        """Set when the engine's end is gone."""
        self._outbound, self._outbound_queue = trio.open_memory_channel[bytes](math.inf)
        self._counted: list[tuple[str, str, float]] = []
        """Calls counted since the last write; an empty frame in the queue marks where they go."""
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
                    for ident, message in received:
                        self._on_final(ident, message)
                nursery.cancel_scope.cancel()
        finally:
            for waiting in self._waiting.values():
                self._answer(waiting, Errored(Status.UNAVAILABLE.value, "the engine closed the link"))
            self._waiting.clear()
            self.closed.set()
            await self._stream.aclose()

    async def _send_queued(self) -> None:
        """Write every frame queued, in one system call when requests come together."""
        async for first in self._outbound_queue:
            frames = [first]
            while True:
                try:
                    frames.append(self._outbound_queue.receive_nowait())
                except trio.WouldBlock:
                    break
            await send_frames(self._stream, b"".join(data or self._counts() for data in frames))

    def _counts(self) -> bytes:
        counted, self._counted = self._counted, []
        return frame(0, Counted(counted))

    def _post(self, ident: int, message: object) -> None:
        """Queue a frame; the sender writes frames whole and in order."""
        self._outbound.send_nowait(frame(ident, message))

    def notify(self, message: object) -> None:
        """Send a notice (no request of its own) without waiting."""
        self._post(0, message)

    def count(self, model: str, status: str, elapsed_s: float) -> None:
        """Tell the engine a ModelInfer call ended (sent with the next write, in one `Counted` with
        every call counted before it: no frame of its own per request)."""
        if not self._counted:
            self._outbound.send_nowait(b"")
        self._counted.append((model, status, elapsed_s))

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
            data = frame(ident, EngineCall(method, message))
        except ValueError as e:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(e)) from None
        done = trio.Event()
        waiting = self._waiting[ident] = _Waiting(None, done)
        self._outbound.send_nowait(data)
        try:
            await done.wait()
        except BaseException:
            if self._waiting.pop(ident, None) is not None:
                self._post(ident, ClientLeft())
            raise
        finally:
            self._waiting.pop(ident, None)
        match waiting.answer:
            case Returned(value=value):
                return value
            case Errored(status=status, message=text):
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
        """Hand the answer to its caller, who reads the outputs and releases the slot; a future
        already cancelled has nobody to read it (its caller has not yet said it left, and `leave`
        finds nothing once the answer is in), so the slot is released here."""
        waiting.answer = message
        if waiting.done is not None:
            waiting.done.set()
        future = waiting.future
        if future is None:
            return
        if future.done():
            if waiting.slot is not None:
                self._arena.release(waiting.slot)
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
                    return [self._copy_out(r) for r in results]
                case Errored(status=status, message=message):
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
        traceparent: str = "",
    ) -> tuple[int, _Waiting]:
        """Copy the inputs into the slot, each aligned, then reserve `out_nbytes` for the outputs
        (the layout `_span` bounds), and send `Run`."""
        memory, refs, cursor = self._memory, [], slot.offset
        for array in inputs:
            cursor += -cursor % ALIGNMENT
            if array.nbytes:
                memory[cursor : cursor + array.nbytes] = _bytes_of(array)
            refs.append(TensorRef(cursor, array.dtype.str, array.shape))
            cursor += array.nbytes
        cursor += -cursor % ALIGNMENT
        ident = self._new_id()
        waiting = self._waiting[ident] = _Waiting(slot)
        self._post(ident, Run(model, refs, rows, outputs, timeout_s, (cursor, out_nbytes), traceparent))
        return ident, waiting

    def _span(self, inputs: list[np.ndarray], out_nbytes: int) -> int:
        nbytes = out_nbytes
        for array in inputs:
            nbytes += array.nbytes + ALIGNMENT
        return max(1, -(-nbytes // self._arena.slot_bytes))

    def leave(self, ident: int) -> None:
        """The caller of request `ident` went away: withdraw it; its slot waits for the engine."""
        waiting = self._waiting.get(ident)
        if waiting is not None:
            waiting.left = True
            self._post(ident, ClientLeft())

    def submit(
        self,
        model: str,
        inputs: list[np.ndarray],
        rows: int,
        outputs: list[int],
        timeout_s: float | None,
        out_nbytes: int,
        future: asyncio.Future[list[np.ndarray]],
        traceparent: str = "",
    ) -> int | None:
        """Send a request whose answer resolves `future`, and return its id (a caller that
        leaves calls `leave` with it); None, and nothing sent, when the arena has no room now
        (the caller waits with `infer`)."""
        if self.closed.is_set():
            raise GRPCError(Status.UNAVAILABLE, "the engine closed the link")
        slot = self._arena.try_acquire_slot(self._span(inputs, out_nbytes))
        if slot is None:
            return None
        ident, waiting = self._stage(slot, model, inputs, rows, outputs, timeout_s, out_nbytes, traceparent)
        waiting.future = future
        return ident

    async def infer(
        self,
        model: str,
        inputs: list[np.ndarray],
        rows: int,
        outputs: list[int],
        timeout_s: float | None,
        out_nbytes: int,
        traceparent: str = "",
    ) -> list[np.ndarray]:
        """Run `inputs` on the engine, waiting in line for room in the arena; the outputs are
        copies (the slot is reused at once)."""
        if self.closed.is_set():
            raise GRPCError(Status.UNAVAILABLE, "the engine closed the link")
        slot = await self._arena.acquire_slot(self._span(inputs, out_nbytes))
        ident, waiting = self._stage(slot, model, inputs, rows, outputs, timeout_s, out_nbytes, traceparent)
        waiting.done = done = trio.Event()
        try:
            await done.wait()
        except BaseException:
            self.leave(ident)
            raise
        return self._outputs(waiting)

    def _copy_out(self, result: ArenaTensor | np.ndarray) -> np.ndarray:
        if isinstance(result, np.ndarray):
            return result
        offset, dtype, shape = result
        count = math.prod(shape)
        return np.frombuffer(self._memory, dtype, count, offset).reshape(shape).copy()


def execute_over(link: FrontendLink) -> Execute:
    """the data plane's execute step in a frontend: the inputs go to the engine over `link`
    (from the service's asyncio handlers, with no trio task unless the arena is full), with room
    reserved for the outputs."""
    infer = trio_asyncio.trio_as_aio(link.infer)

    async def execute(entry: ModelEntry, job: Job) -> list[np.ndarray]:
        spans = job.spans
        if spans is not None:
            span, traceparent = spans.link_span()
            try:
                return await over_link(entry, job, traceparent)
            finally:
                span.end()
                spans.skip()
        return await over_link(entry, job, "")

    async def over_link(entry: ModelEntry, job: Job, traceparent: str) -> list[np.ndarray]:
        rows, outputs, deadline = job.rows, job.outputs, job.deadline
        assert entry.bundle is not None
        specs = entry.bundle.manifest.executable_outputs
        out_nbytes = sum(_nbytes_bound(specs[i], rows) for i in outputs)
        timeout_s = None if deadline is None else deadline - time.monotonic()
        arrays = [np.asarray(a) for a in job.inputs]
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        ident = link.submit(entry.name, arrays, rows, outputs, timeout_s, out_nbytes, future, traceparent)
        if ident is None:
            return list(await infer(entry.name, arrays, rows, outputs, timeout_s, out_nbytes, traceparent))
        try:
            return await future
        except asyncio.CancelledError:  # the client cancelled or went away (as `infer` does)
            link.leave(ident)
            raise

    return execute


def _bytes_of(array: np.ndarray) -> memoryview:
    """`array`'s bytes in C order, to assign to a byte slice: cast by Python's buffer protocol
    when it can (cheapest), else through numpy (a dtype the protocol cannot name, a strided
    array)."""
    try:
        return array.data.cast("B")
    except (TypeError, ValueError):
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _nbytes_bound(spec: TensorSpec, rows: int) -> int:
    """The bytes of an output of `rows` rows, aligned; 0 when its shape depends on the data (it
    then travels inline)."""
    try:
        shape = spec.wire_shape(rows)
    except ValueError:
        return 0
    return int(math.prod(shape) * spec.dtype.itemsize) + ALIGNMENT
