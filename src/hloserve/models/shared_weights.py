"""A model's host weights in one POSIX shared-memory region, shared by the workers of a node.

With one worker per GPU, each would otherwise hold its own host copy of every model. The first
worker to need a model fills a region (`/dev/shm/hloserve-w-<model>-<digest>`) and the others
attach to it; the digest covers the model's name, its weights file's size and modification time,
and every tensor's name, dtype and shape, so a changed bundle gets a new region. Coordination is
`flock` on a lock file beside the region: holders keep a shared lock while attached; a worker
takes the exclusive lock only to fill; on release, a worker that can take the exclusive lock is
the last holder and unlinks the region. Regions and lock files get `mode` (default 0o660).
A region left behind by a worker that died (no holder: its lock is free) is swept when the
model is next acquired under a new digest, so a changed bundle does not leak its old version.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from hloserve.models.bundle import Bundle

__all__ = ["SharedHostWeights"]

SHM_DIR = "/dev/shm"
_MAGIC = 0x484C5357  # "HLSW"
_HEADER = 64
_ALIGNMENT = 64


def _digest(bundle: Bundle) -> str:
    assert bundle.weights_path is not None
    stat = bundle.weights_path.stat()
    h = hashlib.sha256(f"{bundle.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    for w in bundle.weights:
        h.update(f"|{w.name}:{w.dtype.token}:{','.join(map(str, w.shape))}".encode())
    return h.hexdigest()[:16]


def _layout(bundle: Bundle) -> tuple[list[int], int]:
    offsets, cursor = [], _HEADER
    for w in bundle.weights:
        cursor += -cursor % _ALIGNMENT
        offsets.append(cursor)
        cursor += w.nbytes
    return offsets, max(cursor, _HEADER)


@dataclass(eq=False)
class SharedHostWeights:
    """A model's weights in a shared region; `arrays` are read-only views into it."""

    name: str
    """The region's file name under /dev/shm."""
    arrays: list[np.ndarray]
    filled: bool
    """This worker filled the region (False: it attached to one another worker filled)."""
    _lock_fd: int = field(repr=False, default=-1)
    _map: mmap.mmap | None = field(repr=False, default=None)

    @classmethod
    def acquire(cls, bundle: Bundle, mode: int = 0o660) -> SharedHostWeights:
        """Attach to the model's region, filling it first if no worker has (blocking)."""
        sanitized = re.sub(r"[^A-Za-z0-9_.-]", "_", bundle.name)
        name = f"hloserve-w-{sanitized}-{_digest(bundle)}"
        shared = cls._acquire(name, bundle, mode)
        _sweep_siblings(sanitized, name)
        return shared

    @classmethod
    def _acquire(cls, name: str, bundle: Bundle, mode: int) -> SharedHostWeights:
        path = os.path.join(SHM_DIR, name)
        lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, mode)
        os.fchmod(lock_fd, mode)
        offsets, size = _layout(bundle)
        while True:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
            mapped = cls._attach(path, size)
            if mapped is not None:
                return cls._views(name, bundle, offsets, mapped, lock_fd, filled=False)
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another worker is filling it
                time.sleep(0.005)
                continue
            mapped = cls._attach(path, size)  # filled between our two locks?
            if mapped is None:
                mapped = cls._fill(path, size, bundle, offsets, mode)
                filled = True
            else:
                filled = False
            fcntl.flock(lock_fd, fcntl.LOCK_SH)  # downgrade: now one holder among others
            return cls._views(name, bundle, offsets, mapped, lock_fd, filled=filled)

    @staticmethod
    def _attach(path: str, size: int) -> mmap.mmap | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, ready = struct.unpack_from("<II", mapped, 0)
        if magic != _MAGIC or not ready:
            mapped.close()
            return None
        return mapped

    @staticmethod
    def _fill(path: str, size: int, bundle: Bundle, offsets: list[int], mode: int) -> mmap.mmap:
        try:
            os.unlink(path)  # a stale remnant nobody holds (we have the exclusive lock)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        assert bundle.weights_path is not None
        with bundle.weights_path.open("rb", buffering=0) as f:
            for w, offset in zip(bundle.weights, offsets, strict=True):
                f.seek(w.offset)
                f.readinto(memoryview(mapped)[offset : offset + w.nbytes])
        struct.pack_into("<II", mapped, 0, _MAGIC, 1)
        mapped.flush()
        return mapped

    @classmethod
    def _views(
        cls, name: str, bundle: Bundle, offsets: list[int], mapped: mmap.mmap, lock_fd: int, filled: bool
    ) -> SharedHostWeights:
        arrays = [
            np.frombuffer(
                mapped, dtype=w.dtype.numpy, count=int(np.prod(w.shape, dtype=np.int64)), offset=o
            ).reshape(w.shape)
            for w, o in zip(bundle.weights, offsets, strict=True)
        ]
        return cls(name, arrays, filled, lock_fd, mapped)

    def release(self) -> None:
        """Detach; the last holder unlinks the region."""
        if self._lock_fd < 0:
            return
        self.arrays = []
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(os.path.join(SHM_DIR, self.name))
        except (BlockingIOError, FileNotFoundError):
            pass  # another worker still holds it
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # device arrays aliasing it on a CPU: it goes when they do
                pass
            self._map = None
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = -1


def _sweep_siblings(sanitized: str, keep: str) -> None:
    """Unlink the model's other regions (older digests) that no worker holds."""
    sibling = re.compile(rf"hloserve-w-{re.escape(sanitized)}-[0-9a-f]{{16}}")
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if entry.name == keep or not sibling.fullmatch(entry.name):
                continue
            try:
                lock_fd = os.open(entry.path + ".lock", os.O_RDWR)
            except FileNotFoundError:
                continue  # not ours to judge: no lock says who holds it
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(entry.path)
            except (BlockingIOError, FileNotFoundError):
                pass  # held by a live worker, or swept by another meanwhile
            finally:
                os.close(lock_fd)  # closing drops the lock; the lock file is kept, as every lock file
