"""Triton's system shared-memory extension, server side: regions clients register by key.

A client creates a POSIX shared-memory object, registers it under a name (with an offset and
size inside the object), and then points input and output tensors at byte ranges of that
region, so tensor bytes never cross the socket. Every access is bounds-checked before anything
is read or written, and happens under the region's lock, so a concurrent unregister can never
unmap memory under a reader (reads and writes may run on worker threads).

The object is opened with `os.open` on /dev/shm and `mmap`, not `multiprocessing.shared_memory`:
the latter registers the client's object with Python's resource tracker, which may unlink it.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from hloserve._xla import host_buffer
from hloserve.errors import ShmRegionError

__all__ = ["Region", "ShmRegistry"]

SHM_DIR = "/dev/shm"


@dataclass(slots=True, eq=False)
class Region:
    """A registered region: `byte_size` bytes from `offset` in the object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    _map: mmap.mmap | None = field(repr=False, default=None)
    _lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0:
            raise ShmRegionError(self.name, f"offset {offset} and byte_size {size} must not be negative")
        if offset + size > self.byte_size:
            raise ShmRegionError(
                self.name, f"offset {offset} + byte_size {size} exceeds the region's {self.byte_size} bytes"
            )

    def read(self, offset: int, size: int) -> np.ndarray:
        """A copy of `size` bytes at `offset` (relative to the region), 64-byte aligned.

        One copy, made under the lock; aligned so that placing it on a CPU device copies no more.
        """
        self._check(offset, size)
        copy = host_buffer(size)
        with self._lock:
            if self._map is None:
                raise ShmRegionError(self.name, "was unregistered while in use")
            start = self.offset + offset
            copy[:] = np.frombuffer(self._map, dtype=np.uint8, count=size, offset=start)
        return copy

    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy a C-contiguous array's bytes to `offset` (relative to the region)."""
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        self._check(offset, view.nbytes)
        with self._lock:
            if self._map is None:
                raise ShmRegionError(self.name, "was unregistered while in use")
            start = self.offset + offset
            self._map[start : start + view.nbytes] = view

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None


class ShmRegistry:
    """The worker's registered regions, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        """Map `byte_size` bytes at `offset` of the object `key`; re-registering replaces."""
        if not name:
            raise ShmRegionError(name, "a region needs a non-empty name")
        if not key:
            raise ShmRegionError(name, "a region needs the key of an existing POSIX shared-memory object")
        if offset < 0 or byte_size <= 0:
            raise ShmRegionError(name, f"offset {offset} must be >= 0 and byte_size {byte_size} > 0")
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        if "/" in key.lstrip("/"):
            raise ShmRegionError(name, f"key {key!r} must name an object directly under {SHM_DIR}")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ShmRegionError(name, f"cannot open shared-memory object {key!r}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise ShmRegionError(
                    name, f"offset {offset} + byte_size {byte_size} exceeds the object's {size} bytes"
                )
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        region = Region(name, key, offset, byte_size, mapped)
        old = self._regions.pop(name, None)
        self._regions[name] = region
        if old is not None:
            old.close()
        return region

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise ShmRegionError(name, "is not registered; register it with SystemSharedMemoryRegister first")
        return region

    def status(self, name: str = "") -> list[Region]:
        """Every region, or the named one (unknown name: ShmRegionError)."""
        return [self.get(name)] if name else sorted(self._regions.values(), key=lambda r: r.name)

    def unregister(self, name: str = "") -> None:
        """Forget a region (unknown names are fine), or every region when `name` is empty."""
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                region.close()

    def close(self) -> None:
        self.unregister()
