"""The model table: which models a worker serves, in which state, and the one way that changes.

Each model is a `ModelEntry` (`hloserve.engine.model_entry`): `Loaded`, `Remote`, `Meta` or
`Failed`. Start-up and `load_model` take the same path: a bundle is read, its model.py run and
it is compiled and warmed up outside the dispatch loop (`prepare`), then `ModelTable._put` adds
it, or replaces the version served (which keeps serving if the new one fails before). `_remove`
is the one way out. Loads, unloads, reloads and control calls naming one model apply one after
another (`ModelTable._turn`).

The planes (`hloserve.api`), the control service and the repository watcher see a worker as a
`ModelHost`; the protocol adapters see only the planes.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import outcome
import structlog
import trio

from hloserve.actors import supervised
from hloserve.actors.messages import (
    AddModel,
    Compact,
    Compacted,
    DispatcherMessage,
    RemoveModel,
    SetPolicy,
    SetResidency,
)
from hloserve.actors.model_queue import ModelQueue, ModelQueueHandle, QueueSettings
from hloserve.config import Config, ModelSettings, SchedulerConfig
from hloserve.engine.model_entry import Failed, Loaded, Meta, ModelEntry, Remote, registration_of
from hloserve.engine.policy import ModelPolicy
from hloserve.engine.statistics import Statistics
from hloserve.errors import BundleError, ConfigError, InvalidInput, ModelNotFound
from hloserve.models.bundle import (
    Bundle,
    bundle_directory,
    check_model_name,
    discover,
    load_bundle,
)
from hloserve.models.compiled import CompiledModel
from hloserve.models.load_files import remove, write_bundle
from hloserve.models.model_py import Registration
from hloserve.models.programs import Programs
from hloserve.types import RESIDENCIES, Discipline, Residency

__all__ = [
    "Failed",
    "Loaded",
    "Meta",
    "ModelEntry",
    "ModelHost",
    "ModelTable",
    "Prepared",
    "Remote",
    "prepare",
    "prepare_repository",
]

log = structlog.get_logger("hloserve.worker")

T = TypeVar("T")


class ModelHost(Protocol):
    """What the planes and the control service need of a worker: its configuration, statistics
    and model table, and the calls that change them (each applied between executions)."""

    @property
    def config(self) -> Config: ...
    @property
    def statistics(self) -> Statistics: ...
    @property
    def weight_budget(self) -> int | None: ...
    @property
    def models(self) -> Mapping[str, ModelEntry]: ...
    def from_files(self, name: str) -> bool: ...
    async def load_model(
        self, name: str, settings: ModelSettings | None = None, files: Mapping[str, bytes] | None = None
    ) -> None: ...
    async def unload_model(self, name: str) -> None: ...
    async def reload_model_py(self, name: str) -> None: ...
    async def record_failure(self, name: str, reason: str) -> None: ...
    async def set_policy(
        self, model: str | None, *, weight: float | None = None, discipline: Discipline | None = None
    ) -> None: ...
    async def set_residency(self, model: str, floor: Residency) -> tuple[Residency, bool]: ...
    async def compact(self, reload: Sequence[str] = ()) -> Compacted: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A bundle read, its model.py run, compiled and warmed up: ready for `ModelTable._put`."""

    bundle: Bundle
    compiled: CompiledModel | None
    """None for a meta model, which has no executable."""
    costs: dict[int, float]
    """Seconds per execution by batch size, measured by the warm-up run."""
    registration: Registration | None
    """What its model.py registered."""
    peak_bytes: int | None
    """The allocator's peak after the warm-up (None where the backend keeps no statistics)."""
    seconds: float
    """How long preparing it took."""
    shared: bool = False
    """Its program was loaded already, for another model: neither compiled nor warmed up."""


