"""The gRPC server of a process that serves the protocol (the single-process worker, each
frontend): one `GracefulServer` built, started and shut down the same way in both."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import Any

import trio_asyncio
from grpclib.config import Configuration

from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve._transport.h2_limits import CONNECTIONS
from hloserve.api.wire_codec import KnownFieldsCodec
from hloserve.config import ServerConfig
from hloserve.restricted import Restrictions, restrict_grpc

__all__ = ["build_grpc_server", "shut_down", "start"]


def build_grpc_server(
    config: ServerConfig, services: Sequence[Any], health: Callable[[Callable[[], bool]], Any]
) -> _grpclib_patches.GracefulServer:
    """`services` and the Health service `health(draining)` makes, within the configured limits
    and restrictions. grpclib looks up the event loop when constructed: call it inside
    trio-asyncio's loop."""
    server = _grpclib_patches.GracefulServer(
        [*services, health(lambda: server.draining)],
        config=Configuration(
            http2_connection_window_size=_grpclib_patches.WINDOW_BYTES,
            http2_stream_window_size=_grpclib_patches.WINDOW_BYTES,
        ),
        codec=KnownFieldsCodec(),
        limits=_grpclib_patches.TransportLimits.from_config(config),
    )
    restrict_grpc(server, Restrictions.grpc(config.grpc_restricted_protocol))
    CONNECTIONS.configure(config.max_open_connections)
    return server


async def start(
    server: _grpclib_patches.GracefulServer,
    config: ServerConfig,
    port: int,
    tls: ssl.SSLContext | None,
    *,
    reuse_port: bool = False,
) -> None:
    """Listen on `config.host`:`port` (`reuse_port`: beside the other frontends)."""
    options = {"reuse_port": True} if reuse_port else {}
    await trio_asyncio.aio_as_trio(server.start)(
        config.host, port, ssl=tls, handshake_timeout_s=config.handshake_timeout_s, **options
    )


async def shut_down(server: _grpclib_patches.GracefulServer, config: ServerConfig) -> None:
    """Let running calls finish for `server.shutdown_grace_s`, then close."""
    await trio_asyncio.aio_as_trio(server.shutdown)(config.shutdown_grace_s)
