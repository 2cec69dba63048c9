"""Compiled executables kept on disk, so a restart loads them instead of compiling again.

An entry is keyed by the SHA-256 of the module's bytes, the bundle's XLA options and what a
serialized executable depends on (jaxlib's version, the platform, the device kind, XLA_FLAGS),
so an upgrade, another GPU or other compiler flags never pick up a foreign entry. A stale or
corrupt entry is logged, recompiled and replaced. Entries are written to a temporary name and
renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import structlog

from hloserve.models import _xla

__all__ = ["ExecutableCache", "default_directory"]

log = structlog.get_logger("hloserve.executable_cache")


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hloserve" / "executables"


class ExecutableCache:
    """A folder of serialized executables; `compile` consults it before compiling."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.hits = 0
        self.misses = 0

    def key(self, source: str | bytes, options: _xla.XlaOptions | None = None) -> str:
        digest = hashlib.sha256(_xla.runtime_identity(options).encode())
        if options:
            digest.update(f"; XLA options {sorted(options.items())!r}".encode())
        digest.update(source.encode() if isinstance(source, str) else source)
        return digest.hexdigest()

    def compile(self, source: str | bytes, options: _xla.XlaOptions | None = None) -> _xla.Executable:
        """The executable for `source` compiled with XLA `options`, from the cache when it holds
        a good entry (blocking)."""
        path = self.directory / f"{self.key(source, options)}.xla"
        if path.exists():
            try:
                executable = _xla.deserialize_executable(path.read_bytes(), options)
            except Exception as e:  # whatever jaxlib raises for a blob it cannot read
                log.warning(
                    "executable cache entry unreadable; recompiling", path=str(path), error=str(e)[:200]
                )
            else:
                self.hits += 1
                return executable
        executable = _xla.compile_module(source, options)
        self.misses += 1
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, suffix=".tmp") as f:
                f.write(_xla.serialize_executable(executable))
            os.replace(f.name, path)
        except OSError as e:  # a read-only or full disk costs start-up time, not service
            log.warning("cannot write executable cache entry", path=str(path), error=str(e))
        return executable
