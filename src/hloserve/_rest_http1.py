"""HTTP/1.1 on the REST port as RFC 9112 frames it, over hypercorn's H11 protocol.

h11 frames a request that has both Content-Length and Transfer-Encoding by the chunked coding,
as RFC 9112 section 6.3 allows, but hands both headers on and keeps the connection open; the
app, trusting the length, read fewer bytes than it declared (request smuggling). `StrictH11`
refuses such a request with 400 and closes the connection (the RFC's "MUST close"), answers the
errors h11 finds itself (conflicting lengths, a bad chunk) with a JSON body that names them, and
when `server.http2` is off refuses the HTTP/2 preface (505) and ignores `Upgrade: h2c` instead
of switching protocols.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import h11
from hypercorn.protocol.h11 import H11Protocol

__all__ = ["Refused", "StrictH11"]


class Refused(Exception):
    """A request answered and its connection to be closed at once: the answer has been sent."""


def _answer(status: int, message: str) -> list[Any]:
    body = json.dumps({"error": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return [h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()]


def framing_problem(headers: Any) -> str | None:
    """Why a request's framing headers are ambiguous (RFC 9112 section 6.3), or None."""
    names = [name.lower() for name, _ in headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        return (
            "the request has both Content-Length and Transfer-Encoding; send one "
            "(RFC 9112 section 6.3: its framing is ambiguous)"
        )
    return None


class StrictH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, refusing requests whose framing is ambiguous; `http2` says
    whether a connection may switch to HTTP/2 (h2c)."""

    http2 = False

    async def _refuse(self, status: int, message: str) -> None:
        for event in _answer(status, message):
            await self._send_h11_event(event)
        raise Refused(message)

    async def _check_protocol(self, event: h11.Request) -> None:
        problem = framing_problem(event.headers)
        if problem is not None:
            await self._refuse(400, problem)
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
