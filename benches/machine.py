"""The machine while benchmarking: how busy it is, and waiting until it is quiet.

Two shared cores make every figure noisy: before each
measurement the suite waits, bounded, until the whole machine's busy time (from /proc/stat,
steal included) falls below a threshold, and records what it saw beside the figure.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["Quiet", "busy_cores", "quiet_wait"]


def _busy_and_total() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = 0.5) -> float:
    """Cores' worth of CPU the whole machine used over the next `seconds`."""
    busy, total = _busy_and_total()
    time.sleep(seconds)
    busy_after, total_after = _busy_and_total()
    return (busy_after - busy) / max(1, total_after - total) * (os.cpu_count() or 1)


@dataclass(frozen=True)
class Quiet:
    busy_cores: float
    """Busy cores in the last sample before measuring."""
    waited_s: float
    loadavg_1m: float

    @property
    def quiet(self) -> bool:
        return self.busy_cores <= QUIET_CORES


QUIET_CORES = 0.3


def quiet_wait(timeout_s: float = 20.0) -> Quiet:
    """Wait until the machine is quiet (or `timeout_s` passed); say how busy it was."""
    started = time.monotonic()
    while True:
        busy = busy_cores()
        waited = time.monotonic() - started
        if busy <= QUIET_CORES or waited >= timeout_s:
            return Quiet(round(busy, 3), round(waited, 1), os.getloadavg()[0])
