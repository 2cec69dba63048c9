"""What every hostile test needs: a good request that must still succeed, a server's resident
memory, and a worker in a subprocess (for what can kill or starve a process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import tritonclient.grpc as grpcclient
from conftest import EXAMPLES, ROOT

__all__ = ["ServerProcess", "assert_serves", "free_port", "rss_bytes", "server_process"]


def assert_serves(url: str, timeout: float = 10) -> None:
    """A good MLP request on a fresh connection answers OK with the right shape."""
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
        result = client.infer("mlp", [tensor], client_timeout=timeout)
        assert result.as_numpy("OUTPUT0").shape == (2, 4)
    finally:
        client.close()


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (default: this one), from /proc."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    port: int
    log: Path
    """The server's output (JSON log lines)."""

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def server_process(
    *args: str,
    repository: Path = EXAMPLES,
    env: Mapping[str, str] | None = None,
    preexec_fn: object = None,
    timeout: float = 120,
) -> Iterator[ServerProcess]:
    """`hloserve serve` in a subprocess on a free port, ready when yielded, killed after.

    Output goes to a file so a chatty server never blocks on a full pipe; it is shown when
    the server fails to start.
    """
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="hloserve-", suffix=".log")
    command = [
        sys.executable, "-m", "hloserve.cli", "serve", "--model-repository", str(repository),
        "--grpc-port", str(port), "--metrics-port", "-1", *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "HLOSERVE_LOGGING_FORMAT": "json", **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,  # type: ignore[arg-type]
    )
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            assert process.poll() is None, f"server exited with {process.returncode}: {_tail(log)}"
            assert time.monotonic() < deadline, f"server did not become ready: {_tail(log)}"
            time.sleep(0.2)
        client.close()
        yield ServerProcess(process, port, Path(log.name))
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        log.close()


def _tail(log: IO[str], lines: int = 20) -> str:
    log.flush()
    return "".join(Path(log.name).read_text().splitlines(keepends=True)[-lines:])
