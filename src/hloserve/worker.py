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

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import trio
import trio_asyncio
from grpclib.config import Configuration

from hloserve import _grpclib_patches, _hpack_patches, _trio_asyncio_patches, _xla
from hloserve._proto_codec import KnownFieldsCodec
from hloserve.actors.dispatcher import Dispatcher
from hloserve.actors.messages import AddModel, Compact, Compacted, RemoveModel, SetPolicy, SetResidency
from hloserve.actors.model_queue import ModelQueue, ModelQueueHandle, QueueSettings
from hloserve.actors.weight_cache import WeightCache
from hloserve.budget import resolve_budget
from hloserve.buffer_pool import BufferPool
from hloserve.bundle import (
    MODEL_PY,
    Bundle,
    bundle_directory,
    check_model_name,
    discover,
    load_bundle,
    read_weights,
)
from hloserve.compiled import CompiledModel, compile_bundle
from hloserve.config import Config, ModelSettings, SchedulerConfig
from hloserve.control import ControlService
from hloserve.errors import BundleError, ConfigError, InvalidInput, ModelNotFound
from hloserve.executable_cache import ExecutableCache, default_directory
from hloserve.health import worker_health
from hloserve.meta import MetaModels
from hloserve.metrics import Metrics
from hloserve.model_py import MetaRun, ModelHooks, Registration, load_model_py
from hloserve.policy import Discipline, ModelPolicy, PolicyParams
from hloserve.reloader import RepositoryWatcher
from hloserve.rest import RestServer, build_app
from hloserve.service import InferenceService
from hloserve.statistics import Statistics

__all__ = ["ModelEntry", "Worker", "serve"]

log = structlog.get_logger("hloserve.worker")

_WINDOW_BYTES = 16 << 20  # HTTP/2 flow-control windows: a 4.8 MB tensor in one window


@dataclass(slots=True)
class ModelEntry:
    """One bundle of the repository: compiled and queued (or a registered meta model) when
    ready, else why not."""

    name: str
    bundle: Bundle | None = None
    compiled: CompiledModel | None = None
    queue: ModelQueueHandle | None = None
    registration: Registration | None = None
    """What its model.py registered (None without one); hot reload swaps it."""
    error: str | None = None

    @property
    def ready(self) -> bool:
        if self.error is not None:
            return False
        return self.queue is not None or self.meta_run is not None

    @property
    def hooks(self) -> ModelHooks | None:
        return None if self.registration is None else self.registration.hooks

    @property
    def meta_run(self) -> MetaRun | None:
        return None if self.registration is None else self.registration.meta_run

    @property
    def calls(self) -> tuple[str, ...]:
        """The models it calls, if it is a meta model."""
        return () if self.bundle is None else self.bundle.manifest.calls

    @property
    def max_rows(self) -> int | None:
        """The most executable rows one request may carry; None: any (split if need be)."""
        compiled = self.compiled
        if compiled is None or compiled.coalescable or not compiled.bundle.manifest.batched:
            return None
        return compiled.batch_sizes[-1]

    def check_rows(self, rows: int, source: str) -> None:
        """InvalidInput unless one request of `rows` executable rows (made by `source`: a hook,
        a meta model's call) can be queued; the request decoder checks the client's own."""
        if rows == 0:
            raise InvalidInput(self.name, f"{source} made a batch of 0 rows")
        if self.max_rows is not None and rows > self.max_rows:
            raise InvalidInput(
                self.name, f"{source} made {rows} rows; the largest compiled batch size is {self.max_rows}"
            )


