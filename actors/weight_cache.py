"""WeightCache: whose weights are on the device, within a byte budget, least recently used out.

Owns each model's residency floor (`unpinned`: read from the file at every load; `system`: read
once into host memory, pinned (page-locked) where the backend has it, so a load is one
host-to-device copy by DMA; `device`: loaded at start and never evicted), the device buffers,
the LRU order and the counters. Its inbox takes `Acquire`, `Prefetch` and `Compact` from the
dispatcher, the only holder of its send side. `Acquire` is answered with the model's device
weights, loaded first when needed after evicting least-recently-used unpinned models to fit the
budget (or `NotResident` when residency is managed externally); `Prefetch` starts a model's
copy in a worker thread and returns at once, so that the copy overlaps the execution in flight
(the budget counts it from its start; nothing evicts a model whose copy is in flight, and
an `Acquire` of it waits for the copy); `Compact` frees every resident unpinned model and
reloads a list, to defragment the device allocator. Every other message waits for the copies
in flight to end first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import outcome
import structlog
import trio

from hloserve.actors import INLINE_WORK_S
from hloserve.actors.messages import (
    Acquire,
    AddWeights,
    Compact,
    Compacted,
    DropWeights,
    Prefetch,
    SetResidency,
    WeightCacheMessage,
    answer,
)
from hloserve.engine.statistics import Statistics
from hloserve.errors import ExecutionFailed, ModelNotFound, NotResident, ResidencyRefused
from hloserve.models import _xla
from hloserve.models.bundle import Bundle, read_weights
from hloserve.models.shared_weights import SharedHostWeights
from hloserve.types import Residency

__all__ = ["WeightCache", "WeightCacheHandle", "device_copy"]

log = structlog.get_logger("hloserve.weight_cache")

INLINE_READ_BYTES = 64 << 10
"""A `system` floor of at most this many bytes (and not shared with other workers) is read on
the loop's thread when its model is added: tens of microseconds from the page cache."""

HostArray = np.ndarray | _xla.DeviceArray
"""One array of a host floor: a numpy array (pageable), or a jax array in pinned host memory."""


def device_copy(arrays: Sequence[HostArray]) -> list[_xla.DeviceArray]:
    """Copy one model's weights from the host to the device. Looked up at each load, so a test
    can stand in a copy of known duration: on a CPU the real one aliases host memory and takes
    microseconds, which leaves nothing to overlap or to count."""
    return _xla.put_all(arrays)


@dataclass(slots=True)
class _Model:
    bundle: Bundle
    floor: Residency
    nbytes: int
    host: list[HostArray] | None  # the host floor of a `system` model
    device: list[_xla.DeviceArray] | None = None  # on the device when not None
    pinned: bool = False  # the host floor is in pinned host memory
    transfer: trio.Event | None = None  # set when the copy in flight (started by a Prefetch) ends


@final
class WeightCacheHandle:
    """The dispatcher's way to the cache: one request at a time, over its own reply channel."""

    def __init__(self, send: trio.MemorySendChannel[WeightCacheMessage]) -> None:
        self._send = send
        self._reply_send, self._replies = trio.open_memory_channel[outcome.Outcome[list[_xla.DeviceArray]]](1)

    async def acquire(self, model: str) -> list[_xla.DeviceArray]:
        """The model's device weights, loading them if needed; raises NotResident."""
        await self._send.send(Acquire(model, self._reply_send))
        return (await self._replies.receive()).unwrap()

    async def prefetch(self, model: str, keep: frozenset[str]) -> None:
        """Start copying `model`'s weights to the device, evicting none of `keep`; no reply."""
        await self._send.send(Prefetch(model, keep))

    async def forward(self, message: Compact | SetResidency | AddWeights | DropWeights) -> None:
        """Pass on a compaction (its reply goes straight to whoever asked)."""
        await self._send.send(message)


