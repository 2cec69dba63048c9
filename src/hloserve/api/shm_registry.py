"""Triton's system shared-memory extension, server side: regions clients register by key.

A client creates a POSIX shared-memory object, registers it under a name (with an offset and
size inside the object), and then points input and output tensors at byte ranges of that
region, so tensor bytes never cross the socket.

The client keeps control of its object, so nothing about it may hurt the server:

- it is opened like glibc's `shm_open` would (a name directly under /dev/shm), but without
  following a symbolic link (else a link would make the server read and overwrite any file it
  can open), and only as a regular file owned by an allowed uid (`server.shm_allowed_uids`);
- it is never mapped: a client can truncate its object at any time, and touching a mapping past
  the new end kills the process with SIGBUS. The server keeps the descriptor and copies with
  `pread`/`pwrite`, where a truncated object is a short read (an error naming the region);
- a name registered once stays until unregistered (as Triton: ALREADY_EXISTS), so no client can
  redirect another's outputs into its own object;
- regions and their bytes are capped (`server.shm_max_regions`, `server.shm_max_bytes`), since
  each holds a descriptor.

Every access is bounds-checked first and runs under the region's lock, so an unregister (which
closes the descriptor at once) never closes it under a copy running on a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass, field

import numpy as np

from hloserve.errors import ShmLimit, ShmRegionError, ShmRegionExists, clip
from hloserve.models.aligned import host_buffer

__all__ = ["NAME_MAX", "Region", "ShmRegistry"]

SHM_DIR = "/dev/shm"
NAME_MAX = 255
"""Longest region name and object name, in UTF-8 bytes (the object name is a file name)."""
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
"""No link is followed; a FIFO or device can neither block the loop nor become a terminal."""


@dataclass(slots=True, eq=False)
class Region:
    """A registered region: `byte_size` bytes from `offset` in the object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    _fd: int | None = field(repr=False, default=None)
    _lock: threading.Lock = field(repr=False, default_factory=threading.Lock)

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0:
            raise ShmRegionError(self.name, f"offset {offset} and byte_size {size} must not be negative")
        if offset + size > self.byte_size:
            raise ShmRegionError(
                self.name, f"offset {offset} + byte_size {size} exceeds the region's {self.byte_size} bytes"
            )

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ShmRegionError(self.name, "was unregistered while in use")
        return self._fd

    def _truncated(self, fd: int, needed: int) -> ShmRegionError:
        return ShmRegionError(
            self.name,
            f"object {clip(self.key)} was truncated to {os.fstat(fd).st_size} bytes after registration; "
            f"the access needs {needed}",
        )

    def read(self, offset: int, size: int) -> np.ndarray:
        """A copy of `size` bytes at `offset` (relative to the region), 64-byte aligned.

        One copy (pread straight into the buffer), made under the lock; aligned so that placing
        it on a CPU device copies no more.
        """
        self._check(offset, size)
        copy = host_buffer(size)
        buffer = copy.data
        start = self.offset + offset
        with self._lock:
            fd = self._open_fd()
            done = 0
            try:
                while done < size:
                    n = os.preadv(fd, [buffer[done:]], start + done)
                    if n == 0:
                        raise self._truncated(fd, start + size)
                    done += n
            except OSError as e:
                problem = f"cannot read object {clip(self.key)}: {e.strerror}"
                raise ShmRegionError(self.name, problem) from None
        return copy

    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy a C-contiguous array's bytes to `offset` (relative to the region).

        A truncated object is refused rather than written; one truncated during the copy grows
        back to the registered end (pwrite past the end extends a file), which is the client's
        own doing and harms nothing.
        """
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        self._check(offset, view.nbytes)
        start = self.offset + offset
        with self._lock:
            fd = self._open_fd()
            try:
                if os.fstat(fd).st_size < start + view.nbytes:
                    raise self._truncated(fd, start + view.nbytes)
                done = 0
                while done < view.nbytes:
                    done += os.pwrite(fd, view[done:], start + done)
            except OSError as e:
                problem = f"cannot write object {clip(self.key)}: {e.strerror}"
                raise ShmRegionError(self.name, problem) from None

    def close(self) -> None:
        """Close the descriptor now (after a copy in flight, which holds the lock)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _check_name(name: str, what: str, region: str) -> None:
    if not name:
        raise ShmRegionError(region, f"a region needs a non-empty {what}")
    length = len(name.encode("utf-8", "surrogatepass"))
    if length > NAME_MAX:
        raise ShmRegionError(region, f"{what} has {length} bytes; at most {NAME_MAX} are allowed")


