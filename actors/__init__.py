"""The trio actors of one hloserve worker: model queues, the dispatcher and the weight cache."""

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio

__all__ = ["INLINE_WORK_S", "supervised"]

INLINE_WORK_S = 0.5e-3
"""Blocking work (an execution, a weight load) expected to take at most this long runs on the
event loop's own thread. A worker-thread hop costs about 0.1 ms of CPU, and while the loop keeps
a core busy the worker can wait milliseconds to be scheduled there: longer work is worth it,
shorter work is not."""


async def supervised(
    actor: str,
    run: Callable[..., Awaitable[None]],
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an actor; if it fails, say so and let the failure end the worker.

    The actors answer a bad message and carry on; what escapes one is a bug that leaves state
    nobody can trust, so the worker stops (its nursery cancels the rest, `serve` raises, and
    `hloserve serve` exits non-zero) rather than serve on half alive with a dead dispatcher.
    """
    try:
        await run(task_status=task_status)
    except Exception:
        structlog.get_logger("hloserve.worker").critical(
            "actor failed; the worker stops", actor=actor, exc_info=True
        )
        raise
