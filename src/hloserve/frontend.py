"""A frontend process (docs/frontends.md): `python -m hloserve.frontend LINK_FD PORT`.

Started by the engine (`hloserve.frontends`), which writes the configuration and a summary of its
model table to the process's stdin and hands it one end of a socketpair. The frontend dies with
the engine (PR_SET_PDEATHSIG), loads the bundles' manifests and model.py (never weights, never
the device), listens on the public gRPC port beside its siblings (SO_REUSEPORT), parses, checks
and runs hooks, and executes over its link. It exits when the link closes.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve import _grpclib_patches, _trio_asyncio_patches
from hloserve._proto import inference as kserve
from hloserve._proto_codec import KnownFieldsCodec
from hloserve.buffer_pool import BufferPool
from hloserve.bundle import load_bundle
from hloserve.config import Config
from hloserve.errors import Unimplemented
from hloserve.health import worker_health
from hloserve.link import Counted, FrontendLink, Listening, execute_over
from hloserve.meta import MetaModels
from hloserve.metrics import Metrics
from hloserve.model_table import Failed, Loaded, ModelEntry, _registration
from hloserve.policy import PolicyParams
from hloserve.service import InferenceService
from hloserve.statistics import Statistics

__all__ = ["ModelSummary", "Setup"]

ARENA_BYTES = 256 << 20
"""Each frontend's shared-memory arena (sparse: pages are used only as requests need them)."""
ARENA_SLOTS = 256
_PR_SET_PDEATHSIG = 1
_NOT_YET = "not served by a frontend yet (server.frontends > 0; docs/frontends.md); use frontends 0"


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """What a frontend needs of one engine model: where its bundle is and how it is compiled."""

    name: str
    directory: Path | None
    error: str | None
    batch_sizes: tuple[int, ...]
    coalescable: bool
    is_meta: bool


@dataclass(frozen=True, slots=True)
class Setup:
    """engine → frontend, on stdin: the configuration and the model table."""

    config: Config
    models: tuple[ModelSummary, ...]
    index: int


@dataclass(frozen=True, slots=True)
class _Compiled:
    """The part of a `CompiledModel` the front end reads (admission, row limits, ModelConfig)."""

    bundle: Any
    batch_sizes: tuple[int, ...]
    coalescable: bool


def _entry(summary: ModelSummary) -> ModelEntry:
    if summary.error is not None or summary.directory is None:
        return ModelEntry(summary.name, Failed(summary.error or "not loaded"))
    if summary.is_meta:
        return ModelEntry(summary.name, Failed(f"meta model {_NOT_YET}"))
    bundle = load_bundle(summary.directory)
    compiled = _Compiled(bundle, summary.batch_sizes, summary.coalescable)
    state = Loaded(bundle, cast(Any, compiled), cast(Any, None), _registration(bundle))
    return ModelEntry(summary.name, state)


class FrontendService(InferenceService):
    """The front end of one frontend: ModelInfer over the link, its calls counted by the engine,
    ModelStatistics answered by the engine; RPCs that change the engine are not forwarded yet."""

    def __init__(
        self,
        link: FrontendLink,
        config: Config,
        models: Mapping[str, ModelEntry],
        statistics: Statistics,
        metrics: Metrics,
        host: Any,
        metas: MetaModels,
    ) -> None:
        super().__init__(config, models, statistics, metrics, host, metas, execute=execute_over(link))
        self._link = link
        self._call = trio_asyncio.trio_as_aio(link.call)

    def _count(self, model: str, status: str, started: float) -> None:
        self._link.notify(Counted(model, status, time.perf_counter() - started))

    async def model_statistics(self, message: kserve.ModelStatisticsRequest) -> Any:
        return await self._call("model_statistics", message)

    async def _on_engine(self, rpc: str) -> Any:
        raise GRPCError(Status.UNIMPLEMENTED, str(Unimplemented(rpc, _NOT_YET)))

    async def repository_model_load(self, message: kserve.RepositoryModelLoadRequest) -> Any:
        return await self._on_engine("RepositoryModelLoad")

    async def repository_model_unload(self, message: kserve.RepositoryModelUnloadRequest) -> Any:
        return await self._on_engine("RepositoryModelUnload")

    async def system_shared_memory_register(self, message: kserve.SystemSharedMemoryRegisterRequest) -> Any:
        return await self._on_engine("SystemSharedMemoryRegister")


class _Host:
    """The `ModelHost` a frontend's service reads: its configuration and its model table."""

    def __init__(self, config: Config, models: Mapping[str, ModelEntry], statistics: Statistics) -> None:
        self.config, self.models, self.statistics = config, models, statistics


async def _serve(link_fd: int, port: int, setup: Setup) -> None:
    config = setup.config
    _grpclib_patches.install()
    _trio_asyncio_patches.install()
    models = {s.name: _entry(s) for s in setup.models}
    statistics = Statistics()
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=link_fd))
    name = f"hloserve-f{setup.index}"
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        with BufferPool(ARENA_BYTES, ARENA_SLOTS, name=name) as arena:
            link = FrontendLink(trio.SocketStream(sock), arena)
            await nursery.start(link.run)
            host = cast(Any, _Host(config, models, statistics))
            service = FrontendService(
                link,
                config,
                models,
                statistics,
                Metrics(statistics),
                host,
                MetaModels(models, 1, None, statistics, PolicyParams()),
            )
            server = _grpclib_patches.GracefulServer(
                [service, worker_health(host, service, draining=lambda: server.draining)],
                codec=KnownFieldsCodec(),
                limits=_grpclib_patches.TransportLimits.from_config(config.server),
            )
            await trio_asyncio.aio_as_trio(server.start)(config.server.host, port, reuse_port=True)
            await link.announce(Listening())
            await _until_stopped(link)
            with trio.CancelScope(shield=True):
                await trio_asyncio.aio_as_trio(server.shutdown)(config.server.shutdown_grace_s)
            nursery.cancel_scope.cancel()


async def _until_stopped(link: FrontendLink) -> None:
    """Until SIGTERM or SIGINT (the engine drains us) or the link closes (the engine is gone)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()

            async def on_close() -> None:
                await link.closed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(on_close)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # the engine died before the prctl
        os._exit(1)


def main(argv: list[str]) -> None:
    _die_with_parent()
    link_fd, port = int(argv[0]), int(argv[1])
    setup = pickle.load(sys.stdin.buffer)  # from the engine that started us: trusted
    trio.run(_serve, link_fd, port, setup)


if __name__ == "__main__":
    main(sys.argv[1:])