def prepare(bundle: Bundle, programs: Programs) -> Prepared:
    """Run its model.py and get its program: shared with the models whose modules are
    byte-identical, else compiled and run once per size on zeros (blocking: call in a worker
    thread). Its weights are not read here: residency is the weight cache's."""
    started = time.perf_counter()
    registration = registration_of(bundle)
    if bundle.manifest.is_meta:
        return Prepared(bundle, None, {}, registration, None, time.perf_counter() - started)
    program, shared = programs.load(bundle)
    return Prepared(
        bundle,
        CompiledModel(bundle, program),
        dict(program.costs),
        registration,
        program.peak_bytes,
        time.perf_counter() - started,
        shared,
    )


async def prepare_repository(repository: Path, programs: Programs) -> dict[str, Prepared | Failed]:
    """Every bundle of the repository, prepared, or why not (start-up: before the actors, whose
    weight budget depends on what was compiled). All in one worker thread: for a variant whose
    program is loaded already, preparing takes microseconds, less than a hop to a thread."""
    if not repository.is_dir():
        raise ConfigError("server.model_repository", f"{repository} is not a directory")
    found = await trio.to_thread.run_sync(discover, repository)
    return await trio.to_thread.run_sync(_prepare_all, found, programs)


def _prepare_all(
    found: list[tuple[str, Bundle | BundleError]], programs: Programs
) -> dict[str, Prepared | Failed]:
    bundles = {name: bundle if isinstance(bundle, Bundle) else None for name, bundle in found}
    prepared: dict[str, Prepared | Failed] = {}
    for name, bundle in found:
        try:
            if isinstance(bundle, BundleError):
                raise bundle
            prepared[name] = prepare(bundle, programs)
            if bundle.manifest.is_meta:  # against every bundle found, whatever the order
                _check_meta(bundle, bundles)
        except BundleError as e:
            prepared[name] = Failed(str(e))
            log.error("bundle rejected", model=name, reason=str(e))
        except Exception as e:  # a module XLA cannot compile is one bad bundle, not a dead server
            prepared[name] = Failed(f"bundle {name!r}: compilation failed: {e}")
            log.error("bundle failed to compile", model=name, reason=str(e))
    return prepared


