"""Talking to a worker: a request, a good request that must still succeed, a readiness wait, a
free port, and a process's resident memory."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from tritonclient.utils import np_to_triton_dtype

from hloserve._proto import hloserve_control as hc
from hloserve.fleet.workers import free_port  # as a node's: no other test's connection takes it

from .numerics import assert_close

__all__ = [
    "assert_control_refused",
    "assert_good_request_served",
    "assert_serves",
    "control",
    "free_port",
    "infer",
    "rss_bytes",
    "wait_ready",
    "wait_until",
]

T = TypeVar("T")


class _Listening(Protocol):
    @property
    def grpc_port(self) -> int: ...


def infer(
    client: grpcclient.InferenceServerClient,
    model: str,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str | grpcclient.InferRequestedOutput] = (),
    **kwargs: Any,
) -> grpcclient.InferResult:
    """One tritonclient request: `inputs` by name (datatype from the array), `outputs` requested
    by name or as `InferRequestedOutput` (all when empty), `kwargs` passed to `client.infer`."""
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    requested = [
        o if isinstance(o, grpcclient.InferRequestedOutput) else grpcclient.InferRequestedOutput(o)
        for o in outputs
    ] or None
    return client.infer(model, tensors, outputs=requested, **kwargs)


def assert_serves(url: str, timeout: float = 10) -> None:
    """A good MLP request on a fresh connection answers OK with the right shape."""
    client = grpcclient.InferenceServerClient(url)
    try:
        result = infer(client, "mlp", {"INPUT0": np.ones((2, 16), np.float32)}, client_timeout=timeout)
        assert result.as_numpy("OUTPUT0").shape == (2, 4)
    finally:
        client.close()


def assert_good_request_served(client: grpcclient.InferenceServerClient) -> None:
    """A good MLP request through `client` answers what the model computes in-process."""
    x = np.random.default_rng(0).random((2, 16), dtype=np.float32)
    result = infer(client, "mlp", {"INPUT0": x})
    assert_close(result.as_numpy("OUTPUT0"), reference("mlp", x))


def control(worker: _Listening, call: Callable[[hc.ControlServiceStub], Awaitable[T]]) -> T:
    """Run one call of the control stub on a plain asyncio loop."""

    async def main() -> T:
        channel = Channel("127.0.0.1", worker.grpc_port)
        try:
            return await call(hc.ControlServiceStub(channel))
        finally:
            channel.close()

    return asyncio.run(main())


def assert_control_refused(
    worker: _Listening,
    calls: Iterable[Callable[[hc.ControlServiceStub], Awaitable[Any]]],
    status: Status,
    says: str,
) -> None:
    """Each control call is refused with `status` and a message that says `says`."""
    for call in calls:
        with pytest.raises(GRPCError) as raised:
            control(worker, call)
        assert raised.value.status == status, raised.value
        assert says in (raised.value.message or "")


def wait_until(
    condition: Callable[[], object], timeout: float, what: str, output: Callable[[], str] = str
) -> None:
    """Poll `condition` (an exception counts as not yet) every 0.1 s until it holds; fail at
    `timeout` naming `what`, with `output()` (a log's tail) to say what went wrong."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; {output()}")


def wait_ready(
    url: str,
    process: subprocess.Popen[Any] | None = None,
    timeout: float = 120,
    output: Callable[[], str] = str,
) -> None:
    """Poll `url` until the server says it is ready; fail at `timeout`, or at once when `process`
    (the server, where the test started one) has exited. `output()` tells what went wrong."""
    client = grpcclient.InferenceServerClient(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            if process is not None:
                assert process.poll() is None, f"server exited with {process.returncode}: {output()}"
            assert time.monotonic() < deadline, f"server at {url} did not become ready: {output()}"
            time.sleep(0.2)
    finally:
        client.close()


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (default: this one), from /proc."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def http_answer(sock: socket.socket, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read from a raw socket: status, headers (lower
    case), body."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed in the middle of an answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body
