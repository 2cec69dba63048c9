"""The engine's frontend processes (docs/frontends.md, "Lifecycle").

`Frontends.run` reserves the public gRPC port (a bound, never listening, SO_REUSEPORT socket: it
keeps the port and takes no connection), starts `server.frontends` processes of
`hloserve.frontend`, each with its link (an `EngineLink` actor), and reports started once every
one listens. A frontend that dies is restarted with backoff, its arena unlinked and its in-flight
requests forgotten. `drain` sends SIGTERM and waits: each frontend answers what it has in flight,
then exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping

import structlog
import trio

from hloserve.config import Config
from hloserve.frontend import ModelSummary, Setup
from hloserve.link import EngineLink, EngineServices
from hloserve.model_table import ModelEntry

__all__ = ["Frontends"]

log = structlog.get_logger("hloserve.frontends")

_START_TIMEOUT_S = 120.0
_BACKOFF_S = (0.1, 5.0)


def _summaries(models: Mapping[str, ModelEntry]) -> tuple[ModelSummary, ...]:
    summaries = []
    for entry in models.values():
        bundle, compiled = entry.bundle, entry.compiled
        summaries.append(
            ModelSummary(
                entry.name,
                None if bundle is None else bundle.path,
                entry.error,
                () if compiled is None else compiled.batch_sizes,
                compiled is not None and compiled.coalescable,
                bundle is not None and bundle.manifest.is_meta,
            )
        )
    return tuple(summaries)


class Frontends:
    """The K frontend processes of one engine; see the module docstring."""

    def __init__(self, config: Config, models: Mapping[str, ModelEntry], services: EngineServices) -> None:
        self._config = config
        self._models = models
        self._services = services
        self._processes: dict[int, trio.Process] = {}
        self._draining = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values()]

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        server = self._config.server
        family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            holder.bind((server.host, server.grpc_port))
            port = int(holder.getsockname()[1])
            async with trio.open_nursery() as nursery:
                for index in range(server.frontends):
                    await nursery.start(self._keep, index, port)
                task_status.started(port)

    async def _keep(self, index: int, port: int, *, task_status: trio.TaskStatus[None]) -> None:
        """Run frontend `index` for as long as the engine does, restarting it when it dies."""
        backoff = _BACKOFF_S[0]
        started = False
        while not self._draining:
            listened = await self._run_once(index, port, None if started else task_status)
            started = True
            if self._draining:
                return
            if listened:
                backoff = _BACKOFF_S[0]
            log.warning("frontend exited; restarting", frontend=index, after_s=backoff)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_S[1])

    async def _run_once(self, index: int, port: int, task_status: trio.TaskStatus[None] | None) -> bool:
        """One life of a frontend; whether it got to listen."""
        engine_end, frontend_end = socket.socketpair()
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "hloserve.frontend", str(frontend_end.fileno()), str(port)],
                stdin=subprocess.PIPE,
                pass_fds=(frontend_end.fileno(),),
            )
        except BaseException:
            engine_end.close()
            raise
        finally:
            frontend_end.close()
        link = EngineLink(
            trio.SocketStream(trio.socket.from_stdlib_socket(engine_end)), self._models, self._services
        )
        self._processes[index] = process
        try:
            assert process.stdin is not None
            await process.stdin.send_all(pickle.dumps(Setup(self._config, _summaries(self._models), index)))
            await process.stdin.aclose()
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
            with trio.CancelScope(shield=True):
                await _stop(process, self._config.server.shutdown_grace_s + 5)
                if link.arena_key is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"/dev/shm{link.arena_key}")
            del self._processes[index]

    async def drain(self) -> None:
        """SIGTERM every frontend and wait until each has answered its in-flight calls and exited."""
        self._draining = True
        async with trio.open_nursery() as nursery:
            for process in list(self._processes.values()):
                nursery.start_soon(_stop, process, self._config.server.shutdown_grace_s + 5)


async def _stop(process: trio.Process, grace_s: float) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace_s):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
