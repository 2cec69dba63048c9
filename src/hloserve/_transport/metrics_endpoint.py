"""The HTTP/1.1 endpoint of a metrics port (a worker's, the node's), bounded as the other
listeners are: at most `server.metrics_max_connections` connections, each counted in the
process's `server.max_open_connections`; one GET or HEAD per connection, its head within
`server.metrics_timeout_s` and 8 KiB, its answer read within the same timeout (making the answer
is the server's time, not the client's: scrapers on a loaded machine once had their connections
closed unanswered); TLS with `server.metrics_use_ssl`, its handshake within the same timeout; a
listen backlog of 1024, so that a crowd of scrapers queues instead of being reset.
prometheus_client's own server took a thread and a descriptor per connection, with no cap or
timeout and a backlog of 5.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog

from hloserve._transport.h2_limits import CONNECTIONS

__all__ = ["Answer", "MetricsEndpoint"]

BACKLOG = 1024
"""The listen backlog: 50 scrapers at once are queued, not reset."""
MAX_HEAD_BYTES = 8 << 10
"""A scrape's request line and headers."""
log = structlog.get_logger("hloserve.metrics")


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    content_type: str
    body: bytes


Route = Callable[[], Awaitable[Answer]]


class MetricsEndpoint:
    """Serves `routes` (a path to what answers it) on an asyncio loop; any other path is 404
    naming the paths served, any other method 405."""

    def __init__(self, routes: Mapping[bytes, Route], max_connections: int, timeout_s: float) -> None:
        self._routes = routes
        self._cap, self._timeout_s = max_connections, timeout_s
        self._open = 0
        """Connections open now."""
        self._server: asyncio.Server | None = None
        self.port = 0
        """The bound port, once started."""
        self._expected = b"expected GET " + b", ".join(sorted(p for p in routes if p != b"/")) + b"\n"

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on `host:port` (HTTPS with `tls`) on the running asyncio loop; the bound port."""
        self._server = await asyncio.start_server(
            self._connected,
            host,
            port,
            backlog=BACKLOG,
            limit=MAX_HEAD_BYTES,
            ssl=tls,
            ssl_handshake_timeout=self._timeout_s if tls is not None else None,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self._cap:
            return _refuse(writer, f"server.metrics_max_connections ({self._cap}) reached; retry later")
        if not CONNECTIONS.take():
            return _refuse(writer, f"server.max_open_connections ({CONNECTIONS.cap}) reached; retry later")
        self._open += 1
        try:
            async with asyncio.timeout(self._timeout_s):  # the client's part: its request
                head = await reader.readuntil(b"\r\n\r\n")
            request = head.split(b"\r\n", 1)[0].split()
            route = self._routes.get(request[1].split(b"?")[0]) if len(request) >= 2 else None
            if len(request) < 2 or request[0] not in (b"GET", b"HEAD"):
                answer = Answer(405, "Method Not Allowed", "text/plain", self._expected)
            elif route is None:
                answer = Answer(404, "Not Found", "text/plain", self._expected)
            else:
                answer = await route()  # ours, bounded by server.metrics_max_models, not timed out
            writer.write(_encode(answer, head_only=request[0] == b"HEAD"))
            async with asyncio.timeout(self._timeout_s):  # the client's part: reading the answer
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # slow, silent, oversized or gone: closed
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            self._open -= 1
            CONNECTIONS.give()
            writer.close()


def _encode(answer: Answer, head_only: bool = False) -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
        answer.status,
        answer.reason.encode(),
        answer.content_type.encode(),
        len(answer.body),
    )
    return head if head_only else head + answer.body


def _refuse(writer: asyncio.StreamWriter, message: str) -> None:
    writer.write(_encode(Answer(503, "Service Unavailable", "text/plain", message.encode() + b"\n")))
    writer.close()
