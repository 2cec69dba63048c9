"""The link between a frontend process and the engine: its messages and frames (docs/frontends.md,
"The link").

One Unix stream socket per frontend carries frames: a `<IQ` header (payload length, request
id), then the message pickled (those of every request, `Run`, `Ran` and `Counted`, as plain
tuples, which pickle in a fourth of a dataclass's time). Both ends are processes of one worker
started from one installation over a socketpair nobody else holds, so the messages are trusted.
Tensors never travel in a frame: the frontend owns an arena (a `BufferPool` in POSIX shared
memory), copies a request's inputs into a slot once and names them by `TensorRef`; the engine
maps the arena, queues views of it and writes the outputs back into the region of the slot the
frontend reserved.

The ends: `hloserve.frontends.engine_link.EngineLink` (the engine's actor for one frontend) and
`hloserve.frontends.frontend_link.FrontendLink` (the frontend's).
"""

from __future__ import annotations

import math
import os
import pickle
import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, final

import numpy as np
import trio

if TYPE_CHECKING:
    from hloserve.config import Config, ModelSettings
    from hloserve.models.bundle import Bundle

__all__ = [
    "ALIGNMENT",
    "ARENA_PREFIX",
    "FORWARD",
    "HEADER",
    "MAX_FRAME_BYTES",
    "Applied",
    "ArenaTensor",
    "ClientLeft",
    "Counted",
    "EngineCall",
    "EngineCalls",
    "Errored",
    "FrameReader",
    "Hello",
    "Listening",
    "ModelSummary",
    "Ran",
    "Released",
    "Returned",
    "Run",
    "Setup",
    "TableChanged",
    "TensorRef",
    "frame",
]

HEADER = struct.Struct("<IQ")
MAX_FRAME_BYTES = 3 << 30
"""Largest payload: tensors are in the arena, so only a request forwarded whole (a meta model's,
bounded by `server.max_message_bytes`) or an output that did not fit comes near it."""
FORWARD = "model_infer"
"""The `EngineCall` that forwards a whole ModelInfer to the engine (meta models, client regions)."""


class EngineCalls(StrEnum):
    """What else an `EngineCall` may name: what only the engine answers, each one method of one of
    its planes (`hloserve.frontends.pool.engine_calls` maps each)."""

    MODEL_READY = "data.model_ready"
    """`DataPlane.model_ready` for `(name, version)` (residency managed outside: the engine knows)."""
    STATISTICS = "model.statistics"
    INDEX = "repository.index"
    LOAD = "repository.load"
    UNLOAD = "repository.unload"
    REGISTER_REGION = "repository.register_region"
    REGION_STATUS = "repository.region_status"
    UNREGISTER_REGION = "repository.unregister_region"
    CONTROL_STATUS = "control.status"
    SET_RESIDENCY = "control.set_residency"
    SET_POLICY = "control.set_policy"
    COMPACT_MEMORY = "control.compact"


ALIGNMENT = 64
"""Where tensors start in the arena (and outputs in a slot's reserved region)."""
ARENA_PREFIX = "hloserve-f"
"""An arena's /dev/shm name: this, the frontend's index, its pid and a random token. The engine
unlinks it once mapped (`hloserve.frontends.engine_link`)."""


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """What a frontend needs of one engine model: the bundle the engine serves (manifest and
    file paths, no weights), how it is compiled, its load settings, or why it failed."""

    name: str
    bundle: Bundle | None
    error: str | None
    batch_sizes: tuple[int, ...]
    coalescable: bool
    settings: ModelSettings | None


@dataclass(frozen=True, slots=True)
class Setup:
    """engine → frontend, on stdin: the configuration, the model table, and the platform the
    engine's device is (a frontend never initialises a device of its own)."""

    config: Config
    models: tuple[ModelSummary, ...]
    index: int
    platform: str


class TensorRef(NamedTuple):
    """A tensor in the frontend's arena: `shape` of `dtype` at byte `offset`."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


ArenaTensor = tuple[int, str, tuple[int, ...]]
"""An output in the arena: a `TensorRef`'s fields as a plain tuple, which is what it is on the
wire (no object to build at either end)."""


@dataclass(frozen=True, slots=True)
class Hello:
    """frontend → engine, first frame: the arena to map (`/dev/shm` + `key`, `size` bytes)."""

    key: str
    size: int


@dataclass(frozen=True, slots=True)
class Listening:
    """frontend → engine: it listens on the public port (the engine is ready once all do)."""


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs more, once a request
class Run:
    """frontend → engine: execute `inputs` on `model`'s queue; write outputs into `out`
    (offset, bytes) of the arena. `timeout_s` is what remains of the client's deadline."""

    model: str
    inputs: list[TensorRef]
    rows: int
    outputs: list[int]
    timeout_s: float | None
    out: tuple[int, int]
    traceparent: str = ""
    """The W3C traceparent of the frontend's `link` span ("": the request is not traced)."""


