"""The trio-asyncio loop runs the asyncio callbacks queued when a pass starts, and only those."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import trio
import trio_asyncio

from hloserve._transport import trio_asyncio_patches as _trio_asyncio_patches

_trio_asyncio_patches.install()


def test_callbacks_queued_together_run_in_one_pass() -> None:
    ran: list[int] = []
    seen_by_trio: list[int] = []

    async def main() -> None:
        async with trio_asyncio.open_loop():
            loop = asyncio.get_event_loop()
            for i in range(100):
                loop.call_soon(ran.append, i)
            for _ in range(3):
                await trio.lowlevel.checkpoint()
                seen_by_trio.append(len(ran))

    trio.run(main)
    assert ran == list(range(100))
    # One callback per pass (trio-asyncio alone) would have run three by the third checkpoint.
    assert seen_by_trio[-1] == 100, seen_by_trio


def test_callbacks_queued_meanwhile_wait_so_trio_tasks_keep_running() -> None:
    """A callback that schedules itself again forever must not starve trio's own tasks."""
    hops = 0
    seen_by_trio: list[int] = []

    async def main() -> None:
        async with trio_asyncio.open_loop():
            loop = asyncio.get_event_loop()
            stopped = False

            def hop() -> None:
                nonlocal hops
                hops += 1
                if not stopped:
                    loop.call_soon(hop)

            loop.call_soon(hop)
            for _ in range(20):
                await trio.lowlevel.checkpoint()
                seen_by_trio.append(hops)
            stopped = True

    trio.run(main)
    assert seen_by_trio[-1] < 100, seen_by_trio  # a few hops per trio turn, not an endless batch
    assert seen_by_trio[-1] > seen_by_trio[0], seen_by_trio  # and the chain did make progress


def test_call_soon_checks_its_callback_in_debug_mode_as_asyncio_does() -> None:
    """Unchecked by default (the check cost 2% of a frontend's CPU); in debug mode a coroutine
    function is refused as asyncio's own loop refuses it, and a plain callback still runs."""
    ran: list[str] = []

    async def coroutine_function() -> None:
        pass

    async def main() -> None:
        async with trio_asyncio.open_loop():
            loop = asyncio.get_event_loop()
            loop.set_debug(True)
            try:
                loop.call_soon(ran.append, "debug")
                with pytest.raises(TypeError, match="coroutines cannot be used with call_soon"):
                    loop.call_soon(coroutine_function)
            finally:
                loop.set_debug(False)
            loop.call_soon(ran.append, "plain")
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()

    trio.run(main)
    assert ran == ["debug", "plain"]


AS_ON_PYTHON_314 = """
import asyncio
import subprocess
import sys
del asyncio.AbstractChildWatcher  # as Python 3.14 removed it
{first}
import trio, trio_asyncio

async def main():
    async with trio_asyncio.open_loop():
        return await trio_asyncio.aio_as_trio(asyncio.sleep)(0, result=42)

print(trio.run(main))
"""


@pytest.mark.parametrize(("first", "works"), [("", False), ("import hloserve", True)])
def test_trio_asyncio_imports_and_runs_without_the_child_watcher_python_314_removed(
    first: str, works: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AS_ON_PYTHON_314.format(first=first)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if works:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["42"]
    else:  # what a user of trio-asyncio 0.16.0 meets on Python 3.14 without hloserve's module
        assert "AbstractChildWatcher" in done.stderr, done.stderr[-2000:]


def test_cancelled_timers_leave_the_heap_as_in_asyncio() -> None:
    """A cancelled `call_later` (a connection's idle timer, a call's deadline) is dropped once
    cancelled ones are half the heap, not kept until it would have fallen due."""
    fired: list[str] = []
    sizes: list[int] = []

    async def main() -> None:
        async with trio_asyncio.open_loop() as loop:
            handles = [loop.call_later(3600, fired.append, "cancelled") for _ in range(1000)]
            loop.call_later(0.2, fired.append, "due")
            while len(loop._timers) < 1001:  # each handle reaches the heap on a pass of the loop
                await trio.sleep(0.001)
            for handle in handles[:499]:
                handle.cancel()
            sizes.append(len(loop._timers))  # under half cancelled: kept
            for handle in handles[499:]:
                handle.cancel()
            sizes.append(len(loop._timers))
            await trio.sleep(0.4)

    trio.run(main)
    assert sizes[0] == 1001
    assert sizes[1] < _trio_asyncio_patches.MIN_TIMERS_TO_PURGE, sizes
    assert fired == ["due"]