class ModelTable:
    """The models of one worker and the calls that change them; see the module docstring."""

    def __init__(
        self,
        config: Config,
        weight_budget: int | None,
        statistics: Statistics,
        dispatcher: trio.MemorySendChannel[DispatcherMessage],
        nursery: trio.Nursery,
        programs: Programs,
    ) -> None:
        self.config = config
        self.weight_budget = weight_budget
        """Bytes of weights loaded on demand at once (configured or resolved); None: no eviction."""
        self.statistics = statistics
        self._entries: dict[str, ModelEntry] = {}
        self._dispatcher = dispatcher
        self._nursery = nursery  # where model queues run
        self.programs = programs
        """The loaded programs, shared by models with byte-identical modules."""
        self._turns: dict[str, trio.Lock] = {}
        """Per model name while a load, unload, reload or control call for it is under way."""
        self._loads: Path | None = None
        """Where bundles sent in load requests are written (created at the first; `close`)."""
        self._private: dict[str, Path] = {}
        """The private directory of each model serving from files sent in its load."""

    @property
    def models(self) -> Mapping[str, ModelEntry]:
        """Every model by name (one mapping for the worker's life: the planes keep it)."""
        return self._entries

    async def start(self, prepared: Mapping[str, Prepared | Failed]) -> None:
        """Serve what start-up prepared, through the path every load takes."""
        for name, model in prepared.items():
            if isinstance(model, Prepared):
                try:
                    _check_settings(
                        name, self.config.scheduler.models.get(name, ModelSettings()), model.compiled
                    )
                except InvalidInput as e:
                    model = Failed(f"scheduler.models.{name}: {e.problem}")
            if isinstance(model, Failed):
                self._entries[name] = ModelEntry(name, model)
            else:
                await self._put(name, model)

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

    @property
    def loads_directory(self) -> Path | None:
        """Where the private directories of bundles sent in load requests are (None: none yet)."""
        return self._loads

    def from_files(self, name: str) -> bool:
        """Whether `name` serves a bundle sent in its load request (not the repository's)."""
        return name in self._private

    async def load_model(
        self, name: str, settings: ModelSettings | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """Load the bundle `name` from the repository, or reload it: it is read and compiled
        outside the dispatch loop (other models keep serving), and only then replaces the old
        version, which keeps serving if the new one fails. `name` is a plain name (no path) and
        the bundle must lie inside the repository. `settings` (a load's config override)
        replace the model's `scheduler.models` entry once the bundle is ready.

        `files` (checked by `load_files.check_files`) is a bundle sent in the request: written
        into a private directory, loaded from there, which lives while the model serves from it
        (removed at its unload, its replacement, a failed load, `close`)."""
        if files is None:
            directory = bundle_directory(self.config.server.model_repository, name)
        async with self._turn(check_model_name(name)):
            private = None
            if files is not None:
                private = await trio.to_thread.run_sync(write_bundle, self._loads_root(), name, files)
                directory = private / name
            try:
                if not (directory / "manifest.yaml").is_file():
                    where = "the files sent have" if private else "the repository has"
                    missing = f"{where} no bundle {name!r} (no manifest.yaml)"
                    raise ModelNotFound(name, f"failed to load: {missing}")  # Triton's words, matched on
                bundle = await trio.to_thread.run_sync(load_bundle, directory)
                prepared = await trio.to_thread.run_sync(prepare, bundle, self.programs)
                if bundle.manifest.is_meta:
                    _check_meta(bundle, {n: e.bundle for n, e in self._entries.items()})
                _check_settings(
                    name,
                    settings or self.config.scheduler.models.get(name, ModelSettings()),
                    prepared.compiled,
                )
                if settings is not None:
                    models = {**self.config.scheduler.models, name: settings}
                    self.config = self.config.replace("scheduler", models=models)
                await self._put(name, prepared)
            except BaseException:
                if private is not None:
                    await _remove_files(private)
                raise
            await self._forget_files(name)
            if private is not None:
                self._private[name] = private

    def _loads_root(self) -> Path:
        if self._loads is None:
            self._loads = Path(tempfile.mkdtemp(prefix="hloserve-loads-"))
        return self._loads

    async def _forget_files(self, name: str) -> None:
        """Remove the private directory `name` served from, if any."""
        private = self._private.pop(name, None)
        if private is not None:
            await _remove_files(private)

    def close(self) -> None:
        """Remove every private directory of a bundle sent in a load (at shutdown)."""
        self._private.clear()
        if self._loads is not None:
            remove(self._loads)

    async def _put(self, name: str, prepared: Prepared) -> None:
        """Add a prepared model, or replace the version served: a model served already is
        replaced in place, its requests flowing on (no gap). Returns once its weights are at
        their floor."""
        old = self._entries.get(name)
        bundle, compiled, registration = prepared.bundle, prepared.compiled, prepared.registration
        source = "repository load" if old is None or not old.ready else "reload"
        if compiled is None:  # a meta model: nothing for the dispatcher
            assert registration is not None  # a meta's model.py registers its run (`registration_of`)
            if old is not None and isinstance(old.state, Loaded):
                await self._remove(name)
            self._entries[name] = ModelEntry(name, Meta(bundle, registration))
            log.info(
                "model loaded", model=name, source=source, kind="meta", calls=list(bundle.manifest.calls)
            )
            return
        scheduler = self.config.scheduler
        queue = ModelQueue(
            name, _queue_settings(scheduler, compiled), self._dispatcher.clone(), self.statistics
        )
        handle: ModelQueueHandle = await self._nursery.start(supervised, f"model queue {name!r}", queue.run)
        floor = scheduler.models.get(name, ModelSettings()).floor
        send, placed = trio.open_memory_channel[outcome.Outcome[None]](1)
        self._dispatcher.send_nowait(
            AddModel(name, compiled, _policy(scheduler, name, prepared.costs), handle, floor, send)
        )
        self._entries[name] = ModelEntry(name, Loaded(bundle, compiled, handle, registration))
        program = compiled.program
        if prepared.shared:  # no compile, no warm-up: say whose program it runs
            log.info(
                "model loaded",
                model=name,
                source=source,
                program=program.digest[:16],
                shared_with=program.loaded_for,
                weight_bytes=bundle.weight_nbytes,
                load_s=round(prepared.seconds, 4),
                model_py=bundle.model_py is not None,
            )
        else:
            log.info(
                "model loaded",
                model=name,
                source=source,
                program=program.digest[:16],
                batch_sizes=list(compiled.batch_sizes),
                weight_bytes=bundle.weight_nbytes,
                scratch_bytes=compiled.scratch_bytes,
                compile_s=round(compiled.compile_s, 3),
                load_s=round(prepared.seconds, 3),
                warm_up_ms={size: round(s * 1e3, 3) for size, s in prepared.costs.items()},
                model_py=bundle.model_py is not None,
            )
        (await placed.receive()).unwrap()

    async def record_failure(self, name: str, reason: str) -> None:
        """List a bundle that could not be loaded, with why (RepositoryIndex shows it), unless
        the table has an entry for it already (a client loaded it meanwhile, or it failed before)."""
        async with self._turn(check_model_name(name)):
            self._entries.setdefault(name, ModelEntry(name, Failed(reason)))

    async def reload_model_py(self, name: str) -> None:
        """Execute `name`'s model.py again and swap in what it registers; requests already past
        a hook finish with the old one. A model.py that fails leaves the old hooks in place."""
        async with self._turn(check_model_name(name)):
            entry = self._entries.get(name)
            if entry is None or isinstance(entry.state, Failed) or entry.state.bundle.model_py is None:
                raise ModelNotFound(name, "no serving bundle with a model.py by that name")
            registration = await trio.to_thread.run_sync(registration_of, entry.state.bundle)
            assert registration is not None  # it has a model.py
            state = dataclasses.replace(entry.state, registration=registration)
            self._entries[name] = ModelEntry(name, state)
        log.info("model.py reloaded", model=name)

    async def unload_model(self, name: str) -> None:
        """Stop serving `name`: new requests get NOT_FOUND at once, queued ones too; its
        weights leave the device."""
        async with self._turn(check_model_name(name)):
            await self._remove(name)

    async def _remove(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is None:
            raise ModelNotFound(name)
        await self._forget_files(name)
        if isinstance(entry.state, Loaded):
            await self._ask(lambda reply: RemoveModel(name, reply))
        log.info("model unloaded", model=name)

    def _executable(self, model: str) -> ModelEntry:
        """The serving model `model` that has an executable (policy and residency apply)."""
        entry = self._entries.get(check_model_name(model))
        if entry is None or not entry.ready:
            raise ModelNotFound(model)
        if not isinstance(entry.state, Loaded):
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

    async def set_residency(self, model: str, floor: Residency) -> tuple[Residency, bool]:
        """Externally managed residency: pin `model` on the device (`device`), or free it from
        the device keeping (`system`) or dropping (`unpinned`) its host copy. Returns the floor
        and whether it is on the device; ResidencyRefused in self-managed mode."""
        if floor not in RESIDENCIES:
            raise ValueError(f"residency must be unpinned, system or device, got {floor!r}")
        async with self._turn(check_model_name(model)):
            self._executable(model)
            return await self._ask(lambda reply: SetResidency(model, floor, reply))

    async def compact(self, reload: Sequence[str] = ()) -> Compacted:
        """Free every resident unpinned model's weights, then load `reload`; between executions."""
        for model in reload:  # at once: a long list of unknown names waits on nothing
            self._executable(model)
        async with self._turn(*reload):
            for model in reload:
                self._executable(model)
            return await self._ask(lambda reply: Compact(tuple(reload), reply))

    async def _ask(
        self, message: Callable[[trio.MemorySendChannel[outcome.Outcome[T]]], DispatcherMessage]
    ) -> T:
        """Send the dispatcher `message(reply_to)` and return its answer (raised if an error)."""
        send, receive = trio.open_memory_channel[outcome.Outcome[T]](1)
        await self._dispatcher.send(message(send))
        return (await receive.receive()).unwrap()


def _policy(scheduler: SchedulerConfig, model: str, costs: dict[int, float]) -> ModelPolicy:
    settings = scheduler.models.get(model, ModelSettings())
    budget = None if settings.latency_budget_ms is None else settings.latency_budget_ms / 1e3
    return ModelPolicy(
        weight=settings.weight, cost=dict(costs), discipline=settings.discipline, latency_budget_s=budget
    )


def _check_settings(name: str, settings: ModelSettings, compiled: CompiledModel | None) -> None:
    """A model's settings fit its bundle: a batch limit needs a batch axis and a compiled size;
    preferred sizes must be compiled sizes, within the limit, of requests that can be joined."""
    sizes = () if compiled is None else tuple(b for b in compiled.batch_sizes if b > 0)
    compiled_sizes = f"compiled: {list(sizes) or 'none, no batch axis'}"
    limit = settings.max_batch_size
    if limit is not None and (not sizes or limit < sizes[0]):
        raise InvalidInput(name, f"{_MAX_BATCH}: {limit} fits no compiled batch size ({compiled_sizes})")
    if limit is not None and limit > sizes[-1] and compiled is not None and not compiled.coalescable:
        raise InvalidInput(
            name,
            f"{_MAX_BATCH}: {limit} exceeds the largest compiled batch size {sizes[-1]}, and a request to "
            "it cannot be split (an output has no batch axis)",
        )
    preferred = settings.preferred_batch_sizes or ()
    wrong = [s for s in preferred if s not in sizes]
    if wrong:
        raise InvalidInput(name, f"{_PREFERRED}: {wrong} are not compiled batch sizes ({compiled_sizes})")
    if preferred and limit is not None and preferred[-1] > limit:
        raise InvalidInput(name, f"{_PREFERRED}: {preferred[-1]} exceeds max_batch_size {limit}")
    if preferred and compiled is not None and not compiled.coalescable:
        raise InvalidInput(
            name, f"{_PREFERRED}: requests to it cannot be joined (an output has no batch axis)"
        )


_MAX_BATCH = "load parameter 'config', field 'max_batch_size'"
_PREFERRED = "field 'dynamic_batching.preferred_batch_size' (scheduler.models preferred_batch_sizes)"


def _queue_settings(scheduler: SchedulerConfig, compiled: CompiledModel) -> QueueSettings:
    settings = scheduler.models.get(compiled.name, ModelSettings())
    return QueueSettings(
        batch_sizes=settings.preferred_batch_sizes or compiled.batch_sizes,
        coalescable=compiled.coalescable,
        max_depth=settings.max_queue_depth or scheduler.max_queue_depth,
        max_batch_size=settings.max_batch_size,
        max_queue_delay_s=settings.max_queue_delay_us / 1e6,
    )


async def _remove_files(private: Path) -> None:
    """Remove a sent bundle's private directory in a worker thread, even while cancelled:
    unlinking its files is linear in the client's bytes (36 MiB took 13 ms on an idle machine,
    longer under load)."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(remove, private)


def _check_meta(bundle: Bundle, bundles: Mapping[str, Bundle | None]) -> None:
    """A meta model may not call another meta; a callee served elsewhere is only noted."""
    for callee in bundle.manifest.calls:
        if callee not in bundles:
            log.info("meta model calls a model this worker does not serve", model=bundle.name, callee=callee)
            continue
        other = bundles[callee]
        if other is not None and other.manifest.is_meta:
            raise BundleError(
                bundle.name,
                "manifest.yaml",
                "meta.calls",
                f"{callee!r} is a meta model; a meta may not call a meta",
            )