@dataclass(frozen=True, slots=True)
class ClientLeft:
    """frontend → engine: the client of request `id` went away."""


@dataclass(frozen=True, slots=True)
class Counted:
    """frontend → engine, a notice: ModelInfer calls ended, each (model, status, elapsed_s)
    (the engine's statistics and metrics count every frontend's calls); one notice carries those
    that ended since the frontend last wrote."""

    calls: list[tuple[str, str, float]]


@dataclass(frozen=True, slots=True)
class EngineCall:
    """frontend → engine: answer `method` (`FORWARD` or one of `EngineCalls`) of the engine's for
    `message` (an RPC whose answer is the engine's, such as ModelStatistics)."""

    method: str
    message: object


@dataclass(frozen=True, slots=True)
class TableChanged:
    """engine → frontend, with an id of the engine's: `name`'s entry of the engine's model table
    is now `summary` (None: unloaded). The frontend applies it, then answers `Applied`."""

    name: str
    summary: ModelSummary | None


@dataclass(frozen=True, slots=True)
class Applied:
    """frontend → engine: the `TableChanged` of this id is applied."""


@dataclass(frozen=True, slots=True)
class Returned:
    """engine → frontend: an `EngineCall`'s answer."""

    value: object


@dataclass(frozen=True, slots=True)
class Ran:
    """engine → frontend: the outputs, each in the arena or (did not fit) inline."""

    outputs: list[ArenaTensor | np.ndarray]


@dataclass(frozen=True, slots=True)
class Errored:
    """engine → frontend: the gRPC status and message the request fails with (as with K=0)."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class Released:
    """engine → frontend: a withdrawn request was dropped; its slot is the frontend's again."""


_RUN, _RAN, _COUNTED = 0, 1, 2


def _encode(message: object) -> object:
    if isinstance(message, Run):
        inputs = [tuple(t) for t in message.inputs]
        return (
            _RUN,
            message.model,
            inputs,
            message.rows,
            message.outputs,
            message.timeout_s,
            message.out,
            message.traceparent,
        )
    if isinstance(message, Ran):
        return (_RAN, message.outputs)
    if isinstance(message, Counted):
        return (_COUNTED, message.calls)
    return message


def _decode(wire: object) -> object:
    if type(wire) is not tuple:
        return wire
    if wire[0] == _RUN:
        _, model, inputs, rows, outputs, timeout_s, out, traceparent = wire
        return Run(model, [TensorRef(*t) for t in inputs], rows, outputs, timeout_s, out, traceparent)
    if wire[0] == _RAN:
        return Ran(wire[1])
    return Counted(wire[1])


def frame(ident: int, message: object) -> bytes:
    payload = pickle.dumps(_encode(message), protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"link message of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload), ident) + payload


async def send_frames(stream: trio.SocketStream, data: bytes) -> None:
    """Write `data` whole: at once when the socket takes it all, as it nearly always does (trio's
    `send_all` would pass through its scheduler twice, once a write of a link's frames), the
    rest with `send_all`. Only one task writes a link's socket."""
    try:
        sent = os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])


@final
class FrameReader:
    """Frames from a socket, as many as each read completes; None at the end of the stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._socket = stream.socket
        self._buffer = bytearray()
        self._wanted = HEADER.size
        """Bytes the buffer must hold before the next frame is complete."""

    async def receive(self) -> list[tuple[int, Any]] | None:
        """The frames the buffer holds once one is complete, in order (a read of many costs one
        wakeup, not one each). Reads what the socket holds without trio's two scheduler passes a
        `receive_some` costs, and passes through the scheduler once either way (waiting for
        data, or at a checkpoint)."""
        waited = False
        while len(self._buffer) < self._wanted:
            try:
                chunk = os.read(self._socket.fileno(), max(self._wanted - len(self._buffer), 1 << 16))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._socket)
                waited = True
                continue
            if not chunk:
                return None
            self._buffer += chunk
            self._wanted = self._needed()
        if not waited:
            await trio.lowlevel.checkpoint()  # a reader always fed still lets other tasks run
        frames, buffer, start = [], self._buffer, 0
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while len(buffer) - start >= HEADER.size:
                length, ident = HEADER.unpack_from(buffer, start)
                end = start + HEADER.size + length
                if end > len(buffer):
                    break
                frames.append((ident, _decode(pickle.loads(view[start + HEADER.size : end]))))
                start = end
        del buffer[:start]
        self._wanted = self._needed()
        return frames

    def _needed(self) -> int:
        """The buffer's length once its first frame is complete (checked against the bound)."""
        if len(self._buffer) < HEADER.size:
            return HEADER.size
        length: int = HEADER.unpack_from(self._buffer)[0]
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"link frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        return HEADER.size + length