class WeightCache:
    """The actor; see the module docstring."""

    def __init__(
        self,
        statistics: Statistics,
        *,
        budget_bytes: int | None,
        externally_managed: bool,
        compaction_interval: int = 0,
        share_mode: int | None = None,
        pin_host_floors: bool | None = None,
    ) -> None:
        """An empty cache: each model's weights join it with `AddWeights`."""
        self._models: dict[str, _Model] = {}
        self._budget = budget_bytes
        self._externally_managed = externally_managed
        self._statistics = statistics
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident unpinned models, oldest first
        self.resident_bytes = 0
        self._compaction_interval = compaction_interval  # loads between compactions; 0: never
        self._share_mode = share_mode  # permissions of shared host floors; None: private floors
        self._shared: dict[str, SharedHostWeights] = {}  # shared host floors held, by model
        # put private `system` floors in pinned host memory (None: where that beats pageable memory)
        self._pin = _xla.pinning_pays() if pin_host_floors is None else pin_host_floors
        self._loads_since_compaction = 0
        self._copied_bytes = 0  # bytes copied from host floors to the device since start...
        self._copy_seconds = 0.0  # ...and the seconds those copies took
        self._transfers = 0  # copies in flight (started by Prefetch)
        self._in_flight: set[str] = set()  # the models of those copies
        self._transfers_ended = trio.Event()  # set when the last copy in flight ends
        self._transfers_ended.set()
        self._nursery: trio.Nursery | None = None
        self._send, self._receive = trio.open_memory_channel[WeightCacheMessage](0)

    @property
    def seconds_per_byte(self) -> float:
        """The measured cost of copying a byte from a host floor to the device (inf: none yet)."""
        return self._copy_seconds / self._copied_bytes if self._copied_bytes else math.inf

    async def run(
        self, *, task_status: trio.TaskStatus[WeightCacheHandle] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            async with trio.open_nursery() as self._nursery:  # the copies in flight
                await self._run(task_status)
        finally:
            for shared in self._shared.values():
                shared.release()

    async def _run(self, task_status: trio.TaskStatus[WeightCacheHandle]) -> None:
        await trio.to_thread.run_sync(self._fill_floors)
        for name in self._models:
            self._publish(name)
        task_status.started(WeightCacheHandle(self._send))
        async with self._receive:
            async for message in self._receive:
                try:
                    if not isinstance(message, Acquire | Prefetch):
                        await self._transfers_ended.wait()  # nothing else runs beside a copy
                    await self._on_message(message)
                except Exception as e:  # a bug answers its asker (INTERNAL), the cache carries on
                    log.exception("weight cache message failed", message=type(message).__name__)
                    answer(message.reply_to, outcome.Error(e))

    async def _on_message(self, message: WeightCacheMessage) -> None:
        """Apply one message. One naming a model the cache no longer holds (it was unloaded
        meanwhile) is answered NOT_FOUND."""
        match message:
            case Acquire() | SetResidency() if message.model not in self._models:
                message.reply_to.send_nowait(outcome.Error(ModelNotFound(message.model, "it was unloaded")))
            case Compact() if unknown := [n for n in message.reload if n not in self._models]:
                message.reply_to.send_nowait(outcome.Error(ModelNotFound(unknown[0], "it was unloaded")))
            case Acquire():
                await self._on_acquire(message)
            case Prefetch():
                self._on_prefetch(message)
            case Compact():
                message.reply_to.send_nowait(outcome.Value(await self._compact(message.reload)))
            case SetResidency():
                await self._on_set_residency(message)
            case AddWeights():
                await self._on_add(message)
            case DropWeights():
                self._on_drop(message)
            case _:
                raise TypeError(f"WeightCache got an unknown message {message!r}")

    def _fill_floors(self) -> None:
        """Read `system` floors into host memory and load `device` models (blocking)."""
        for name, model in self._models.items():
            if model.floor == "system":
                model.host, model.pinned = self._host_floor(name, model.bundle)
            elif model.floor == "device":
                model.device = [_xla.put(a) for a in read_weights(model.bundle)]
        log.info(
            "weight floors ready",
            system=sorted(n for n, m in self._models.items() if m.floor == "system"),
            device=sorted(n for n, m in self._models.items() if m.floor == "device"),
            budget_bytes=self._budget,
        )

    async def _on_acquire(self, message: Acquire) -> None:
        model = self._models[message.model]
        if model.transfer is not None:  # prefetched: its copy is under way
            await model.transfer.wait()
        if model.device is not None:
            if model.floor != "device":
                self._lru.move_to_end(message.model)
            message.reply_to.send_nowait(outcome.Value(model.device))
            return
        if self._externally_managed:
            message.reply_to.send_nowait(outcome.Error(NotResident(message.model)))
            return
        if self._compaction_interval and self._loads_since_compaction >= self._compaction_interval:
            await self._transfers_ended.wait()
            await self._compact(())
        try:
            await self._load(message.model, model)
        except Exception as e:  # a weights file that cannot be read now fails this model's batch
            message.reply_to.send_nowait(
                outcome.Error(ExecutionFailed(message.model, f"loading its weights failed: {e}"))
            )
            return
        assert model.device is not None
        message.reply_to.send_nowait(outcome.Value(model.device))

    def _make_room(self, model: _Model, keep: frozenset[str] = frozenset()) -> bool:
        """Evict least-recently-used models, none in `keep` nor with a copy in flight, until
        `model` fits the budget; whether it does."""
        if self._budget is None:
            return True
        victims, missing = [], self.resident_bytes + model.nbytes - self._budget
        for victim in self._lru:  # oldest first, only as far as needed: O(evicted + skipped)
            if missing <= 0:
                break
            candidate = self._models[victim]
            if victim not in keep and candidate.transfer is None:
                victims.append(victim)
                missing -= candidate.nbytes
        for victim in victims:
            self._evict(victim)
        return self.resident_bytes + model.nbytes <= self._budget

    async def _load(self, name: str, model: _Model) -> None:
        """Evict least-recently-used models until `model` fits, then copy it to the device."""
        if not self._make_room(model) and self._transfers:
            await self._transfers_ended.wait()  # the copies in flight hold the room: let them end
            self._make_room(model)
        if self._budget is not None and self.resident_bytes + model.nbytes > self._budget:
            log.warning(
                "model exceeds the weight budget even with every other model evicted; loading anyway",
                model=name,
                weight_bytes=model.nbytes,
                budget_bytes=self._budget,
            )
        started = time.monotonic()
        self._reserve(name, model)
        try:
            model.device = (
                self._copy(model) if self._quick(model) else await trio.to_thread.run_sync(self._copy, model)
            )
        except BaseException:
            self._unreserve(name, model)
            raise
        self._loaded(name, started, overlapped=False)

    def _on_prefetch(self, message: Prefetch) -> None:
        """Start a model's copy unless it is on the device, under way, or has no room without
        evicting what `keep` names or another copy in flight."""
        name, model = message.model, self._models.get(message.model)
        if (
            model is None
            or model.device is not None
            or model.transfer is not None
            or self._externally_managed
        ):
            return
        if self._budget is not None:
            # what must stay (the LRU's bytes are resident_bytes): O(kept + in flight), not O(resident)
            held = sum(self._models[n].nbytes for n in message.keep | self._in_flight if n in self._lru)
            if held + model.nbytes > self._budget:
                log.debug("no room to prefetch; the model loads when it runs", model=name)
                return  # evicting would not make room: evict nothing
        self._make_room(model, message.keep)
        started = time.monotonic()
        self._reserve(name, model)
        self._statistics[name].weight_prefetches += 1
        if self._quick(model):  # microseconds (a CPU aliases the floor): no thread, nothing in flight
            model.device = self._copy(model)
            self._loaded(name, started, overlapped=True)
            return
        model.transfer = trio.Event()
        self._in_flight.add(name)
        if not self._transfers:
            self._transfers_ended = trio.Event()
        self._transfers += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._transfer, name, model, started)

    async def _transfer(self, name: str, model: _Model, started: float) -> None:
        """A prefetched model's copy, in a worker thread; a failure leaves it to load when it runs."""
        try:
            model.device = await trio.to_thread.run_sync(self._copy, model)
        except Exception as e:
            log.warning("prefetching weights failed; the model loads when it runs", model=name, error=str(e))
            self._unreserve(name, model)
        else:
            self._loaded(name, started, overlapped=True)
        finally:
            assert model.transfer is not None
            model.transfer.set()
            model.transfer = None
            self._in_flight.discard(name)
            self._transfers -= 1
            if not self._transfers:
                self._transfers_ended.set()

    def _quick(self, model: _Model) -> bool:
        """A host floor whose copy is known to be quick (on CPU the device aliases it: microseconds)
        loads on the loop's thread; a file read, or a copy not yet timed or too long, in a worker.
        (No weights at all is quick too: inf seconds per byte times 0 bytes would be NaN.)"""
        return model.host is not None and (
            model.nbytes == 0 or self.seconds_per_byte * model.nbytes <= INLINE_WORK_S
        )

    def _copy(self, model: _Model) -> list[_xla.DeviceArray]:
        """Read (an `unpinned` floor) and copy a model's weights to the device (blocking)."""
        host = model.host
        arrays = host if host is not None else read_weights(model.bundle)
        copying = time.perf_counter()
        device = device_copy(arrays)
        for array in device:
            array.block_until_ready()
        if host is not None and model.nbytes:
            self._copy_seconds += time.perf_counter() - copying
            self._copied_bytes += model.nbytes
        return device

    def _reserve(self, name: str, model: _Model) -> None:
        """Count a model's bytes against the budget from the start of its copy."""
        self.resident_bytes += model.nbytes
        self._lru[name] = None
        self._statistics.device_weight_bytes = self.resident_bytes

    def _unreserve(self, name: str, model: _Model) -> None:
        self.resident_bytes -= model.nbytes
        self._lru.pop(name, None)
        self._statistics.device_weight_bytes = self.resident_bytes

    def _loaded(self, name: str, started: float, overlapped: bool) -> None:
        """Count a load that began at `started` (monotonic); `overlapped`: a prefetch, begun while
        another model executed (the dispatcher prefetches only then)."""
        self._loads_since_compaction += 1
        stats = self._statistics[name]
        nbytes = self._models[name].nbytes
        ended = time.monotonic()
        stats.record_load(ended - started, nbytes)
        stats.last_load = (started, ended, nbytes, overlapped)
        if self._copied_bytes:
            self._statistics.seconds_per_weight_byte = self.seconds_per_byte
        self._publish(name)

    def _host_floor(self, name: str, bundle: Bundle) -> tuple[list[HostArray], bool]:
        """The model's host copy (blocking): in a region shared with the node's other workers
        (pageable: JAX cannot pin memory it did not allocate), else private, pinned where the
        device has pinned host memory and `weights.pin_host_floors` says so; and whether it is
        pinned. Pinning that fails leaves the floor pageable, with a warning."""
        if self._share_mode is not None and bundle.weights_path is not None:
            shared = self._shared.get(name) or SharedHostWeights.acquire(bundle, self._share_mode)
            self._shared[name] = shared
            log.info(
                "shared host weights", model=name, region=shared.name, filled=shared.filled, pinned=False
            )
            return list(shared.arrays), False
        arrays = read_weights(bundle)
        if not self._pin or not arrays:
            return list(arrays), False
        if not _xla.pinned_host_available():
            log.info("no pinned host memory on this device; host floors stay pageable", model=name)
            return list(arrays), False
        try:
            return list(_xla.pin(arrays)), True
        except Exception as e:  # the locked-memory limit, too little memory: serve from pageable memory
            log.warning(
                "pinning the host floor failed; its loads copy from pageable memory",
                model=name,
                weight_bytes=bundle.weight_nbytes,
                error=str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
            )
            return list(arrays), False

    async def _on_add(self, message: AddWeights) -> None:
        floor: Residency = message.floor
        model = _Model(message.bundle, floor, message.bundle.weight_nbytes, None)
        if floor == "system" and model.nbytes <= INLINE_READ_BYTES and self._share_mode is None:
            # a thread hop costs more than reading a few KB: what thousands of small variants pay
            model.host, model.pinned = self._host_floor(message.name, model.bundle)
        elif floor == "system":
            model.host, model.pinned = await trio.to_thread.run_sync(
                self._host_floor, message.name, model.bundle
            )
        elif floor == "device":
            model.device = await trio.to_thread.run_sync(
                lambda: [_xla.put(a) for a in read_weights(model.bundle)]
            )
        self._models[message.name] = model
        self._publish(message.name)
        answer(message.reply_to, outcome.Value(None))

    def _on_drop(self, message: DropWeights) -> None:
        model = self._models.get(message.name)
        if model is not None and model.device is not None:
            if model.floor != "device":
                self.resident_bytes -= model.nbytes
                self._lru.pop(message.name, None)
            _xla.free(model.device)
        if model is not None and model.pinned and model.host is not None:
            _xla.free([a for a in model.host if not isinstance(a, np.ndarray)])  # pinned memory back now
        self._models.pop(message.name, None)
        shared = self._shared.pop(message.name, None)
        if shared is not None:
            shared.release()
        answer(message.reply_to, outcome.Value(None))

    async def _on_set_residency(self, message: SetResidency) -> None:
        """Externally managed residency: `device` loads and pins; `system` and `unpinned` free the
        device buffers at once, keeping or dropping the host copy."""
        if not self._externally_managed:
            message.reply_to.send_nowait(
                outcome.Error(
                    ResidencyRefused("residency is self-managed; set weights.externally_managed to manage it")
                )
            )
            return
        name, model = message.model, self._models[message.model]
        floor: Residency = message.floor
        try:
            if floor == "device":
                if model.device is None:
                    await self._load(name, model)
                self._lru.pop(name, None)
                if model.floor != "device":
                    self.resident_bytes -= model.nbytes  # pinned weights are outside the budget
            else:
                if model.device is not None:
                    if model.floor == "device":  # unpinned: back under the budget, then out
                        self.resident_bytes += model.nbytes
                        self._lru[name] = None
                        model.floor = floor
                    self._evict(name, cause="control")
                if floor == "system" and model.host is None:
                    model.host, model.pinned = await trio.to_thread.run_sync(
                        self._host_floor, name, model.bundle
                    )
                if floor == "unpinned":
                    model.host, model.pinned = None, False
        except Exception as e:  # the weights file cannot be read now
            failed = ExecutionFailed(name, f"changing residency failed: {e}")
            message.reply_to.send_nowait(outcome.Error(failed))
            return
        model.floor = floor
        self._publish(name)
        message.reply_to.send_nowait(outcome.Value((floor, model.device is not None)))

    async def _compact(self, reload: tuple[str, ...]) -> Compacted:
        """Free every resident unpinned model, then load `reload` (pinned ones stay as they are)."""
        before = self.resident_bytes
        for name in list(self._lru):
            self._evict(name, counted=False, cause="compaction")
        reloaded = []
        for name in reload:
            model = self._models[name]
            if model.device is None and not self._externally_managed:
                await self._load(name, model)
                reloaded.append(name)
        self._loads_since_compaction = 0
        self._statistics.compactions += 1
        log.info("memory compacted", resident_bytes_before=before, resident_bytes_after=self.resident_bytes,
                 reloaded=reloaded, device_memory=_xla.memory_stats())  # fmt: skip
        return Compacted(tuple(reloaded), self.resident_bytes)

    def _evict(self, name: str, counted: bool = True, cause: str = "budget") -> None:
        """Free `name`'s device weights; `cause` (budget, compaction, control) is counted in
        its evictions by cause, `counted` ones in its evictions too."""
        model = self._models[name]
        assert model.device is not None and model.floor != "device"
        _xla.free(model.device)
        model.device = None
        self.resident_bytes -= model.nbytes
        del self._lru[name]
        self._statistics.device_weight_bytes = self.resident_bytes
        if counted:
            self._statistics[name].weight_evictions += 1
        self._statistics[name].evictions_by_cause[cause] += 1
        self._publish(name)

    def _publish(self, name: str) -> None:
        model = self._models[name]
        stats = self._statistics[name]
        stats.resident = model.device is not None
        stats.weight_bytes = model.nbytes
        stats.residency = model.floor
        stats.host_resident = model.host is not None
        stats.host_pinned = model.pinned
        self._statistics.device_weight_bytes = self.resident_bytes
