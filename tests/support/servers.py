"""Starting a real worker on loopback ports, in a thread of the test process or as a subprocess.

`start_worker` is the one way tests start one; its handle has the same face either way (`url`,
`http_url`, `grpc_port`, `pid`, `stop()`, and `with` stops it).
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Self

import trio

from hloserve.config import Config, load_config

from .clients import free_port, wait_ready

__all__ = [
    "EXAMPLES",
    "ROOT",
    "ServerProcess",
    "ServerThread",
    "Worker",
    "make_config",
    "residency",
    "start_worker",
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "repository"
SERVE = (sys.executable, "-m", "hloserve.cli", "serve")


def make_config(
    repository: Path = EXAMPLES, scheduler: dict[str, Any] | None = None, **server: Any
) -> Config:
    """The default config on free ports, plus overrides of `server` fields and `scheduler` ones."""
    config = load_config(environ={})
    server = {"grpc_port": 0, "metrics_port": 0, "http_port": 0, **server}
    config = config.replace("server", model_repository=repository, **server)
    return config.replace("scheduler", **scheduler) if scheduler else config


def start_worker(
    config: Config | None = None,
    *,
    process: Literal["thread", "subprocess"] = "thread",
    frontends: int = 0,
    args: Sequence[str] = (),
    repository: Path | None = EXAMPLES,
    env: Mapping[str, str | None] | None = None,
    command: Sequence[str] = SERVE,
    cwd: Path = ROOT,
    preexec_fn: Any = None,
    timeout: float = 120,
) -> Worker:
    """A worker that is ready when returned; stop it with `stop()` or by leaving a `with`.

    `process="thread"` serves `config` (default `make_config()`) in a thread of this process,
    where a test can reach into it (`.worker`, `.call`). `process="subprocess"` runs `command`
    (`hloserve serve`) on a free gRPC port, configured as an operator would: the CLI flags `args`,
    `--model-repository repository` (none when None), and `env` over this process's environment
    (a None value removes a variable); it is for what can kill, starve or signal a process.

    `frontends` is the number of frontend processes (`server.frontends`, `--frontends`); 0 is
    the single process.
    """
    if process == "thread":
        assert not (args or env or preexec_fn), "a thread worker takes a Config, not flags or environment"
        config = config or make_config()
        if frontends:
            config = config.replace("server", frontends=frontends)
        return ServerThread(config).start(timeout)
    assert config is None, "a subprocess worker is configured by `args` and `env`, not a Config"
    flags = [*args] if repository is None else ["--model-repository", str(repository), *args]
    if frontends:
        flags += ["--frontends", str(frontends)]
    return ServerProcess.start(command, flags, env or {}, cwd, preexec_fn, timeout)


class _Stops:
    """`with worker:` stops it on the way out."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


class ServerThread(_Stops):
    """A worker serving `config` in a background thread until `stop()`.

    The worker runs its own `trio.run` in that thread so that blocking clients (tritonclient,
    perf_analyzer) can call it from the test's thread.
    """

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
            self.stop()  # the thread has ended (with the error): join it
            raise RuntimeError("worker failed to start") from started
        return self

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the worker's own thread (the event loop's), and return its result (an
        async `fn` is awaited there)."""
        if inspect.iscoroutinefunction(fn):
            return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)
        return trio.from_thread.run_sync(lambda: fn(*args, **kwargs), trio_token=self._token)

    @property
    def grpc_port(self) -> int:
        return int(self.worker.grpc_port)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.worker.http_port}"

    @property
    def pid(self) -> int:
        return os.getpid()

    def stop(self, timeout: float = 60) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker thread did not stop"


class ServerProcess(_Stops):
    """A worker in a subprocess, ready; `stop()` kills it if it still runs.

    Its output (JSON log lines) goes to a file, `log`, so that a chatty server never blocks on a
    full pipe; the file's tail is shown when the server fails to start.
    """

    def __init__(self, process: subprocess.Popen[str], port: int, log: IO[str]) -> None:
        self.process = process
        self.grpc_port = port
        self._log = log

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        flags: Sequence[str],
        env: Mapping[str, str | None],
        cwd: Path,
        preexec_fn: Any,
        timeout: float,
    ) -> ServerProcess:
        port = free_port()
        environ = {**os.environ, "HLOSERVE_LOGGING_FORMAT": "json", **env}
        log = tempfile.NamedTemporaryFile("w+", prefix="hloserve-", suffix=".log")
        process = subprocess.Popen(
            [*command, "--grpc-port", str(port), "--metrics-port", "-1", *flags],
            cwd=cwd,
            env={name: value for name, value in environ.items() if value is not None},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=preexec_fn,
        )
        server = cls(process, port, log)
        try:
            wait_ready(server.url, process, timeout, lambda: server.output(lines=20))
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """The REST address, as the server logged it when it began listening."""
        for line in self.output().splitlines():
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "listening" and event.get("http"):
                return str(event["http"])
        raise AssertionError(f"the server logged no REST address: {self.output(lines=20)}")

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log(self) -> Path:
        return Path(self._log.name)

    def output(self, lines: int | None = None) -> str:
        """What the server has written so far (its last `lines`, when given)."""
        self._log.flush()
        text = self.log.read_text()
        return text if lines is None else "".join(text.splitlines(keepends=True)[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._log.close()


Worker = ServerThread | ServerProcess
"""A started worker: `start_worker`'s handle, the same face in a thread or a subprocess."""


def residency(server: ServerThread) -> dict[str, tuple[bool, int, int]]:
    """Each model the weight cache manages: name → (resident, loads, evictions)."""
    stats = server.call(server.worker.statistics.snapshot)
    return {
        n: (s.resident, s.weight_loads, s.weight_evictions) for n, s in sorted(stats.items()) if s.residency
    }
