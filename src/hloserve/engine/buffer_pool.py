"""A staging pool for tensors: fixed-size slots in one region, shared memory or plain memory.

A client stages request tensors in a slot, has the server read them from shared memory, and
reuses the slot for the next request. `acquire_slot(span)` hands out `span` physically
contiguous slots as one, to waiters in arrival order (a later small request never overtakes an
earlier large one), with an optional deadline; `release` frees the whole run; `scratch` carves
typed arrays out of a slot in one call, aliasing the pool (zero copy). A shared-memory pool is
a POSIX object the server can map (register `pool.key`); an inline pool (`use_shm=False`) is
the fallback when client and server do not share a machine.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import final

import numpy as np
import trio
from numpy.typing import DTypeLike

from hloserve.errors import HloserveError

__all__ = ["BufferPool", "PoolAcquireTimeout", "PoolSlot", "PoolStatistics"]

_ALIGNMENT = 64


class PoolAcquireTimeout(HloserveError):
    """No run of `span` free slots came up before the deadline; the waiter has left the line."""

    def __init__(self, span: int, waited_s: float) -> None:
        self.span, self.waited_s = span, waited_s
        super().__init__(f"no {span} contiguous free slot(s) within {waited_s * 1e3:.1f} ms")


@final
@dataclass(eq=False, slots=True)
class PoolSlot:
    """A run of `span` slots from `index`: bytes [offset, offset + nbytes) of the pool."""

    index: int
    span: int
    offset: int
    nbytes: int
    cursor: int = 0
    """Bytes of the slot already carved by `scratch`."""


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    free_slots: int
    """Slots not in any acquired run."""
    acquired: int
    """Runs handed out and not yet released."""
    waiting: int
    """Callers waiting for a run."""


@dataclass(eq=False, slots=True)
class _Waiter:
    span: int
    granted: trio.Event = field(default_factory=trio.Event)
    slot: PoolSlot | None = None


@final
class BufferPool:
    """`n_bytes` split into `n_slots` equal slots; see the module docstring."""

    def __init__(
        self, n_bytes: int, n_slots: int = 8, use_shm: bool = True, name: str = "hloserve_pool"
    ) -> None:
        if n_slots < 1 or n_bytes < n_slots:
            raise ValueError(
                f"need n_slots >= 1 and n_bytes >= n_slots, got {n_bytes} bytes in {n_slots} slots"
            )
        self.n_slots = n_slots
        self.slot_bytes = n_bytes // n_slots
        self.n_bytes = self.slot_bytes * n_slots
        self.key: str | None = None
        self._map: mmap.mmap | None = None
        if use_shm:
            self.key = f"/{name}-{os.getpid()}-{secrets.token_hex(8)}"
            fd = os.open(f"/dev/shm{self.key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.n_bytes)
                self._map = mmap.mmap(fd, self.n_bytes)
            finally:
                os.close(fd)
            self._memory = np.frombuffer(self._map, dtype=np.uint8)
        else:
            self._memory = np.zeros(self.n_bytes, dtype=np.uint8)
        self._free = [True] * n_slots
        self._acquired = 0
        self._waiters: deque[_Waiter] = deque()

    # -- slots ---------------------------------------------------------------------------------

    def _find(self, span: int) -> int | None:
        if span == 1:  # the common case, found at C speed
            try:
                return self._free.index(True)
            except ValueError:
                return None
        run = 0
        for i, free in enumerate(self._free):
            run = run + 1 if free else 0
            if run == span:
                return i - span + 1
        return None

    def _take(self, index: int, span: int) -> PoolSlot:
        self._free[index : index + span] = [False] * span
        self._acquired += 1
        return PoolSlot(index, span, index * self.slot_bytes, span * self.slot_bytes)

    def _grant_waiters(self) -> None:
        """Serve waiters in order; the first one that cannot be served holds the line."""
        while self._waiters:
            waiter = self._waiters[0]
            index = self._find(waiter.span)
            if index is None:
                return
            waiter.slot = self._take(index, waiter.span)
            self._waiters.popleft()
            waiter.granted.set()

    async def acquire_slot(self, span: int = 1, deadline: float | None = None) -> PoolSlot:
        """`span` contiguous slots; waits in line until free or until `deadline` (trio time).

        Raises ValueError at once for a span the pool can never hold, PoolAcquireTimeout at the
        deadline (the waiter has left the line).
        """
        if not 1 <= span <= self.n_slots:
            raise ValueError(f"span {span} must be between 1 and the pool's {self.n_slots} slots")
        await trio.lowlevel.checkpoint_if_cancelled()
        if (slot := self.try_acquire_slot(span)) is not None:
            return slot
        waiter = _Waiter(span)
        self._waiters.append(waiter)
        started = trio.current_time()
        try:
            with trio.move_on_at(deadline if deadline is not None else float("inf")):
                await waiter.granted.wait()
        except BaseException:
            if waiter.slot is not None:  # granted, then cancelled: give it back
                self.release(waiter.slot)
            raise
        finally:
            if waiter.slot is None and waiter in self._waiters:
                self._waiters.remove(waiter)
                self._grant_waiters()  # the line may move now that this waiter left it
        if waiter.slot is None:
            raise PoolAcquireTimeout(span, trio.current_time() - started)
        return waiter.slot

    def try_acquire_slot(self, span: int = 1) -> PoolSlot | None:
        """`span` contiguous slots if they are free now and nobody waits in line, else None
        (for a caller outside trio, which cannot wait in line)."""
        if self._waiters:
            return None
        index = self._find(span)
        return None if index is None else self._take(index, span)

    def release(self, slot: PoolSlot) -> None:
        """Free every slot of the run; RuntimeError if any of them is already free."""
        end = slot.index + slot.span
        if True in self._free[slot.index : end]:
            raise RuntimeError(f"slot run {slot.index}..{end - 1} released twice")
        self._free[slot.index : end] = [True] * slot.span
        self._acquired -= 1
        self._grant_waiters()

    # -- memory --------------------------------------------------------------------------------

    def memory(self) -> memoryview:
        """The whole pool's bytes, addressed by `PoolSlot.offset` (slicing a memoryview costs less
        than slicing an array, once a request)."""
        return self._memory.data

    def scratch(
        self, slot: PoolSlot, specs: Sequence[tuple[Sequence[int] | int, DTypeLike]]
    ) -> list[np.ndarray]:
        """Typed arrays carved from the slot in one call: disjoint, 64-byte aligned, aliasing it.

        `specs` are `(shape, dtype)` pairs. Returns the arrays; write into them directly. Each
        array's byte offset in the pool is `array_offset(array)`.
        """
        arrays, cursor = [], slot.cursor
        for shape, dtype in specs:
            dims = (shape,) if isinstance(shape, int) else tuple(shape)
            dt = np.dtype(dtype)
            cursor += -cursor % _ALIGNMENT
            size = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
            if cursor + size > slot.nbytes:
                raise ValueError(f"{list(specs)} need more than the slot's {slot.nbytes} bytes")
            start = slot.offset + cursor
            arrays.append(self._memory[start : start + size].view(dt).reshape(dims))
            cursor += size
        slot.cursor = cursor
        return arrays

    def span_for(self, specs: Sequence[tuple[Sequence[int] | int, DTypeLike]]) -> int:
        """Enough contiguous slots for `scratch` to carve `specs` ((shape, dtype) pairs): each
        array is counted with a whole alignment pad, so this is a bound, not the exact fit."""
        nbytes: int = sum(
            int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + _ALIGNMENT
            for shape, dtype in specs
        )
        return max(1, -(-nbytes // self.slot_bytes))

    def array_offset(self, array: np.ndarray) -> int:
        """The byte offset in the pool of an array carved by `scratch`."""
        return int(array.ctypes.data - self._memory.ctypes.data)

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(sum(self._free), self._acquired, len(self._waiters))

    def close(self) -> None:
        """Unlink the shared-memory object (its name disappears at once) and unmap it."""
        if self.key is not None:
            try:
                os.unlink(f"/dev/shm{self.key}")
            except FileNotFoundError:
                pass
            self.key = None
        if self._map is not None:
            self._memory = np.zeros(0, dtype=np.uint8)
            try:
                self._map.close()
            except BufferError:  # arrays from scratch still alias it; it goes when they do
                pass
            self._map = None

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<BufferPool {self.key or 'inline'} {s.free_slots}/{self.n_slots} free, {s.waiting} waiting>"
