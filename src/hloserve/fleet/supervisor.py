"""The node's supervisor: keeps child processes running, restarting one that dies after a
doubling backoff (giving up after a budget of restarts in a row), makes every child die with it
(`PR_SET_PDEATHSIG`), stops them with SIGTERM and a grace period before SIGKILL, and writes each
child's output line by line after its name.

Each child is a `hloserve._process.Process`: forked from the trio thread, awaited on a pidfd.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
import trio

from hloserve._process import Process
from hloserve.config import NodeConfig

__all__ = ["Child", "GaveUp", "Supervisor"]

log = structlog.get_logger("hloserve.node")


class GaveUp(Exception):
    """A child died more times in a row than `node.max_restarts` allows."""


@dataclass(frozen=True, slots=True)
class Child:
    """A process the supervisor keeps running."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    """Set over the supervisor's own environment."""
    grace_s: float = 15.0


async def _copy_lines(name: str, fd: int, out: Callable[[bytes], object]) -> None:
    """Write each line the child prints as `[name] line`, until it closes its output. Shielded:
    what a stopping child says on its way out is kept (and it never writes to a closed pipe)."""
    prefix = f"[{name}] ".encode()
    pending = b""
    with trio.CancelScope(shield=True):
        async with trio.lowlevel.FdStream(fd) as stream:
            while chunk := await stream.receive_some(1 << 16):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    out(prefix + line + b"\n")
    if pending:
        out(prefix + pending + b"\n")


def _write_stderr(data: bytes) -> None:
    sys.stderr.buffer.write(data)
    sys.stderr.buffer.flush()


class Supervisor:
    """Keeps children running until cancelled, then stops them all."""

    def __init__(self, node: NodeConfig, out: Callable[[bytes], object] = _write_stderr) -> None:
        self._node = node
        self._out = out
        self.pids: dict[str, int] = {}
        """The live pid of each child (for tests and logs)."""
        self.starts: dict[str, int] = {}

    async def keep_running(self, child: Child) -> None:
        """Run `child` again each time it exits; raises `GaveUp` past the restart budget."""
        in_a_row = 0
        while True:
            started = time.monotonic()
            code = await self._run_once(child)
            if time.monotonic() - started >= self._node.restart_reset_s:
                in_a_row = 0
            in_a_row += 1
            if self._node.max_restarts and in_a_row > self._node.max_restarts:
                log.error("giving up on a child", child=child.name, exit=code, restarts=in_a_row - 1)
                raise GaveUp(f"{child.name} exited {in_a_row} times in a row (last status {code})")
            backoff = min(2.0 ** (in_a_row - 1), self._node.restart_backoff_max_s)
            log.warning("child exited; restarting", child=child.name, exit=code, backoff_s=backoff)
            await trio.sleep(backoff)

    async def _run_once(self, child: Child) -> int:
        read, write = os.pipe()
        try:
            process = Process(
                child.argv,
                env={**os.environ, **child.env},
                stdin=subprocess.DEVNULL,
                stdout=write,
                stderr=write,
                death_signal=signal.SIGTERM,
                process_group=0,  # its own group: stopping it reaches whatever it started
            )
        finally:
            os.close(write)
        self.pids[child.name] = process.pid
        self.starts[child.name] = self.starts.get(child.name, 0) + 1
        log.info("child started", child=child.name, pid=process.pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_copy_lines, child.name, read, self._out)
                try:
                    return await process.wait()
                finally:
                    if process.returncode is None:  # cancelled: the node is stopping
                        with trio.CancelScope(shield=True):
                            if await process.stop(child.grace_s):
                                log.warning(
                                    "child ignored SIGTERM; killed", child=child.name, grace_s=child.grace_s
                                )
                            log.info("child stopped", child=child.name, exit=process.returncode)
        finally:
            process.close()
            self.pids.pop(child.name, None)
