"""hypercorn's connection handler under an accept loop of hloserve's own (the connection cap):
the socket as hypercorn makes one, the handler with its idle-timeout task and its HTTP/1.1
protocol replaced, and what both reach into inside hypercorn (`REQUIRES`).

The handler knows nothing of the REST routes: what it needs from them is a `ConnectionWatch`
(idle deadlines, told when a client goes) and a function that refuses a body from its head.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import h11
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.events import Closed
from hypercorn.protocol.h2 import H2Protocol

from hloserve._transport.h11_strict import Refused, StrictH11
from hloserve._transport.requirements import Requires

if TYPE_CHECKING:
    from hypercorn.asyncio.task_group import TaskGroup

__all__ = ["REQUIRES", "ConnectionWatch", "HypercornConnection", "listen"]

REQUIRES = Requires(
    __name__,
    "hypercorn",
    "0.18.0",
    members=(
        "hypercorn.asyncio.tcp_server.MAX_RECV",
        "hypercorn.asyncio.tcp_server.TCPServer._read_data",
        "hypercorn.protocol.h11.H11Protocol._check_protocol",
        "hypercorn.protocol.h11.H11Protocol._send_error_response",
        "hypercorn.protocol.h11.H11Protocol._send_h11_event",
        "hypercorn.protocol.ProtocolWrapper.handle",
        "hypercorn.asyncio.tcp_server.TCPServer._initiate_server_close",
        "hypercorn.asyncio.tcp_server.TCPServer.idle_task",
        "hypercorn.asyncio.tcp_server.TCPServer.writer",
        "hypercorn.asyncio.worker_context.WorkerContext.terminated",
        "hypercorn.utils.wrap_app",
        "hypercorn.utils.parse_socket_addr",
    ),
    parameters={
        "hypercorn.asyncio.tcp_server.TCPServer.__init__": (
            "self", "app", "loop", "config", "context", "state", "reader", "writer"
        ),
        "hypercorn.asyncio.worker_context.WorkerContext.__init__": ("self", "max_requests"),
        "hypercorn.protocol.h11.H11Protocol.__init__": (
            "self", "app", "config", "context", "task_group", "connection_state", "ssl", "client",
            "server", "send",
        ),
    },
)  # fmt: skip
"""What the REST server reaches into: it runs hypercorn's connection handler under its own accept
loop (the connection cap), replaces its idle-timeout task and its HTTP/1.1 protocol
(`HypercornConnection`, `StrictH11`), and sets the bytes it reads at once (`MAX_RECV`)."""


def listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket, as hypercorn makes one, closed again when it cannot bind
    (hypercorn's own leaks it); `reuse_port` shares the port with sibling processes."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class ConnectionWatch(Protocol):
    """What watches the connections (the REST server's `InFlight`): each idle connection's
    deadline, swept by the watch, and a client's requests to cancel when it goes."""

    @property
    def idle_timeout_s(self) -> float: ...
    @property
    def idle(self) -> MutableMapping[Any, float]: ...
    def disconnected(self, client: Hashable) -> None: ...


class HypercornConnection(TCPServer):
    """hypercorn's connection handler, which tells its watch when its client has gone, keeps its
    idle deadline with the watch instead of an idle-timeout task, speaks HTTP/1.1 through
    `StrictH11` (h2c only if `http2`) and refuses a body from its head with `refuse_body(path,
    headers)` (a reason, or None to read it). What its protocol raises leaves `run` (whose task
    group cancels the connection's streams) and is for the accept loop to contain."""

    def __init__(
        self,
        watch: ConnectionWatch,
        client: Hashable,
        http2: bool,
        refuse_body: Callable[[str, dict[str, str]], object | None],
        *args: Any,
    ) -> None:
        super().__init__(*args)
        self._watch, self._client, self._http2, self._refuse = watch, client, http2, refuse_body
        self.idle_task = _IdleDeadline(watch, self)  # type: ignore[assignment]  # duck-typed

    async def _read_data(self) -> None:
        wrapper = self.protocol  # made by `run` before it reads, with nothing read yet
        h11 = StrictH11(
            wrapper.app, wrapper.config, wrapper.context, wrapper.task_group, wrapper.state,
            wrapper.ssl, wrapper.client, wrapper.server, wrapper.send,
        )  # fmt: skip
        h11.http2 = self._http2
        h11.refuse_body = self._refuse_body
        wrapper.protocol = h11
        try:
            await super()._read_data()  # until the client closes (or the connection fails)
        except Refused:
            await self.protocol.handle(Closed())  # answered, and the connection closes
        finally:
            self._watch.disconnected(self._client)

    def _refuse_body(self, event: h11.Request) -> str | None:
        """Why this request's body would be refused, from its head (`StrictH11`)."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        path = event.target.decode("latin-1").partition("?")[0]
        refusal = self._refuse(path, headers)
        return None if refusal is None else str(refusal)

    async def close_idle(self) -> None:
        await self._initiate_server_close()

    def h2_idle(self) -> bool:
        """Whether this connection speaks h2c and has no stream open."""
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        return isinstance(protocol, H2Protocol) and not protocol.streams

    def abort(self) -> None:
        """Drop the connection now, with whatever it has not sent (a close would wait for it)."""
        self.writer.transport.abort()


class _IdleDeadline:
    """Stands in for hypercorn's idle-timeout task (`AsyncioSingleTask`): `restart` when the
    connection goes idle sets its deadline with the watch, `stop` when a request head arrives
    clears it."""

    def __init__(self, watch: ConnectionWatch, connection: HypercornConnection) -> None:
        self._watch, self._connection = watch, connection

    async def restart(self, task_group: TaskGroup, action: Callable[[], Awaitable[None]]) -> None:
        self._watch.idle[self._connection] = asyncio.get_running_loop().time() + self._watch.idle_timeout_s

    async def stop(self) -> None:
        self._watch.idle.pop(self._connection, None)
