"""Shared fixtures: a real worker on a loopback port, in a thread of the test process.

The worker runs its own `trio.run` in a background thread so that blocking clients
(tritonclient, perf_analyzer) can call it from the test's thread.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from hloserve.config import Config, load_config

# A server that a test starts in a subprocess takes a free REST port, never Triton's fixed 8000
# (tests and other checkouts run side by side).
os.environ.setdefault("HLOSERVE_SERVER_HTTP_PORT", "0")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "repository"


class ServerThread:
    """A worker serving `config` in a background thread until `stop()`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._started: queue.Queue[Any] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self.worker: Any = None

    async def _main(self) -> None:
        from hloserve.worker import serve

        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with serve(self.config) as worker:
                self.worker = worker
                self._started.put(worker)
                await self._stop.wait()
        except BaseException as e:
            self._started.put(e)
            raise

    def start(self, timeout: float = 120) -> ServerThread:
        self._thread.start()
        started = self._started.get(timeout=timeout)
        if isinstance(started, BaseException):
            raise RuntimeError("worker failed to start") from started
        return self

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the worker's own thread (the event loop's), and return its result (an
        async `fn` is awaited there)."""
        if inspect.iscoroutinefunction(fn):
            return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)
        return trio.from_thread.run_sync(lambda: fn(*args, **kwargs), trio_token=self._token)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.worker.grpc_port}"

    def stop(self, timeout: float = 60) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker thread did not stop"


def make_config(
    repository: Path = EXAMPLES, scheduler: dict[str, Any] | None = None, **server: Any
) -> Config:
    """The default config on free ports, plus overrides of `server` fields and `scheduler` ones."""
    config = load_config(environ={})
    server = {"grpc_port": 0, "metrics_port": 0, "http_port": 0, **server}
    config = config.replace("server", model_repository=repository, **server)
    return config.replace("scheduler", **scheduler) if scheduler else config


@pytest.fixture(scope="session", name="server")
def _server() -> Iterator[ServerThread]:
    """One worker on the example repository, shared by the tests that only read from it."""
    server = ServerThread(make_config()).start()
    yield server
    server.stop()


@pytest.fixture(name="triton")
def _triton(server: ServerThread) -> Iterator[Any]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.url)
    yield client
    client.close()
