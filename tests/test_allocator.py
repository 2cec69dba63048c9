"""The allocator policy: a freed large buffer is reused, not faulted in afresh (counted in page
faults, in a fresh process each, with glibc's defaults beside it), and threads share a bounded
number of arenas.

The median over 20 reallocations is compared: one reallocation can still fault a whole buffer
in when something else lands on the heap between two of them (CI once averaged 115 faults over
nine, about one whole buffer), which says nothing about the steady state the policy is for."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hloserve.allocator import keep_freed_memory, limit_arenas
from hloserve.config import Config

_FAULTS_PER_REALLOCATION = """
import resource, statistics, sys
from hloserve.allocator import keep_freed_memory, limit_arenas
from hloserve.config import Config
applied = keep_freed_memory(int(sys.argv[1]))
sizes = [(4 << 20) + k * 4096 for k in range(21)]  # 4 MiB and up: above glibc's first mmap threshold
held = b"\\x01" * sizes[0]
del held
faults = []
for size in sizes[1:]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = b"\\x01" * size  # written whole: every page it gets fresh faults in
    del held
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, statistics.median(faults))
"""


def _python(script: str, argument: int) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh process (an allocator policy is set once per process)."""
    command = [sys.executable, "-c", script, str(argument)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)


def _faults_per_reallocation(keep_bytes: int) -> tuple[bool, float]:
    applied, faults = _python(_FAULTS_PER_REALLOCATION, keep_bytes).stdout.split()
    return applied == "True", float(faults)


def test_a_freed_large_buffer_is_reused_where_glibc_would_fault_it_in_again() -> None:
    applied, kept = _faults_per_reallocation(512 << 20)
    if not applied:
        pytest.fail("mallopt was not applied: this test runs where the server runs, on glibc")
    _, default = _faults_per_reallocation(0)
    pages = (4 << 20) // 4096
    assert kept < pages / 10, f"median {kept} faults per 4 MiB buffer with the policy"
    assert default > pages / 2, f"median {default} faults per 4 MiB buffer with glibc's defaults"


def test_zero_leaves_the_defaults() -> None:
    assert keep_freed_memory(0) is False


_RESIDENT_AFTER_RETURN = """
import os, sys
from hloserve.allocator import keep_freed_memory, return_freed_memory
keep_freed_memory(512 << 20)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
held = [b"\\x01" * (16 << 20) for _ in range(4)]  # 64 MiB from the heap, written whole
pin = b"\\x02" * 4096 * 64  # above them: the trim threshold only ever looks at the heap's top
before = resident()
del held
kept = resident()
returned = return_freed_memory()
print(returned, before - kept, kept - resident())
"""


def test_freed_memory_kept_for_reuse_is_returned_when_asked() -> None:
    """What the policy keeps (64 MiB freed below a live block) stays resident until
    `return_freed_memory` hands it back, as after a model's unload."""
    done = subprocess.run(
        [sys.executable, "-c", _RESIDENT_AFTER_RETURN], capture_output=True, text=True, timeout=60, check=True
    )
    returned, dropped_by_free, dropped_by_return = done.stdout.split()
    assert returned == "True", done.stdout
    assert int(dropped_by_free) < 8 << 20, f"free alone gave back {int(dropped_by_free) >> 20} MiB"
    assert int(dropped_by_return) > 56 << 20, f"return gave back {int(dropped_by_return) >> 20} MiB of 64"


_ARENAS_OF_EIGHT_THREADS = """
import ctypes, sys, threading
from hloserve.allocator import limit_arenas
applied = limit_arenas(int(sys.argv[1]))
barrier = threading.Barrier(9)
def hold():
    block = bytearray(1 << 16)  # allocated by this thread, while the seven others live too
    barrier.wait(timeout=30)
    barrier.wait(timeout=30)
threads = [threading.Thread(target=hold) for _ in range(8)]
for thread in threads:
    thread.start()
barrier.wait(timeout=30)
sys.stderr.flush()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" section per arena, on stderr
barrier.wait(timeout=30)
print(applied)
"""


def _arenas(limit: int) -> tuple[bool, int]:
    done = _python(_ARENAS_OF_EIGHT_THREADS, limit)
    return done.stdout.strip() == "True", done.stderr.count("Arena ")


def test_threads_share_the_configured_number_of_arenas() -> None:
    limit = Config().server.malloc_arenas
    applied, arenas = _arenas(limit)
    if not applied:
        pytest.fail("mallopt was not applied: this test runs where the server runs, on glibc")
    assert 1 <= arenas <= limit
    _, default = _arenas(0)
    assert default > limit, f"glibc's default gave {default} arenas to eight threads"


def test_no_arena_limit_leaves_the_default() -> None:
    assert limit_arenas(0) is False


_INTERNED_CHURN_STEP = """
import sys
from hloserve.allocator import grow_interned_table
from hloserve.memory_probe import allocator_bytes

def in_use():
    counts = allocator_bytes()
    return counts["in_use"] + counts["mapped"]  # the heap's blocks in use and the mmapped ones

live = [sys.intern(f"live.{index}") for index in range(60_000)]  # about as many as an engine holds
interned = getattr(sys, "getunicodeinternedsize", lambda: -1)
grown = grow_interned_table() if sys.argv[1] == "1" else None
before, names_before = in_use(), interned()
holder = type("Holder", (), {})()
for index in range(100_000):  # what loads and unloads do over an hour: set a name, drop it
    setattr(holder, f"name{index}", index)
    delattr(holder, f"name{index}")
print(grown, in_use() - before, interned() - names_before)
"""


def _interned_churn(grow: bool) -> tuple[str, int, int]:
    grown, step, names = _python(_INTERNED_CHURN_STEP, int(grow)).stdout.split()
    return grown, int(step), int(names)


def test_the_interned_table_grows_at_startup_not_under_churn() -> None:
    """With 60,000 live interned names, 100,000 names set and dropped rebuild the table at twice
    its size (+1.9 MB) unless `grow_interned_table` made that rebuild first. On Python 3.12 the
    names are immortal (each one set is kept), so there it must do nothing at all."""
    grown, step, names = _interned_churn(grow=True)
    if sys.version_info[:2] == (3, 12):
        assert grown == "False"
        assert names >= 100_000, f"{names} names kept: 3.12 keeps every interned name"
        return
    assert grown == "True"
    _, step_without, _ = _interned_churn(grow=False)
    assert step_without > 1 << 20, f"churn alone grew the heap by {step_without} bytes"
    assert step < 256 << 10, f"churn after grow_interned_table grew the heap by {step} bytes"
