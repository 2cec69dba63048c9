"""HTTP/1.1 on the REST port as RFC 9112 frames it, over hypercorn's H11 protocol.

h11 frames a request that has both Content-Length and Transfer-Encoding by the chunked coding,
as RFC 9112 section 6.3 allows, but hands both headers on and keeps the connection open; the
app, trusting the length, read fewer bytes than it declared (request smuggling); and it folds
repeated Content-Lengths that agree into one. `StrictH11` refuses both with 400 and closes the
connection (the RFC's "MUST close"), answers the errors h11 finds itself (conflicting lengths, a
bad chunk) with a JSON body that names them, and when `server.http2` is off refuses the HTTP/2
preface (505) and ignores `Upgrade: h2c` instead of switching protocols.

h11 has no hook for a request's header lines as sent, so `_StrictConnection` wraps the reader
of a request head (private to h11: `REQUIRES`) to see them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import h11
import h11._readers
from hypercorn.protocol.h11 import H11Protocol

from hloserve._transport.requirements import Requires

__all__ = ["REQUIRES", "Refused", "StrictH11"]

REQUIRES = Requires(
    __name__,
    "h11",
    "0.16.0",
    members=(
        "h11._readers.maybe_read_from_IDLE_client",
        "h11._receivebuffer.ReceiveBuffer.maybe_extract_lines",
        "h11._receivebuffer.ReceiveBuffer.is_next_line_obviously_invalid_request_line",
    ),
    parameters={
        "h11._connection.Connection._get_io_object": ("self", "role", "event", "io_dict"),
        "h11._readers.maybe_read_from_IDLE_client": ("buf",),
    },
)
"""What `_StrictConnection` reaches into: the reader h11 uses for a request head, and the two
methods of its receive buffer that reader calls."""


class Refused(Exception):
    """A request answered and its connection to be closed at once: the answer has been sent."""


def _answer(status: int, message: str) -> list[h11.Response | h11.Data | h11.EndOfMessage]:
    body = json.dumps({"error": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return [h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()]


def _lowered(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value.strip().lower()) for name, value in headers]


def framing_problem(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request's framing headers are ambiguous (RFC 9112 section 6.3), or None."""
    names = [name.lower() for name, _ in headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        return (
            "the request has both Content-Length and Transfer-Encoding; send one "
            "(RFC 9112 section 6.3: its framing is ambiguous)"
        )
    return None


class _HeadLines:
    """A receive buffer as h11's head reader uses it, keeping the lines it takes."""

    def __init__(self, buffer: Any) -> None:
        self._buffer, self.lines = buffer, None

    def maybe_extract_lines(self) -> Any:
        self.lines = self._buffer.maybe_extract_lines()
        return self.lines

    def is_next_line_obviously_invalid_request_line(self) -> bool:
        return bool(self._buffer.is_next_line_obviously_invalid_request_line())


def _read_head(buffer: Any) -> h11.Request | None:
    """h11's reader of a request head, refusing repeated Content-Lengths (h11 refuses those that
    disagree, and folds those that agree)."""
    watched = _HeadLines(buffer)
    request = h11._readers.maybe_read_from_IDLE_client(watched)  # type: ignore[arg-type]  # duck-typed
    if request is not None and watched.lines:
        values = [
            value for name, _, value in (line.partition(b":") for line in watched.lines[1:])
            if name.lower() == b"content-length"
        ]  # fmt: skip
        if len(values) > 1 or b"," in b"".join(values):
            # h11 answers this as RemoteProtocolError: 400, and the connection closed
            raise h11.LocalProtocolError("the request repeats Content-Length; send it once")
    return request


class _StrictConnection(h11.Connection):
    """h11's server connection, reading request heads with `_read_head`."""

    def _get_io_object(self, role: Any, event: Any, io_dict: Any) -> Any:
        io = super()._get_io_object(role, event, io_dict)
        return _read_head if io is h11._readers.maybe_read_from_IDLE_client else io


class StrictH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, refusing requests whose framing is ambiguous; `http2` says
    whether a connection may switch to HTTP/2 (h2c)."""

    http2 = False
    refuse_body: Callable[[h11.Request], str | None] | None = None
    """Why the body of a request would be refused, known from its head (the routes' bounds); a
    request that waits for `100 Continue` is answered 413 instead, and never told to send it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.connection = _StrictConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    async def _refuse(self, status: int, message: str) -> None:
        for event in _answer(status, message):
            await self._send_h11_event(event)
        raise Refused(message)

    async def _check_protocol(self, event: h11.Request) -> None:
        problem = framing_problem(event.headers)
        if problem is not None:
            await self._refuse(400, problem)
        if self.refuse_body is not None and (b"expect", b"100-continue") in _lowered(event.headers):
            problem = self.refuse_body(event)
            if problem is not None:  # before hypercorn's loop sends the 100 (its next turn)
                await self._refuse(413, problem)
        if self.http2:
            return await super()._check_protocol(event)
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            await self._refuse(
                505,
                "HTTP/2 without TLS (h2c) is off on this port (server.http2); speak HTTP/1.1 "
                "or use the gRPC port",
            )
        # An `Upgrade: h2c` is ignored (RFC 9110 section 7.8 lets a server ignore an upgrade):
        # the request is answered in HTTP/1.1.

    async def _send_error_response(self, status_code: int) -> None:
        """hypercorn's answer to what h11 refused, with a JSON body that names the problem (the
        h11 error being handled)."""
        error = sys.exception()
        problem = str(error) if isinstance(error, h11.RemoteProtocolError) else "a malformed request"
        message = f"the request is not valid HTTP/1.1: {problem}"[:200]
        if status_code == 431:
            message = (
                f"the request line and headers pass the server's limit of "
                f"{self.config.h11_max_incomplete_size} bytes (server.http_max_header_bytes)"
            )
        for event in _answer(status_code, message):
            await self._send_h11_event(event)