class ShmRegistry:
    """The worker's registered regions, by name, within a count and a byte budget.

    `owners` are the uids whose objects may be registered (default: the server's own).
    """

    def __init__(
        self, max_regions: int = 256, max_bytes: int = 8 << 30, owners: frozenset[int] | None = None
    ) -> None:
        self._regions: dict[str, Region] = {}
        self._max_regions, self._max_bytes = max_regions, max_bytes
        self._owners = frozenset({os.geteuid()}) if owners is None else owners
        self._bytes = 0

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        """Open `byte_size` bytes at `offset` of the object `key` under a new name."""
        _check_name(name, "name", name)
        _check_name(key, "key", name)
        if name in self._regions:
            raise ShmRegionExists(name)
        if offset < 0 or byte_size <= 0:
            raise ShmRegionError(name, f"offset {offset} must be >= 0 and byte_size {byte_size} > 0")
        if len(self._regions) >= self._max_regions:
            raise ShmLimit(name, f"{self._max_regions} regions are registered", "server.shm_max_regions")
        if self._bytes + byte_size > self._max_bytes:
            raise ShmLimit(
                name,
                f"{byte_size} bytes on top of the {self._bytes} registered exceed {self._max_bytes}",
                "server.shm_max_bytes",
            )
        fd = self._open(name, key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise ShmRegionError(
                    name, f"offset {offset} + byte_size {byte_size} exceeds the object's {size} bytes"
                )
        except BaseException:
            os.close(fd)
            raise
        region = Region(name, key, offset, byte_size, fd)
        self._regions[name] = region
        self._bytes += byte_size
        return region

    def _open(self, name: str, key: str) -> int:
        """A descriptor of the regular file `key` names, owned by an allowed uid; else why not."""
        object_name = key.removeprefix("/")
        if "/" in object_name or object_name in ("", ".", "..") or "\0" in object_name:
            raise ShmRegionError(
                name,
                f"key {clip(key)} must name an object directly under {SHM_DIR} (no '/', '.', '..' or NUL)",
            )
        try:
            fd = os.open(os.path.join(SHM_DIR, object_name), _OPEN_FLAGS)
        except OSError as e:
            why = "it is a symbolic link, which is never followed" if e.errno == errno.ELOOP else e.strerror
            raise ShmRegionError(name, f"cannot open shared-memory object {clip(key)}: {why}") from None
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file (a POSIX shared-memory object is one)"
        elif info.st_uid not in self._owners:
            problem = (
                f"is owned by uid {info.st_uid}; server.shm_allowed_uids allows "
                f"{sorted(self._owners)} (default: the server's own uid)"
            )
        if problem is not None:
            os.close(fd)
            raise ShmRegionError(name, f"shared-memory object {clip(key)} {problem}")
        return fd

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            _check_name(name, "name", name)
            raise ShmRegionError(name, "is not registered; register it with SystemSharedMemoryRegister first")
        return region

    def status(self, name: str = "") -> list[Region]:
        """Every region, or the named one (unknown name: ShmRegionError)."""
        return [self.get(name)] if name else sorted(self._regions.values(), key=lambda r: r.name)

    def unregister(self, name: str = "") -> None:
        """Forget a region and close its descriptor (unknown names are fine), or every region
        when `name` is empty."""
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                self._bytes -= region.byte_size
                region.close()

    def close(self) -> None:
        self.unregister()