@dataclass(slots=True)
class Worker:
    """What a running worker tells its embedder."""

    config: Config
    grpc_port: int
    metrics_port: int | None
    weight_budget: int | None
    """Bytes of weights loaded on demand at once (configured or resolved); None: no eviction."""
    models: dict[str, ModelEntry] = field(default_factory=dict)
    statistics: Statistics = field(default_factory=Statistics)
    _dispatcher: trio.MemorySendChannel[object] | None = None
    _nursery: trio.Nursery | None = None
    _cache: ExecutableCache | None = None
    _turns: dict[str, trio.Lock] = field(default_factory=dict)
    """Per model name while a load, unload, reload or control call for it is under way."""

    @asynccontextmanager
    async def _turn(self, *names: str) -> AsyncIterator[None]:
        """Hold the models `names` until the block ends: loads, unloads, reloads and control
        calls naming one model apply one after another, in the order they were asked for
        (trio's locks are fair), whatever the dispatcher is doing meanwhile. A lock lives only
        while someone holds or awaits it, so a client naming many models leaves nothing."""
        async with AsyncExitStack() as stack:
            for name in sorted(set(names)):  # one order for every caller: no deadlock
                lock = self._turns.setdefault(name, trio.Lock())
                stack.callback(self._forget_turn, name, lock)  # runs after the release below
                await stack.enter_async_context(lock)
            yield

    def _forget_turn(self, name: str, lock: trio.Lock) -> None:
        if not lock.locked() and self._turns.get(name) is lock:  # released, nobody waiting
            del self._turns[name]

    http_port: int | None = None
    """The bound KServe V2 REST port; None when REST is off (`server.http_port` -1)."""

    async def load_model(self, name: str) -> None:
        """Load the bundle `name` from the repository, or reload it: it is read and compiled
        outside the dispatch loop (other models keep serving), and only then replaces the old
        version, which keeps serving if the new one fails. `name` is a plain name (no path) and
        the bundle must lie inside the repository."""
        directory = bundle_directory(self.config.server.model_repository, name)
        async with self._turn(name):
            await self._load(name, directory)

    async def _load(self, name: str, directory: Path) -> None:
        if not (directory / "manifest.yaml").is_file():
            raise ModelNotFound(name, f"the repository has no bundle {name!r}")
        bundle = await trio.to_thread.run_sync(load_bundle, directory)
        loaded = await trio.to_thread.run_sync(_load, bundle, self._cache)
        if bundle.manifest.is_meta:
            _check_meta(bundle, self.models)
        old = self.models.get(name)
        compiled = loaded.compiled
        if compiled is None:  # a meta model: nothing for the dispatcher
            if old is not None and old.queue is not None:
                await self._unload(name)
            self.models[name] = ModelEntry(name, bundle, registration=loaded.registration)
            log.info("model loaded", model=name, source="repository load", kind="meta")
            return
        assert self._dispatcher is not None and self._nursery is not None
        scheduler = self.config.scheduler
        queue = ModelQueue(
            name, _queue_settings(scheduler, compiled), self._dispatcher.clone(), self.statistics
        )
        handle: ModelQueueHandle = await self._nursery.start(_supervised, f"model queue {name!r}", queue.run)
        floor = scheduler.models.get(name, ModelSettings()).floor
        # A model served already is replaced in place: its requests keep flowing (no gap).
        self._dispatcher.send_nowait(
            AddModel(name, compiled, _policy(scheduler, name, loaded.costs), handle, floor)
        )
        self.models[name] = ModelEntry(name, bundle, compiled, handle, loaded.registration)
        log.info(
            "model loaded",
            model=name,
            source="reload" if old is not None and old.ready else "repository load",
            batch_sizes=list(compiled.batch_sizes),
        )

    def record_failure(self, name: str, reason: str) -> None:
        """List a bundle that could not be loaded, with why (RepositoryIndex shows it)."""
        self.models[name] = ModelEntry(name, error=reason)

    async def reload_model_py(self, name: str) -> None:
        """Execute `name`'s model.py again and swap in what it registers; requests already past
        a hook finish with the old one. A model.py that fails leaves the old hooks in place."""
        async with self._turn(check_model_name(name)):
            entry = self.models.get(name)
            if entry is None or not entry.ready or entry.bundle is None or entry.bundle.model_py is None:
                raise ModelNotFound(name, "no serving bundle with a model.py by that name")
            entry.registration = await trio.to_thread.run_sync(_registration, entry.bundle)
        log.info("model.py reloaded", model=name)

    async def unload_model(self, name: str) -> None:
        """Stop serving `name`: new requests get NOT_FOUND at once, queued ones too; its
        weights leave the device."""
        async with self._turn(check_model_name(name)):
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(name)
        del self.models[name]
        if entry.queue is not None:
            assert self._dispatcher is not None
            send, receive = trio.open_memory_channel[Any](1)
            await self._dispatcher.send(RemoveModel(name, send))
            await receive.receive()
        log.info("model unloaded", model=name)

    def _executable(self, model: str) -> ModelEntry:
        """The serving model `model` that has an executable (policy and residency apply)."""
        entry = self.models.get(check_model_name(model))
        if entry is None or not entry.ready:
            raise ModelNotFound(model)
        if entry.queue is None:
            raise InvalidInput(
                model, "it is a meta model; set the policy or residency of the models it calls"
            )
        return entry

    async def set_policy(
        self, model: str | None, *, weight: float | None = None, discipline: Discipline | None = None
    ) -> None:
        """Change a model's scheduling weight or discipline (model None: the global discipline).

        Applied by the dispatcher before its next selection.
        """
        if weight is not None and not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        async with self._turn(*() if model is None else (check_model_name(model),)):
            if model is not None:
                self._executable(model)
            await self._ask(lambda reply: SetPolicy(model, weight, discipline, reply))

    async def set_residency(self, model: str, floor: str) -> tuple[str, bool]:
        """Externally managed residency: pin `model` on the device (`device`), or free it from
        the device keeping (`system`) or dropping (`unpinned`) its host copy. Returns the floor
        and whether it is on the device; ResidencyRefused in self-managed mode."""
        if floor not in ("unpinned", "system", "device"):
            raise ValueError(f"residency must be unpinned, system or device, got {floor!r}")
        async with self._turn(check_model_name(model)):
            self._executable(model)
            result: tuple[str, bool] = await self._ask(lambda reply: SetResidency(model, floor, reply))
            return result

    async def compact(self, reload: Sequence[str] = ()) -> Compacted:
        """Free every resident unpinned model's weights, then load `reload`; between executions."""
        for model in reload:  # at once: a long list of unknown names waits on nothing
            self._executable(model)
        async with self._turn(*reload):
            for model in reload:
                self._executable(model)
            result: Compacted = await self._ask(lambda reply: Compact(tuple(reload), reply))
            return result

    async def _ask(self, message: Callable[[trio.MemorySendChannel[Any]], object]) -> Any:
        """Send the dispatcher `message(reply_to)` and return its answer (raised if an error)."""
        assert self._dispatcher is not None
        send, receive = trio.open_memory_channel[Any](1)
        await self._dispatcher.send(message(send))
        reply = await receive.receive()
        if isinstance(reply, Exception):
            raise reply
        return reply


