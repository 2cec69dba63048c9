"""Certificates for TLS tests, made with `openssl` into a test's directory: a CA, a server
certificate for 127.0.0.1 and localhost, a client certificate, all signed by the CA, and a
second CA (and a client of it) that the server does not trust."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certificates", "make_certificates"]


@dataclass(frozen=True, slots=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    """A client certificate signed by another CA."""
    stranger_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
    )  # fmt: skip
    return cert, key


def _signed(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, request = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", request, "-subj", f"/CN={name}",
    )  # fmt: skip
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    """Make every file under `directory` (a test's tmp_path)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    server = _signed(
        directory, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    client = _signed(directory, "client", ca, "extendedKeyUsage=clientAuth\n")
    other = _ca(directory, "other-ca")
    stranger = _signed(directory, "stranger", other, "extendedKeyUsage=clientAuth\n")
    return Certificates(ca[0], server[0], server[1], client[0], client[1], stranger[0], stranger[1])
