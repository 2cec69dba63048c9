"""One hloserve worker: load the repository, start the actors, serve gRPC, REST and metrics.

`serve(config)` is the whole worker as an async context manager, so it runs the same way as the
`hloserve serve` binary, inside another trio program, or in a test:

    async with hloserve.serve(config) as worker:
        print(worker.grpc_port)      # bound port (config port 0 picks a free one)
        print(worker.http_port)      # the REST port (None when server.http_port is -1)
        await trio.sleep_forever()

Leaving the block drains in-flight calls (up to `server.shutdown_grace_s`) and stops everything;
cancelling the surrounding scope stops at once, failing queued calls with UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import ExitStack, asynccontextmanager

import structlog
import trio
import trio_asyncio

from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve._transport import trio_asyncio_patches as _trio_asyncio_patches
from hloserve.actors import supervised
from hloserve.actors.dispatcher import Dispatcher
from hloserve.actors.weight_cache import WeightCache
from hloserve.allocator import return_freed_memory
from hloserve.api import grpc_server
from hloserve.api.control import ControlService
from hloserve.api.control_plane import LocalControlPlane
from hloserve.api.data_plane import LocalDataPlane
from hloserve.api.grpc_server import build_grpc_server
from hloserve.api.grpc_service import InferenceService
from hloserve.api.health import worker_health
from hloserve.api.model_plane import LocalModelPlane
from hloserve.api.repository_plane import LocalRepositoryPlane
from hloserve.api.rest.routes import build_app
from hloserve.api.rest.server import RestServer
from hloserve.api.shm_registry import ShmRegistry
from hloserve.config import Config, ModelSettings
from hloserve.engine.budget import resolve_budget
from hloserve.engine.buffer_pool import BufferPool
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.model_table import ModelTable, Prepared, prepare_repository
from hloserve.engine.policy import PolicyParams
from hloserve.engine.reloader import RepositoryWatcher
from hloserve.engine.statistics import Statistics
from hloserve.engine.tracing import check_tracing, open_tracing
from hloserve.errors import ConfigError
from hloserve.frontends.pool import EnginePlanes, Frontends
from hloserve.models import _xla
from hloserve.models.executable_cache import ExecutableCache, default_directory
from hloserve.models.programs import Programs
from hloserve.tls import server_context

__all__ = ["Worker", "serve"]

log = structlog.get_logger("hloserve.worker")


class Worker(ModelTable):
    """What a running worker tells its embedder: its ports, and its model table."""

    grpc_port: int = 0
    metrics_port: int | None = None
    http_port: int | None = None
    """The bound KServe V2 REST port; None when REST is off (`server.http_port` -1)."""
    frontends: Frontends | None = None
    """With `server.frontends` >= 1: they see every change of the table before its call returns."""
    planes: EnginePlanes | None = None
    """The planes its gRPC and REST adapters serve through (and a frontend's link reaches)."""

    async def _changing(self, name: str, change: Awaitable[None]) -> None:
        """Apply a change of model `name`; if its entry changed, every frontend applies it too
        before this returns (a failed reload that keeps the old version changes nothing)."""
        before = self.models.get(name)
        try:
            await change
        finally:
            if self.frontends is not None and self.models.get(name) is not before:
                await self.frontends.publish(name)

    async def load_model(
        self, name: str, settings: ModelSettings | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        await self._changing(name, super().load_model(name, settings, files))

    async def unload_model(self, name: str) -> None:
        await self._changing(name, super().unload_model(name))
        if self.planes is not None and name not in self.models:
            self.planes.data.forget(name)  # its statistics and metric series
        await trio.to_thread.run_sync(return_freed_memory)  # what its load left in the arenas

    async def reload_model_py(self, name: str) -> None:
        await self._changing(name, super().reload_model_py(name))

    async def record_failure(self, name: str, reason: str) -> None:
        await self._changing(name, super().record_failure(name, reason))

    rest: RestServer | None = None
    """The REST server (its open connections), when it runs."""


@asynccontextmanager
async def serve(config: Config) -> AsyncIterator[Worker]:
    """Run a whole worker for the duration of the block; see the module docstring."""
    server_config = config.server
    # every setting that can be wrong is read before a model loads: a bad one stops the worker at once
    check_tracing(config.tracing)
    grpc_tls = server_context(server_config, "grpc")
    server_context(server_config, "http")
    metrics_tls = server_context(server_config, "metrics")
    _grpclib_patches.install()  # checks grpclib, h2, hyperframe and hpack; replaces nothing
    _trio_asyncio_patches.install()
    await trio.to_thread.run_sync(_xla.warm_up)
    cache = None
    if server_config.cache_executables:
        cache = ExecutableCache(server_config.executable_cache or default_directory())
    programs = Programs(cache)
    prepared = await prepare_repository(server_config.model_repository, programs)
    if cache is not None:
        log.info("executable cache", directory=str(cache.directory), hits=cache.hits, compiled=cache.misses)
    statistics = Statistics()
    scheduler = config.scheduler
    compiled = [
        (m.compiled, m.peak_bytes) for m in prepared.values() if isinstance(m, Prepared) and m.compiled
    ]
    budget_bytes = resolve_budget(config, compiled)
    statistics.weight_budget_bytes = budget_bytes
    # The actors start empty: the models join them through the model table, as any load does.
    weights = config.weights
    weight_cache = WeightCache(
        statistics,
        budget_bytes=budget_bytes,
        externally_managed=weights.externally_managed,
        compaction_interval=scheduler.compaction_interval,
        share_mode=int(weights.shared_host_weights_mode, 8) if weights.shared_host_weights else None,
        pin_host_floors=weights.pin_host_floors,
    )
    params = PolicyParams(
        scheduler.ema_halflife_s,
        scheduler.recency_penalty_cap,
        scheduler.coalescing_discount,
        scheduler.cost_ema_alpha,
    )
    dispatcher = Dispatcher(
        statistics,
        discipline=scheduler.discipline,
        params=params,
        gather_passes=scheduler.gather_passes,
        overlap_loads=weights.overlap_loads,
    )
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        dispatcher.use_weights(await nursery.start(supervised, "weight cache", weight_cache.run))
        await nursery.start(supervised, "dispatcher", dispatcher.run)
        worker = Worker(config, budget_bytes, statistics, dispatcher.inbox, nursery, programs)
        await worker.start(prepared)
        entries = worker.models
        metas = MetaModels(
            entries,
            server_config.meta_concurrency,
            server_config.meta_threads,
            BufferPool(server_config.meta_scratch_bytes, server_config.meta_scratch_slots, use_shm=False)
            if server_config.meta_scratch_bytes
            else None,
            statistics,
            params,
        )

        metrics = Metrics(statistics, programs.__len__, server_config.metrics_max_models, _xla.memory_stats)
        with ExitStack() as failing:  # what a failed start-up lets go of (kept once started)
            failing.callback(metrics.close)
            failing.callback(metas.close)
            ready = sorted(n for n, e in entries.items() if e.ready)
            metrics.models_loaded.set(len(ready))
            metrics.models_failed.set(len(entries) - len(ready))
            if server_config.metrics_port >= 0:
                worker.metrics_port = await metrics.serve(
                    server_config.host,
                    server_config.metrics_port,
                    server_config.metrics_max_connections,
                    server_config.metrics_timeout_s,
                    metrics_tls,
                )
            tracing = open_tracing(config.tracing)
            shm = (
                ShmRegistry(
                    server_config.shm_max_regions, server_config.shm_max_bytes, server_config.shm_owner_uids
                )
                if server_config.allow_client_shm
                else None
            )
            data = LocalDataPlane(
                config=config,
                models=entries,
                statistics=statistics,
                metrics=metrics,
                metas=metas,
                shm=shm,
                tracing=tracing,
            )
            planes = worker.planes = EnginePlanes(
                data,
                LocalModelPlane(
                    config=config,
                    models=entries,
                    statistics=statistics,
                    host=worker,
                    platform=_xla.device().platform,
                ),
                LocalRepositoryPlane(
                    host=worker, config=config, models=entries, statistics=statistics, shm=shm
                ),
                LocalControlPlane(worker),
            )
            service = InferenceService(data=data, models=planes.models, repository=planes.repository)
            # grpclib looks up the event loop when constructed: build it inside trio-asyncio's loop.
            server = build_grpc_server(
                server_config,
                [service, ControlService(planes.control)],
                lambda draining: worker_health(data, server_config.max_health_watches, draining),
            )
            rest = None
            if server_config.http_port >= 0 and not server_config.frontends:  # else each frontend serves REST
                # before gRPC: a failed bind cancels it with the nursery
                app = build_app(
                    data=data, models=planes.models, repository=planes.repository, config=server_config
                )
                rest = worker.rest = RestServer(app, server_config)
                try:
                    worker.http_port = await nursery.start(rest.run)
                except OSError as e:
                    raise ConfigError(
                        "server.http_port",
                        f"cannot listen on {server_config.host}:{server_config.http_port}: {e}",
                    ) from None
            frontends = None
            if server_config.frontends:
                frontends = worker.frontends = Frontends(worker, planes)
            try:
                if frontends is not None:  # the engine: K processes serve gRPC and REST, over links to it
                    worker.grpc_port, http_port = await nursery.start(frontends.run)
                    worker.http_port = None if http_port < 0 else http_port
                else:
                    await grpc_server.start(server, server_config, server_config.grpc_port, grpc_tls)
                    worker.grpc_port = server.port
            except OSError as e:  # (a port the frontends cannot have is a ConfigError already)
                raise ConfigError(
                    "server.grpc_port",
                    f"cannot listen on {server_config.host}:{server_config.grpc_port}: {e}",
                ) from None
            failing.pop_all()  # started: the shutdown below closes them
        if server_config.reload:
            watcher = RepositoryWatcher(
                worker,
                server_config.model_repository,
                server_config.repository_poll_s,
                server_config.reload_debounce_s,
            )
            await nursery.start(supervised, "repository watcher", watcher.run)
        log.info(
            "listening",
            grpc=f"{server_config.host}:{worker.grpc_port}",
            http=None if worker.http_port is None else f"{server_config.host}:{worker.http_port}",
            metrics=None if worker.metrics_port is None else f"{server_config.host}:{worker.metrics_port}",
            models_ready=_named(ready),
            models_failed=_named(sorted(set(entries) - set(ready))),
            programs=len(programs),
            device=str(_xla.device()),
        )
        try:
            yield worker
        finally:
            with trio.CancelScope(shield=True):
                log.info("shutting down", grace_s=server_config.shutdown_grace_s)
                if rest is not None:
                    rest.stop()
                if frontends is not None:
                    await frontends.drain()
                else:
                    await grpc_server.shut_down(server, server_config)
                if rest is not None:  # hypercorn gives its connections the same grace
                    with trio.move_on_after(server_config.shutdown_grace_s + 1):
                        await rest.stopped.wait()
                metrics.close()
                service.close()
                metas.close()
                worker.close()  # the bundles sent in loads: nothing left in the temp directory
                if tracing is not None:  # exports the spans still pending
                    await trio.to_thread.run_sync(tracing.shutdown)
            nursery.cancel_scope.cancel()


LOGGED_NAMES = 20
"""Model names a start-up log line lists; a catalogue of thousands is counted, not listed."""


def _named(models: list[str]) -> list[str] | str:
    """`models` when few, else how many and the first of them (the log line stays bounded)."""
    if len(models) <= LOGGED_NAMES:
        return models
    return f"{len(models)} models: {', '.join(models[:LOGGED_NAMES])}, ..."
