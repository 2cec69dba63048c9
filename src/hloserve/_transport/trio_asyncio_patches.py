"""What trio-asyncio 0.16.0 lacks for a busy server, added here.

Its loop runs one asyncio callback per pass of trio's scheduler: each `call_soon`, each future
completion and each task step costs a full trip through trio's run loop and an epoll poll. A
native asyncio loop runs every callback that is ready before it polls again. With many
streams in flight the difference is large: perf_analyzer at concurrency 16 against the tiny MLP
(server on one core) got 2150 infer/s one callback per pass and 2960 with the batch, server CPU
per request 0.47 → 0.34 ms.

`install()` makes each pass run the callbacks queued when it starts, as asyncio does; those
queued meanwhile wait for the next pass, so trio's own tasks still run between batches.

It also makes `call_soon` check its callback only in debug mode, as asyncio's own loop does.
trio-asyncio checks every one (`asyncio.iscoroutinefunction`, an `inspect` walk), and every
future a handler awaits is resolved through `call_soon`: the check was 2% of a frontend's CPU
at 16 requests in flight.

Process-wide, unlike the grpclib patches: `trio_asyncio.open_loop` builds its loop class with
no way to pass another, so scoping this to hloserve's loop would mean copying `open_loop`; and
every trio-asyncio loop in the process gains the same asyncio semantics (a callback queued
while a batch runs still waits for the next pass). `install()` first checks trio-asyncio is the
version this was written for. Not filed upstream as such (python-trio/trio-asyncio#44 measures
the cost of each callback's trip through trio); the fix there would be this loop in
`BaseTrioEventLoop._main_loop`.

Its loop never drops a cancelled timer: `call_later` handles stay in its heap until they fall
due. Each connection's idle timer (`server.idle_timeout_s`, 5 minutes) and each call's deadline
(as long as the client asks) is cancelled when its connection or call ends, so a server whose
clients connect and leave kept every such handle for minutes, or for a client's whole deadline:
the heap grew by about 8,000 handles in an hour of the soak. `install()` drops cancelled
handles as asyncio's loop does, once they are half of a heap of 100 or more.

On Python 3.12 and newer `asyncio.current_task` is C code that never consults trio-asyncio's
running loop, so trio-asyncio replaces it when it is imported. A library imported before it keeps
the C function it bound by name (grpclib's deadlines: "no running event loop", answered UNKNOWN;
anyio's cancel scopes, under Starlette), which happens whenever a process imports grpclib,
betterproto2's grpclib stubs, Starlette or `hloserve.client` before the worker. `install()`
rebinds those names to trio-asyncio's function each time a worker starts.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import sys
from typing import Any

import trio_asyncio  # noqa: F401  (replaces asyncio.current_task, see the module docstring)
from trio_asyncio._base import BaseTrioEventLoop

from hloserve._transport.requirements import Requires, check

__all__ = ["REQUIRES", "install"]

REQUIRES = Requires(
    __name__,
    "trio-asyncio",
    "0.16.0",
    members=("trio_asyncio._base.BaseTrioEventLoop._q_recv",),
    parameters={
        "trio_asyncio._base.BaseTrioEventLoop._main_loop_one": ("self", "no_wait"),
        "trio_asyncio._base.BaseTrioEventLoop.call_soon": ("self", "callback", "args", "context"),
        "trio_asyncio._base.BaseTrioEventLoop._queue_handle": ("self", "handle"),
        "trio_asyncio._base.BaseTrioEventLoop._timer_handle_cancelled": ("self", "handle"),
    },
)

_run_one = BaseTrioEventLoop._main_loop_one


async def _run_ready(self: Any, no_wait: bool = False) -> None:
    """Run one callback (waiting for it unless `no_wait`), then those already queued behind it."""
    await _run_one(self, no_wait)
    for _ in range(self._q_recv.statistics().current_buffer_used):
        await _run_one(self, True)  # never blocks: each turn takes a queued callback or a due timer


def _call_soon(self: Any, callback: Any, *args: Any, **context: Any) -> asyncio.Handle:
    """trio-asyncio's `call_soon`, its callback checked in debug mode only."""
    if self._debug:
        self._check_callback(callback, "call_soon")
    handle: asyncio.Handle = self._queue_handle(asyncio.Handle(callback, args, self, **context))
    return handle


MIN_TIMERS_TO_PURGE = 100
"""A heap of fewer timers keeps its cancelled ones until they fall due (asyncio's bound)."""


def _timer_handle_cancelled(self: Any, handle: asyncio.TimerHandle) -> None:
    """Count a cancelled timer; once counted ones are half of the heap, rebuild it without them."""
    cancelled = getattr(self, "_hloserve_cancelled_timers", 0) + 1
    timers: list[asyncio.TimerHandle] = self._timers
    if len(timers) >= MIN_TIMERS_TO_PURGE and 2 * cancelled > len(timers):
        timers[:] = [t for t in timers if not t.cancelled() and t is not handle]  # (`handle` is marked next)
        heapq.heapify(timers)
        cancelled = 0
    self._hloserve_cancelled_timers = cancelled


BOUND_BY_NAME = (("grpclib.utils", "_current_task"), ("anyio._backends._asyncio", "current_task"))
"""Where libraries the worker runs keep `asyncio.current_task` under a name of their own."""


def install() -> None:
    """Check trio-asyncio's version and internals and patch its loop (once per process), then
    point the libraries that bound `asyncio.current_task` before trio-asyncio replaced it at
    trio-asyncio's function."""
    _patch_loop()
    for module_name, name in BOUND_BY_NAME:
        module = sys.modules.get(module_name)  # one imported later binds trio-asyncio's function
        if module is not None and getattr(module, name, asyncio.current_task) is not asyncio.current_task:
            setattr(module, name, asyncio.current_task)


@functools.cache
def _patch_loop() -> None:
    check(REQUIRES)
    BaseTrioEventLoop._main_loop_one = _run_ready
    BaseTrioEventLoop.call_soon = _call_soon
    BaseTrioEventLoop._timer_handle_cancelled = _timer_handle_cancelled