async def _supervised(
    actor: str,
    run: Callable[..., Awaitable[None]],
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an actor; if it fails, say so and let the failure end the worker.

    The actors answer a bad message and carry on; what escapes one is a bug that leaves state
    nobody can trust, so the worker stops (its nursery cancels the rest, `serve` raises, and
    `hloserve serve` exits non-zero) rather than serve on half alive with a dead dispatcher.
    """
    try:
        await run(task_status=task_status)
    except Exception:
        log.critical("actor failed; the worker stops", actor=actor, exc_info=True)
        raise


def _policy(scheduler: SchedulerConfig, model: str, costs: dict[int, float]) -> ModelPolicy:
    settings = scheduler.models.get(model, ModelSettings())
    budget = None if settings.latency_budget_ms is None else settings.latency_budget_ms / 1e3
    return ModelPolicy(
        weight=settings.weight, cost=dict(costs), discipline=settings.discipline, latency_budget_s=budget
    )


def _queue_settings(scheduler: SchedulerConfig, compiled: CompiledModel) -> QueueSettings:
    settings = scheduler.models.get(compiled.name, ModelSettings())
    return QueueSettings(
        batch_sizes=compiled.batch_sizes,
        coalescable=compiled.coalescable,
        max_depth=settings.max_queue_depth or scheduler.max_queue_depth,
        max_batch_size=settings.max_batch_size,
        max_queue_delay_s=settings.max_queue_delay_us / 1e6,
    )


@dataclass(frozen=True, slots=True)
class _Loaded:
    compiled: CompiledModel | None
    """None for a meta model, which has no executable."""
    costs: dict[int, float]
    """Seconds per execution by batch size, measured by the warm-up run."""
    registration: Registration | None
    """What its model.py registered."""
    peak_bytes: int | None = None
    """The allocator's peak after the warm-up (None where the backend keeps no statistics)."""


def _registration(bundle: Bundle) -> Registration | None:
    """Execute the bundle's model.py, if any, and check it registered the bundle's kind."""
    if bundle.model_py is None:
        return None
    registration = load_model_py(bundle.name, bundle.model_py, bundle.path.parent)
    if bundle.manifest.is_meta and registration.meta_run is None:
        raise BundleError(bundle.name, MODEL_PY, None, "a bundle of kind: meta must call register_meta_model")
    if not bundle.manifest.is_meta and registration.hooks is None:
        raise BundleError(
            bundle.name, MODEL_PY, None, "calls register_meta_model, but the manifest has no kind: meta"
        )
    return registration


def _check_meta(bundle: Bundle, models: dict[str, ModelEntry]) -> None:
    """A meta model may not call another meta; a callee served elsewhere is only noted."""
    for callee in bundle.manifest.calls:
        other = models.get(callee)
        if other is None:
            log.info("meta model calls a model this worker does not serve", model=bundle.name, callee=callee)
        elif other.bundle is not None and other.bundle.manifest.is_meta:
            raise BundleError(
                bundle.name,
                "manifest.yaml",
                "meta.calls",
                f"{callee!r} is a meta model; a meta may not call a meta",
            )


def _load(bundle: Bundle, cache: ExecutableCache | None) -> _Loaded:
    """Run its model.py, compile, then run each size once on zeros (blocking: call in a worker
    thread). The warm-up places the weights only for its own run; residency is the weight cache's.
    """
    registration = _registration(bundle)
    if bundle.manifest.is_meta:
        return _Loaded(None, {}, registration)
    compiled = compile_bundle(bundle, cache)
    weights = [_xla.put(w) for w in read_weights(bundle)]
    costs = compiled.warm_up(weights)
    stats = _xla.memory_stats()
    _xla.free(weights)
    return _Loaded(compiled, costs, registration, None if stats is None else stats.get("peak_bytes_in_use"))


async def _load_repository(
    repository: Path, cache: ExecutableCache | None
) -> tuple[dict[str, ModelEntry], dict[str, _Loaded]]:
    if not repository.is_dir():
        raise ConfigError("server.model_repository", f"{repository} is not a directory")
    entries: dict[str, ModelEntry] = {}
    loaded: dict[str, _Loaded] = {}
    for name, found in await trio.to_thread.run_sync(discover, repository):
        entry = entries[name] = ModelEntry(name)
        if isinstance(found, BundleError):
            entry.error = str(found)
            log.error("bundle rejected", model=name, reason=entry.error)
            continue
        entry.bundle = found
        started = time.perf_counter()
        try:
            loaded[name] = await trio.to_thread.run_sync(_load, found, cache)
        except BundleError as e:
            entry.error = str(e)
            log.error("bundle rejected", model=name, reason=entry.error)
            continue
        except Exception as e:  # a module XLA cannot compile is one bad bundle, not a dead server
            entry.error = f"bundle {name!r}: compilation failed: {e}"
            log.error("bundle failed to compile", model=name, reason=str(e))
            continue
        entry.registration = loaded[name].registration
        compiled = entry.compiled = loaded[name].compiled
        if compiled is None:
            continue
        log.info(
            "model loaded",
            model=name,
            batch_sizes=list(compiled.batch_sizes),
            weight_bytes=found.weight_nbytes,
            scratch_bytes=compiled.scratch_bytes,
            compile_s=round(compiled.compile_s, 3),
            load_s=round(time.perf_counter() - started, 3),
            warm_up_ms={size: round(s * 1e3, 3) for size, s in loaded[name].costs.items()},
            model_py=found.model_py is not None,
        )
    for name, entry in entries.items():
        if entry.bundle is not None and entry.bundle.manifest.is_meta and entry.error is None:
            try:
                _check_meta(entry.bundle, entries)
            except BundleError as e:
                entry.error = str(e)
                log.error("bundle rejected", model=name, reason=entry.error)
                continue
            log.info("meta model loaded", model=name, calls=list(entry.bundle.manifest.calls))
    return entries, loaded


@asynccontextmanager
async def serve(config: Config) -> AsyncIterator[Worker]:
    """Run a whole worker for the duration of the block; see the module docstring."""
    server_config = config.server
    _grpclib_patches.install()
    _trio_asyncio_patches.install()
    _hpack_patches.install()
    await trio.to_thread.run_sync(_xla.warm_up)
    cache = None
    if server_config.cache_executables:
        cache = ExecutableCache(server_config.executable_cache or default_directory())
    entries, found = await _load_repository(server_config.model_repository, cache)
    if cache is not None:
        log.info("executable cache", directory=str(cache.directory), hits=cache.hits, compiled=cache.misses)
    statistics = Statistics()
    scheduler = config.scheduler
    compiled_models = {n: m.compiled for n, m in found.items() if m.compiled is not None}  # not metas
    budget_bytes = resolve_budget(config, [(c, found[n].peak_bytes) for n, c in compiled_models.items()])
    weight_cache = WeightCache(
        {n: m.bundle for n, m in compiled_models.items()},
        {n: scheduler.models.get(n, ModelSettings()).floor for n in compiled_models},
        budget_bytes,
        config.weights.externally_managed,
        statistics,
        scheduler.compaction_interval,
        int(config.weights.shared_host_weights_mode, 8) if config.weights.shared_host_weights else None,
    )
    params = PolicyParams(
        scheduler.ema_halflife_s,
        scheduler.recency_penalty_cap,
        scheduler.coalescing_discount,
        scheduler.cost_ema_alpha,
    )
    dispatcher = Dispatcher(
        dict(compiled_models),
        statistics,
        scheduler.discipline,
        {n: _policy(scheduler, n, found[n].costs) for n in compiled_models},
        params,
        scheduler.gather_passes,
    )
    metas = MetaModels(
        entries,
        server_config.meta_concurrency,
        BufferPool(server_config.meta_scratch_bytes, server_config.meta_scratch_slots, use_shm=False)
        if server_config.meta_scratch_bytes
        else None,
        statistics,
        params,
    )
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        dispatcher.use_weights(await nursery.start(_supervised, "weight cache", weight_cache.run))
        for name, compiled in compiled_models.items():
            queue = ModelQueue(
                name, _queue_settings(scheduler, compiled), dispatcher.inbox.clone(), statistics
            )
            entries[name].queue = await nursery.start(_supervised, f"model queue {name!r}", queue.run)
            dispatcher.attach(entries[name].queue)
        await nursery.start(_supervised, "dispatcher", dispatcher.run)

        metrics = Metrics(statistics)
        ready = sorted(n for n, e in entries.items() if e.ready)
        metrics.models_loaded.set(len(ready))
        metrics.models_failed.set(len(entries) - len(ready))
        metrics_port = None
        if server_config.metrics_port >= 0:
            metrics_port = metrics.serve(server_config.host, server_config.metrics_port)

        worker = Worker(
            config, 0, metrics_port, budget_bytes, entries, statistics, dispatcher.inbox, nursery, cache
        )
        # grpclib looks up the event loop when constructed: build it inside trio-asyncio's loop.
        server = _grpclib_patches.GracefulServer(
            [
                service := InferenceService(config, entries, statistics, metrics, worker, metas),
                ControlService(worker),
                worker_health(worker, service, draining=lambda: server.draining),
            ],
            config=Configuration(
                http2_connection_window_size=_WINDOW_BYTES, http2_stream_window_size=_WINDOW_BYTES
            ),
            codec=KnownFieldsCodec(),
            limits=_grpclib_patches.TransportLimits.from_config(server_config),
        )
        rest = None
        if server_config.http_port >= 0:  # before gRPC: a failed bind cancels it with the nursery
            app = build_app(service, entries, server_config.max_message_bytes)
            rest = RestServer(app, server_config)
            try:
                worker.http_port = await nursery.start(rest.run)
            except OSError as e:
                metrics.close()
                raise ConfigError(
                    "server.http_port",
                    f"cannot listen on {server_config.host}:{server_config.http_port}: {e}",
                ) from None
        try:
            await trio_asyncio.aio_as_trio(server.start)(server_config.host, server_config.grpc_port)
        except OSError as e:
            metrics.close()
            raise ConfigError(
                "server.grpc_port", f"cannot listen on {server_config.host}:{server_config.grpc_port}: {e}"
            ) from None
        worker.grpc_port = server.port
        if server_config.reload:
            watcher = RepositoryWatcher(
                worker,
                server_config.model_repository,
                server_config.repository_poll_s,
                server_config.reload_debounce_s,
            )
            await nursery.start(_supervised, "repository watcher", watcher.run)
        log.info(
            "listening",
            grpc=f"{server_config.host}:{worker.grpc_port}",
            http=None if rest is None else f"{server_config.host}:{worker.http_port}",
            metrics=None if metrics_port is None else f"{server_config.host}:{metrics_port}",
            models_ready=ready,
            models_failed=sorted(set(entries) - set(ready)),
            device=str(_xla.device()),
        )
        try:
            yield worker
        finally:
            with trio.CancelScope(shield=True):
                log.info("shutting down", grace_s=server_config.shutdown_grace_s)
                if rest is not None:
                    rest.stop()
                await trio_asyncio.aio_as_trio(server.shutdown)(server_config.shutdown_grace_s)
                if rest is not None:  # hypercorn gives its connections the same grace
                    with trio.move_on_after(server_config.shutdown_grace_s + 1):
                        await rest.stopped.wait()
                metrics.close()
                service.close()
                metas.close()
            nursery.cancel_scope.cancel()
