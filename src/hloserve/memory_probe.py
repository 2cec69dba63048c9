"""An opt-in memory probe of a server process, for soaks (`python -m benches soak`).

What `/proc` shows from outside (resident memory, descriptors, threads) cannot tell a leak from
the allocator keeping freed memory; this tells them apart from inside. With
`logging.memory_probe_dir` set (`HLOSERVE_LOGGING_MEMORY_PROBE_DIR`, inherited by the frontends
and a node's workers), every `logging.memory_probe_s` each engine, frontend and node (supervisor)
process appends one JSON line to `<dir>/<role>-<pid>.jsonl`: its resident bytes, descriptors and
threads, the Python heap (tracemalloc, one frame: what is allocated and not freed, after a full
collection), the objects frozen out of the cyclic collector's walks (none: the process never
settled its heap), glibc's `mallinfo2` over every arena (bytes in use, freed but kept, mapped), and the
heap's top growth by source line since the first probe after `logging.memory_probe_baseline_s`.

It costs what tracemalloc costs (every allocation is recorded: expect a slower server) plus a
collection and a snapshot per probe, so it is for soaks and investigations, never on by default.
With `logging.memory_probe_trace` false it leaves tracemalloc off and writes the rest: what the
server's RSS does when nothing else shares its heap.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hloserve.config import LoggingConfig

__all__ = ["TOP_LINES", "start_memory_probe"]

TOP_LINES = 10
"""Source lines of largest heap growth written per probe."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )
    ]  # fmt: skip


def _mallinfo2() -> Any:
    try:
        function = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and newer
    except AttributeError:
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()

_INTERNED = getattr(sys, "getunicodeinternedsize", None)
"""How many strings are interned (Python 3.12+). On 3.12 an interned string is immortal, so a
name interned per request or per load is a leak there that 3.11 and 3.13 hide."""


def allocator_bytes() -> dict[str, int] | None:
    """glibc's counts over every arena (None off glibc): `heap` obtained by brk/sbrk and arenas,
    `mapped` in mmapped blocks, `in_use` allocated, `free` freed but kept, `trimmable` at the top
    of the main heap (what `malloc_trim` could give back at once)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return {
        "heap": info.arena,
        "mapped": info.hblkhd,
        "in_use": info.uordblks,
        "free": info.fordblks,
        "trimmable": info.keepcost,
    }


def _process() -> dict[str, int]:
    status = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "descriptors": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
    }


def start_memory_probe(settings: LoggingConfig, role: str) -> bool:
    """Start probing this process as `settings` say (`memory_probe_dir` None: do nothing); True
    if started."""
    directory = settings.memory_probe_dir
    if directory is None:
        return False
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{role}-{os.getpid()}.jsonl"
    trace = settings.memory_probe_trace
    if trace:
        tracemalloc.start(1)
    threading.Thread(
        target=_probe,
        args=(path, settings.memory_probe_s, settings.memory_probe_baseline_s, role, trace),
        name="memory probe",
        daemon=True,
    ).start()
    return True


def _probe(path: Path, interval_s: float, baseline_s: float, role: str, trace: bool) -> None:
    baseline: tracemalloc.Snapshot | None = None
    started = time.monotonic()
    while True:
        line: dict[str, Any] = {
            "role": role,
            "pid": os.getpid(),
            "unix_s": round(time.time(), 3),
            "uptime_s": round(time.monotonic() - started, 3),
            **_process(),
            "allocator": allocator_bytes(),
            "frozen_objects": gc.get_freeze_count(),  # what `settle_heap` took out of the collector's walks
        }
        if _INTERNED is not None:
            line["interned_strings"] = _INTERNED()
        if trace:
            gc.collect()
            snapshot = tracemalloc.take_snapshot()
            if baseline is None and line["uptime_s"] >= baseline_s:
                baseline = snapshot
            top = snapshot.compare_to(baseline, "lineno")[:TOP_LINES] if baseline else []
            line |= {
                "heap_bytes": tracemalloc.get_traced_memory()[0],
                "tracemalloc_bytes": tracemalloc.get_tracemalloc_memory(),
                "top_growth": [
                    {
                        "line": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                        "bytes": s.size_diff,
                        "blocks": s.count_diff,
                    }
                    for s in top
                    if s.size_diff > 0
                ],
            }
            del snapshot
        with path.open("a") as file:
            file.write(json.dumps(line) + "\n")
        time.sleep(interval_s)
