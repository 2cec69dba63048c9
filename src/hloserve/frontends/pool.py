"""The engine's frontend processes (docs/frontends.md, "Lifecycle").

`Frontends.run` reserves the public gRPC and REST ports (bound, never listening, SO_REUSEPORT
sockets: they keep the ports and take no connection), starts `server.frontends` processes of
`hloserve.frontends.frontend`, each with its link (an `EngineLink` actor), and reports started once every
one listens. A frontend that dies is restarted with backoff, its arena unlinked and its in-flight
requests forgotten. `publish` pushes a change of the model table to every frontend and waits
for each to apply it; a frontend started later gets the table as it is. `drain` sends SIGTERM
and waits: each frontend answers what it has in flight, then exits.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
import trio
from grpclib.metadata import Deadline

from hloserve._process import Process
from hloserve._proto import hloserve_control as hc
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.control_plane import ControlPlane
from hloserve.engine.admission import Ticket
from hloserve.errors import ConfigError, Overloaded
from hloserve.frontends.engine_link import EngineLink, EngineServices
from hloserve.frontends.protocol import ARENA_PREFIX, FORWARD, EngineCalls, ModelSummary, Setup, TableChanged
from hloserve.models import _xla

if TYPE_CHECKING:
    from hloserve.api.data_plane import LocalDataPlane
    from hloserve.api.model_plane import ModelPlane
    from hloserve.api.repository_plane import RepositoryPlane
    from hloserve.engine.model_table import ModelEntry, ModelHost

__all__ = ["EnginePlanes", "Frontends", "engine_calls"]

log = structlog.get_logger("hloserve.frontends")

_START_TIMEOUT_S = 120.0
_APPLY_TIMEOUT_S = 60.0
"""How long a table change waits for a frontend to apply it (it runs the bundle's model.py)."""
_BACKOFF_S = (0.1, 5.0)


def _summary(host: ModelHost, entry: ModelEntry) -> ModelSummary:
    return ModelSummary(
        entry.name,
        entry.bundle,
        entry.error,
        entry.batch_sizes,
        entry.coalescable,
        host.config.scheduler.models.get(entry.name),
    )


class EnginePlanes(NamedTuple):
    """The engine's planes, which its frontends' links reach: its data plane also admits and
    counts every frontend's requests."""

    data: LocalDataPlane
    models: ModelPlane
    repository: RepositoryPlane
    control: ControlPlane


def engine_calls(planes: EnginePlanes) -> dict[str, Callable[[Any], Awaitable[Any]]]:
    """What a frontend's `EngineCall` may name, each the engine's plane method that answers it: a
    whole ModelInfer (`FORWARD`), and each of `EngineCalls`."""

    data, models, repository, control = planes

    async def forwarded(argument: tuple[bytes, float | None]) -> bytes:
        request, remaining = argument
        deadline = None if remaining is None else Deadline.from_timeout(remaining)
        response = await data.infer(hot.ModelInferRequest.FromString(request), deadline)
        return bytes(response.SerializeToString())

    async def model_ready(argument: tuple[str, str]) -> bool:
        return await data.model_ready(*argument)

    # protobuf messages cross the link serialized (their classes do not pickle)
    async def index(message: kserve.RepositoryIndexRequest) -> bytes:
        return bytes((await repository.index(message)).SerializeToString())

    async def control_status(message: hc.ModelControlStatusRequest) -> bytes:
        return bytes((await control.status(message)).SerializeToString())

    calls: dict[str, Callable[[Any], Awaitable[Any]]] = {
        FORWARD: forwarded,
        EngineCalls.MODEL_READY: model_ready,
        EngineCalls.STATISTICS: models.statistics,
        EngineCalls.INDEX: index,
        EngineCalls.LOAD: repository.load,
        EngineCalls.UNLOAD: repository.unload,
        EngineCalls.REGISTER_REGION: repository.register_region,
        EngineCalls.REGION_STATUS: repository.region_status,
        EngineCalls.UNREGISTER_REGION: repository.unregister_region,
        EngineCalls.CONTROL_STATUS: control_status,
        EngineCalls.SET_RESIDENCY: control.set_residency,
        EngineCalls.SET_POLICY: control.set_policy,
        EngineCalls.COMPACT_MEMORY: control.compact,
    }
    assert calls.keys() == {FORWARD, *EngineCalls}, "every call a frontend may name is answered"
    return calls


class Frontends:
    """The K frontend processes of one engine; see the module docstring."""

    def __init__(self, host: ModelHost, planes: EnginePlanes) -> None:
        self._host = host
        self._config = host.config
        self._plane = planes.data
        self._services = EngineServices(
            count=planes.data.record,
            calls=engine_calls(planes),
            admit=self._admit,
            release=self._release,
            tracing=planes.data.tracing,
        )
        self._processes: dict[int, Process] = {}
        self._links: set[EngineLink] = set()
        self._draining = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values()]

    @property
    def listening(self) -> int:
        """How many frontends listen now (a restarted one once it listens again)."""
        return sum(link.listening.is_set() for link in self._links)

    @property
    def inflight(self) -> int:
        """Requests the engine holds from all its frontends."""
        return sum(link.inflight for link in self._links)

    def engine_link(self, stream: trio.SocketStream) -> EngineLink:
        """The engine's end of a link to a frontend on `stream`, counting, admitting and
        answering `EngineCall`s as every frontend's (unstarted: run it in a task)."""
        return EngineLink(stream, self._host.models, self._services)

    def _admit(self, entry: ModelEntry | None, rows: int, deadline: float | None) -> Ticket | None:
        """Admission for the worker, in the one place every frontend's requests reach:
        `server.max_inflight_requests` counts them all, and a request that cannot meet its
        deadline behind the rows the engine holds is refused (`LocalDataPlane.admit`)."""
        limit = self._config.server.max_inflight_requests
        if self.inflight >= limit:
            raise Overloaded(limit)
        return None if entry is None else self._plane.admit(entry, rows, time.monotonic(), deadline)

    def _release(self, ticket: object) -> None:
        if isinstance(ticket, Ticket):
            self._plane.release(ticket)

    def post(self, name: str) -> list[trio.Event]:
        """Push model `name`'s entry as it is now to every frontend (those started later get
        the whole table); the events are set as each has applied it."""
        entry = self._host.models.get(name)
        change = TableChanged(name, None if entry is None else _summary(self._host, entry))
        return [link.push(change) for link in self._links]

    async def publish(self, name: str) -> None:
        """`post`, and wait until every frontend serves the change (or a bounded time)."""
        with trio.move_on_after(_APPLY_TIMEOUT_S) as waited:
            for applied in self.post(name):
                await applied.wait()
        if waited.cancelled_caught:
            log.warning("a frontend did not apply a model table change in time", model=name)

    async def run(self, *, task_status: trio.TaskStatus[tuple[int, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Reserve the ports and keep the frontends; started with (gRPC port, REST port or -1)."""
        server = self._config.server
        with ExitStack() as stack:
            port = _reserve(stack, server.host, server.grpc_port, "server.grpc_port")
            http_port = server.http_port
            if http_port >= 0:
                http_port = _reserve(stack, server.host, http_port, "server.http_port")
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as starting:  # side by side, each until it listens
                    for index in range(server.frontends):
                        keep = functools.partial(self._keep, index, port, http_port)
                        starting.start_soon(nursery.start, keep)
                task_status.started((port, http_port))

    async def _keep(
        self, index: int, port: int, http_port: int, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Run frontend `index` for as long as the engine does, restarting it when it dies."""
        backoff = _BACKOFF_S[0]
        started = False
        while not self._draining:
            listened = await self._run_once(index, port, http_port, None if started else task_status)
            started = True
            if self._draining:
                return
            if listened:
                backoff = _BACKOFF_S[0]
            log.warning("frontend exited; restarting", frontend=index, after_s=backoff)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_S[1])

    async def _run_once(
        self, index: int, port: int, http_port: int, task_status: trio.TaskStatus[None] | None
    ) -> bool:
        """One life of a frontend; whether it got to listen."""
        engine_end, frontend_end = socket.socketpair()
        argv = [str(frontend_end.fileno()), str(port), str(http_port)]
        try:
            # A frontend imports jax (bundles name its types) but never initialises a device: the
            # engine is the only process that touches it (on a GPU, XLA would take most of its
            # memory). It sets its own parent-death signal (`hloserve.frontends.frontend.main`).
            process = Process(
                [sys.executable, "-m", "hloserve.frontends.frontend", *argv],
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
                stdin=subprocess.PIPE,
                pass_fds=(frontend_end.fileno(),),
            )
        except BaseException:
            engine_end.close()
            raise
        finally:
            frontend_end.close()
        models = self._host.models
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(engine_end))
        link = self.engine_link(stream)
        self._processes[index] = process
        self._links.add(link)  # from here on it gets every change, after the table as it is now
        try:
            summaries = tuple(_summary(self._host, entry) for entry in models.values())
            assert process.stdin is not None
            async with trio.lowlevel.FdStream(os.dup(process.stdin.fileno())) as stdin:
                process.stdin.close()
                setup = Setup(self._host.config, summaries, index, _xla.device().platform)
                await stdin.send_all(pickle.dumps(setup))
            async with trio.open_nursery() as nursery:

                async def serve_link() -> None:
                    await link.run()
                    nursery.cancel_scope.cancel()  # the frontend is gone

                nursery.start_soon(serve_link)
                with trio.fail_after(_START_TIMEOUT_S):
                    await link.listening.wait()
                log.info("frontend listening", frontend=index, pid=process.pid, port=port)
                if task_status is not None:
                    task_status.started()
                await process.wait()
                nursery.cancel_scope.cancel()
            return link.listening.is_set()
        finally:
            self._links.discard(link)
            link.close_pushes()
            with trio.CancelScope(shield=True):
                await stream.aclose()  # (the link closes it too, if it ran)
                await process.stop(self._config.server.shutdown_grace_s + 5)
                process.close()
                for unmapped in Path("/dev/shm").glob(f"{ARENA_PREFIX}{index}-{process.pid}-*"):
                    unmapped.unlink(missing_ok=True)  # an arena it made but never named to the link
            del self._processes[index]

    async def drain(self) -> None:
        """SIGTERM every frontend and wait until each has answered its in-flight calls and exited."""
        self._draining = True
        async with trio.open_nursery() as nursery:
            for process in list(self._processes.values()):
                nursery.start_soon(process.stop, self._config.server.shutdown_grace_s + 5)


def _reserve(stack: ExitStack, host: str, port: int, field: str) -> int:
    """Hold `port` for the frontends with a bound SO_REUSEPORT socket that never listens (it
    takes no connection); the bound port. A port that anything else holds is refused, naming
    `field`: a plain bind goes first, since SO_REUSEPORT alone would join another worker's
    sockets on the port (same user) and share its connections without a word."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no holder
            probe.bind((host, port))
            port = int(probe.getsockname()[1])
        holder = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((host, port))
    except OSError as e:
        raise ConfigError(field, f"cannot listen on {host}:{port}: {e}") from None
    return port
