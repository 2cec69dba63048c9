"""Child processes of a server (the node's workers, the engine's frontends): forked from the
calling trio thread, dying with their parent, awaited on a pidfd, stopped with grace.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process; trio's
`open_process` forks in a worker thread that exits after 10 s idle, which would take every child
of an idle parent down. So the fork happens on the trio thread itself (a vfork-style spawn,
brief), and the exit is awaited on a pidfd instead of a thread blocked in waitpid.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
from collections.abc import Collection, Mapping, Sequence
from typing import IO

import trio

__all__ = ["Process", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(signum: int, parent: int | None = None) -> None:
    """In the child: be sent `signum` when the parent's forking thread ends; exit at once if the
    parent (pid `parent`, or any but init when None) died before this took effect."""
    if _libc().prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1 if parent is None else os.getppid() != parent:
        os._exit(1)


class Process:
    """A child process started from the calling thread (see the module docstring).

    `death_signal` sets the parent-death signal before the child's program runs (a child that
    sets its own, as a frontend does, leaves it None); `process_group` 0 puts the child in a group
    of its own, which `stop` then signals whole, so nothing it started outlives it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[bytes] | None = None,
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
        pass_fds: Collection[int] = (),
        death_signal: int | None = None,
        process_group: int | None = None,
    ) -> None:
        preexec = None
        if death_signal is not None:
            _libc()  # loaded here, never in the forked child
            preexec = functools.partial(die_with_parent, death_signal, os.getpid())
        self._popen = subprocess.Popen(
            list(argv),
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=tuple(pass_fds),
            preexec_fn=preexec,
            process_group=process_group,
        )
        self.pid = self._popen.pid
        self._group = process_group == 0
        self._pidfd = os.pidfd_open(self.pid)
        self._waiting = trio.Lock()

    @property
    def stdin(self) -> IO[bytes] | None:
        return self._popen.stdin

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        """Its exit status, once it has exited (any number of tasks may wait)."""
        async with self._waiting:  # one task at a time waits on the pidfd
            if self._popen.poll() is None:
                await trio.lowlevel.wait_readable(self._pidfd)
        return self._popen.wait()

    def signal(self, signum: int) -> None:
        """Send `signum` to it (to its whole group, if it has one of its own)."""
        with contextlib.suppress(ProcessLookupError):
            if self._group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)

    async def stop(self, grace_s: float) -> bool:
        """SIGTERM, then SIGKILL once `grace_s` has passed; whether it took SIGKILL. Its group, if
        it has one of its own, is killed with it (what it started and left behind goes too)."""
        if self.returncode is None:
            self.signal(signal.SIGTERM)
        with trio.move_on_after(grace_s):
            await self.wait()
        killed = self.returncode is None
        if killed or self._group:
            self.signal(signal.SIGKILL)
        await self.wait()
        return killed

    def close(self) -> None:
        """Once it has exited: release the pidfd."""
        os.close(self._pidfd)
