"""TLS for the public ports: the server-side `ssl.SSLContext` of gRPC (Triton's `--grpc-use-ssl`,
`--grpc-use-ssl-mutual`, `--grpc-server-cert`, `--grpc-server-key`, `--grpc-root-cert`) and of
REST (`server.http_use_ssl` and its siblings), and of the metrics port (`server.metrics_use_ssl`,
with REST's files), built from the configuration's PEM files.

TLS 1.2 or newer; ALPN offers `h2` on gRPC (gRPC clients require it) and `http/1.1` on REST. With
mutual TLS a client must present a certificate that chains to the root certificates, or the
handshake fails; a plain-text client fails the handshake too (the connection is closed).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Literal

from hloserve.config import ServerConfig
from hloserve.errors import ConfigError

__all__ = ["server_context"]


def server_context(
    config: ServerConfig, protocol: Literal["grpc", "http", "metrics"]
) -> ssl.SSLContext | None:
    """The TLS context of `protocol`'s port, or None when it serves plain text; a file that
    cannot be read (or a key that does not match) is a `ConfigError` naming its field. The
    metrics port (`server.metrics_use_ssl`) serves REST's certificate."""
    if protocol == "metrics":
        if not config.metrics_use_ssl:
            return None
        protocol = "http"
    elif not (config.grpc_tls if protocol == "grpc" else config.http_tls):
        return None
    cert: Path | None = getattr(config, f"{protocol}_server_cert")
    key: Path | None = getattr(config, f"{protocol}_server_key")
    root: Path | None = getattr(config, f"{protocol}_root_cert")
    assert cert is not None and key is not None  # ServerConfig.validate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"] if protocol == "grpc" else ["http/1.1"])
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        where = f"server.{protocol}_server_cert"
        raise ConfigError(where, f"cannot load {cert} with key {key}: {e}") from None
    if getattr(config, f"{protocol}_use_ssl_mutual"):
        assert root is not None
        try:
            context.load_verify_locations(cafile=root)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"server.{protocol}_root_cert", f"cannot load {root}: {e}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        context.verify_mode = ssl.CERT_NONE
    return context
