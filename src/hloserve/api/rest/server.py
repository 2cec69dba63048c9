"""The KServe V2 REST server: hypercorn serving the routes (`hloserve.api.rest.routes`) in the
worker's own trio run, on the trio-asyncio loop that hosts grpclib.

hypercorn's asyncio worker rather than its trio one: the service's handlers are asyncio
coroutines (the model queues answer asyncio futures), and reaching them from trio costs a
trio-asyncio hop per call (server CPU per tiny request 0.38 ms against 0.31 ms). On the same
loop as grpclib, a REST request runs where a gRPC one does. Connections, heads and the time a
head takes are bounded by `server.http_*` (see `RestServer`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from typing import Any

import hypercorn.asyncio.tcp_server
import hypercorn.config
import hypercorn.utils
import structlog
import trio
import trio_asyncio
from hypercorn.asyncio.worker_context import WorkerContext

from hloserve._transport import h11_strict as _h11_strict
from hloserve._transport import hypercorn_connection as _hypercorn
from hloserve._transport.h2_limits import CONNECTIONS, default_max_connections
from hloserve._transport.hypercorn_connection import HypercornConnection, listen
from hloserve._transport.requirements import check
from hloserve.api.rest.routes import App
from hloserve.config import ServerConfig
from hloserve.tls import server_context

log = structlog.get_logger("hloserve.rest")

__all__ = ["RestServer"]


_READ_BYTES = 1 << 20
"""Bytes hypercorn takes from a connection's buffer per read (its default is 64 KiB)."""


def _refusal(key: str, cap: int) -> bytes:
    """The whole answer to a connection past `server.http_max_connections` or the process's
    `server.max_open_connections`."""
    body = json.dumps({"error": f"{key} ({cap}) reached; retry later"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


class RestServer:
    """hypercorn serving the REST app on `server.host`:`server.http_port` until `stop()`.

    hypercorn's own accept loop (`worker_serve`) has no connection cap, so this one runs its
    connection handler (`TCPServer`) itself: past `server.http_max_connections` a new connection
    is answered 503 with a JSON error and closed at once, never read (a client that had already
    sent its request may see the close as a reset). h11 bounds a request head still arriving
    (`server.http_max_header_bytes`: 431 and close) and the app one that came whole (431); the
    sweep of `InFlight` closes a connection without a whole head for
    `server.http_idle_timeout_s` and answers 408 to a body slower than
    `server.http_body_timeout_s`.
    """

    def __init__(self, app: App, config: ServerConfig, *, reuse_port: bool = False) -> None:
        self._app = app
        self._config = config
        self._reuse_port = reuse_port
        """Share the port (SO_REUSEPORT) with sibling processes: the frontends."""
        self._stop = trio.Event()
        self.stopped = trio.Event()
        """Set once every connection is closed (after `stop()`, within the grace period)."""
        self.connections = 0
        """Connections open now (refused ones are never counted)."""

    @property
    def receiving_bytes(self) -> int:
        """Bytes of request bodies being received now."""
        return self._app.routes.bodies.receiving

    @property
    def inferring(self) -> int:
        """Inference requests whose answer the service is working on now."""
        return len(self._app.inflight.serving)

    def stop(self) -> None:
        """Stop accepting connections; those open finish their requests within the grace period."""
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound port, serve until stopped; an address in use raises OSError."""
        check(_hypercorn.REQUIRES, _h11_strict.REQUIRES)
        settings = hypercorn.config.Config()
        settings.graceful_timeout = self._config.shutdown_grace_s
        settings.h11_max_incomplete_size = self._config.http_max_header_bytes
        settings.h2_max_concurrent_streams = self._config.max_concurrent_streams
        settings.h2_max_header_list_size = self._config.http_max_header_bytes
        settings.accesslog = settings.errorlog = None  # the routes answer and log what goes wrong
        # 64 KiB per read made a 4.8 MB body 75 passes through h11 and the ASGI queue.
        hypercorn.asyncio.tcp_server.MAX_RECV = _READ_BYTES
        tls = server_context(self._config, "http")  # a bad file: ConfigError before binding
        try:
            sock = listen(self._config.host, self._config.http_port, settings.backlog, self._reuse_port)
            task_status.started(sock.getsockname()[1])
            await trio_asyncio.aio_as_trio(self._serve)(sock, settings, tls)
        finally:
            self.stopped.set()

    async def _serve(
        self, sock: socket.socket, settings: hypercorn.config.Config, tls: ssl.SSLContext | None
    ) -> None:
        """hypercorn's `worker_serve` for one TCP socket (TLS with `tls`), with the connection cap."""
        loop = asyncio.get_running_loop()
        app = hypercorn.utils.wrap_app(self._app, settings.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
        context = WorkerContext(None)
        state: dict[str, Any] = {}
        cap = self._config.http_max_connections or default_max_connections()
        refusal = _refusal("server.http_max_connections", cap)
        open_: set[asyncio.Task[Any]] = set()
        inflight = self._app.inflight

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(open_) >= cap:
                writer.write(refusal)
                writer.close()
                return
            if not CONNECTIONS.take():  # the process's budget, shared with gRPC and metrics
                writer.write(_refusal("server.max_open_connections", CONNECTIONS.cap))
                writer.close()
                return
            # asyncio's recv size (256 KiB) made a 4.8 MB body 19 passes through the stack
            writer.transport.max_size = _READ_BYTES  # type: ignore[attr-defined]
            task = asyncio.current_task()
            assert task is not None
            open_.add(task)
            self.connections = len(open_)
            peer = writer.get_extra_info("peername")  # as hypercorn names the client in the scope
            family = writer.get_extra_info("socket").family
            client = None if peer is None else hypercorn.utils.parse_socket_addr(family, peer)
            connection = inflight.connections[client] = HypercornConnection(
                inflight, client, self._config.http2, self._app.routes.bodies.refusal_from_head,
                app, loop, settings, context, state, reader, writer,
            )  # fmt: skip
            try:
                await connection
            except Exception:
                # e.g. priority.TooManyStreamsError out of hypercorn's H2 protocol: left to the
                # accept loop, it ended the worker. Only this connection ends.
                log.exception("REST connection failed; closed it", client=str(client)[:80])
                writer.transport.abort()
            finally:
                del inflight.connections[client]
                CONNECTIONS.give()
                open_.discard(task)
                self.connections = len(open_)

        server = await asyncio.start_server(
            connected,
            sock=sock,
            backlog=settings.backlog,
            limit=_READ_BYTES,
            ssl=tls,
            ssl_handshake_timeout=self._config.handshake_timeout_s if tls is not None else None,
        )
        sweep = loop.create_task(inflight.sweep())
        try:
            await trio_asyncio.trio_as_aio(self._stop.wait)()
        finally:
            sweep.cancel()
            await context.terminated.set()  # busy connections close after their request
            inflight.close_idle(list(inflight.idle))
            server.close()
            await server.wait_closed()
            if open_:
                _, late = await asyncio.wait(open_, timeout=settings.graceful_timeout)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late)
