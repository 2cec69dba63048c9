"""The memory policy of a server process: the C allocator's (glibc's malloc, through `mallopt`)
and the cyclic collector's (`settle_heap`).

A request's large buffers (the received message, the tensors parsed from it) are freed as soon
as it is answered. By default glibc returns a freed block above its (adaptive) mmap threshold,
or free memory at the top of the heap beyond its trim threshold, to the kernel, and the next
request's buffer of the same size is then faulted in again, page by page. Which happens depends
on what shaped the heap before: a frontend that had served 64 tiny requests at a time took 6,300
page faults and 4.3 ms of CPU per 4.8 MB request afterwards, against 2.4-2.6 ms with this policy.

`limit_arenas` caps glibc's arenas. By default every new thread that allocates gets an arena of
its own, up to 8 per core, and trio's worker threads come and go all day: each new one lands in a
different arena, and what is freed in one arena is never reused by another. In an hour's soak
the engine's freed-but-kept heap grew to 30 MB (RSS +16 MB an hour); with two arenas it levelled
off near 10 MB (RSS +7 MB an hour, +2 in the last half-hour).

`keep_freed_memory` makes buffers up to 32 MiB (glibc's largest mmap threshold) come from the
heap and keeps up to `nbytes` of freed heap for reuse before trimming. Off glibc, it does nothing.
`return_freed_memory` hands every free page back at once, where what was freed will not come
back soon: a model's unload (a load leaves its arenas 5 to 7 KB bigger, never returned by the
trim threshold, which only looks at the top of the heap) and an abandoned message's frames. The
next large request faults its buffer in again, once. `settle_heap` takes what startup made out
of the cyclic collector's walks, and `grow_interned_table` takes the interned-string table's one
growth into startup.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
from collections.abc import Callable

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "grow_interned_table",
    "keep_freed_memory",
    "limit_arenas",
    "return_freed_memory",
    "settle_heap",
]

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks this large or smaller come from the heap (glibc's maximum for the threshold)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_INTERNED_CHURN = 200_000
"""Names interned and dropped at startup: more than the free slots of a table of 2^18 (174,762),
the size 43,691-87,381 live interned strings give it (an engine holds about 63,000)."""


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # None: not glibc
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def limit_arenas(count: int) -> bool:
    """Let the process's threads share at most `count` arenas (0: leave glibc's 8 per core); True
    if applied. glibc fixes its limit once a ninth arena exists: call this before threads start."""
    mallopt = _mallopt()
    return count > 0 and mallopt is not None and mallopt(_M_ARENA_MAX, count) == 1


def keep_freed_memory(nbytes: int) -> bool:
    """Keep up to `nbytes` of freed heap for reuse (0: leave glibc's defaults); True if applied."""
    mallopt = _mallopt()
    if nbytes <= 0 or mallopt is None:
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, nbytes) == 1
    )


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim(0)`: every arena, not
    only the top of the heap); True if any was. Off glibc, nothing. It walks the arenas without
    the GIL: call it from a worker thread where the heap is large."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1


def settle_heap() -> None:
    """Put what startup made (JAX's modules, the executables) out of the cyclic collector's reach,
    and make the interned-string table's one growth now (`grow_interned_table`).

    With JAX loaded a full collection took 50-60 ms and ran every few seconds under load: it was
    the whole tail at perf_analyzer concurrency 64 on the MLP (p99 76 ms; 28 ms frozen). Frozen
    objects are still freed by reference counting; only cycles among them are never collected,
    which bounds what an unload can leave behind to the startup models' Python objects. The
    binary owns its process, so freezing is its call; a program embedding `serve` decides for
    itself.
    """
    gc.collect()
    gc.freeze()
    grow_interned_table()


def grow_interned_table() -> bool:
    """Rebuild Python's table of interned strings now at the size churn would give it; True if
    done (not on Python 3.12).

    A server interns names that live briefly (`setattr` interns its name; a load or an unload
    sets and drops some), and on 3.11 and 3.13 a dead name's slot stays taken until the table is
    rebuilt. The first rebuild comes when the slots run out, 20,000 to 40,000 names in, and doubles
    the table (2^17 to 2^18 slots with JAX imported): a 1.8 MB step in a serving engine's first
    hour that no later rebuild repeats while under a third of its slots hold live names.
    Interning and dropping more names than the table has free slots makes that rebuild here,
    in 60 ms. Python 3.12's interned strings are immortal: there this would leak them, and no name
    dies, so it does nothing.
    """
    if sys.version_info[:2] == (3, 12):
        return False
    interned = getattr(sys, "getunicodeinternedsize", None)  # 3.12 and later
    live = interned() if interned is not None else 0
    for index in range(max(_INTERNED_CHURN, 4 * live)):  # free slots are under 4x the live names
        sys.intern(f"hloserve.allocator.{index}")
    return True
