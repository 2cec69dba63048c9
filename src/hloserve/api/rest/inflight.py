"""What the REST connections and requests are waiting for, swept once a tick (`InFlight`)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Protocol

__all__ = ["Connection", "InFlight"]


class Connection(Protocol):
    """What the sweep needs of a connection (`hloserve._transport.hypercorn_connection`'s)."""

    async def close_idle(self) -> None: ...
    def h2_idle(self) -> bool: ...
    def abort(self) -> None: ...


class InFlight:
    """What the REST connections and requests are waiting for, so that one sweep a tick ends
    those that waited too long: the deadline of each body being read (its task is cancelled),
    of each answer being sent (its connection is aborted: a client that does not read would
    hold it, and the answer's bytes, forever) and of each idle connection (it is closed); and the
    task serving each connection's inference, by client address, for its connection to cancel
    when the client goes. A task or a timer per request (hypercorn restarts an idle-timeout task
    after every answer) costs about 25 us each on trio-asyncio, a tenth of a tiny request."""

    def __init__(self, body_timeout_s: float, idle_timeout_s: float) -> None:
        self.body_timeout_s, self.idle_timeout_s = body_timeout_s, idle_timeout_s
        self.serving: dict[Hashable, asyncio.Task[None]] = {}
        self.reading: dict[asyncio.Task[object], float] = {}
        self.idle: dict[Connection, float] = {}
        self.sending: dict[asyncio.Task[None], tuple[float, Hashable]] = {}
        """The deadline of each answer being sent, and its client, by the task sending it: one
        stream's answer completing (h2c, or pipelined HTTP/1.1) leaves its siblings' deadlines."""
        self.connections: dict[Hashable, Connection] = {}
        """Open connections by client address."""
        self.cancelled: set[asyncio.Task[object]] = set()
        """Tasks cancelled here (by a disconnect or a deadline), not by a shutdown."""
        self._closing: set[asyncio.Future[None]] = set()

    def disconnected(self, client: Hashable) -> None:
        task = self.serving.pop(client, None)
        if task is not None:
            self._cancel(task)

    async def sweep(self) -> None:
        """Cancel body reads and close idle connections past their deadlines, forever."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.body_timeout_s / 4, self.idle_timeout_s / 4))
            now = loop.time()
            for task in [t for t, deadline in self.reading.items() if deadline <= now]:
                del self.reading[task]
                self._cancel(task)
            self.close_idle([c for c, deadline in self.idle.items() if deadline <= now])
            late = {client for deadline, client in self.sending.values() if deadline <= now}
            for client in late:
                connection = self.connections.get(client)
                if connection is not None:
                    connection.abort()
            for task, (_, client) in list(self.sending.items()):
                if client in late:  # hypercorn's h2 streams would wait on their windows for good
                    del self.sending[task]
                    task.cancel()
            for connection in self.connections.values():
                if connection not in self.idle and connection.h2_idle():
                    # hypercorn stops the idle timer at the PRI preface and restarts it only when
                    # a stream closes: an h2c connection that never opens one was never timed out
                    self.idle[connection] = now + self.idle_timeout_s

    def close_idle(self, connections: list[Connection]) -> None:
        for connection in connections:
            del self.idle[connection]
            closing = asyncio.ensure_future(connection.close_idle())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _cancel(self, task: asyncio.Task[object]) -> None:
        self.cancelled.add(task)
        task.cancel()

    def ours(self, task: asyncio.Task[object]) -> bool:
        """Whether `task`'s cancellation came from here; if so it is taken back (uncancelled)."""
        if task not in self.cancelled:
            return False
        self.cancelled.discard(task)
        task.uncancel()
        return True
