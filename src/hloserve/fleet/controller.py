"""The node controller: what the node's workers serve, where each model's requests go, and when
to repack. Off the byte path: Envoy forwards requests; this rewrites Envoy's routes.

Each round (every `node.discovery_interval_s`, or at once when something asks) it first, given
`node.workers_dns`, resolves that name again: the workers are then the addresses it names (pods
behind a headless Service come and go). Then it calls ServerReady, RepositoryIndex and
ModelControlStatus on every worker; a worker that does not answer is out of every route until it
answers again. From the status's counters it learns each model's cost per request and arrival
rate on each worker (`balance`), which weigh the workers in Envoy's least-request balancing, and
its utilisation (compute seconds per wall second). Under `lpt_packing` it repacks when enough
compute has passed (or at startup, or when an operator asks), sends CompactMemory to the workers
whose placement changed, and pins what it placed on workers whose residency is externally
managed (SetModelResidency).

A meta model and the parts it calls are one unit, as ModelControlStatus reports them: the parts
go where the meta is placed, and a meta's requests go only to workers that serve every part.

Runs on asyncio (grpclib); `hloserve node` hosts it in trio through trio-asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.config import Configuration
from grpclib.events import SendRequest, listen

from hloserve._proto import hloserve_control as control
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_status_pb2 as hot
from hloserve._transport.grpclib_patches import BigFrameChannel
from hloserve.config import NodeConfig
from hloserve.fleet import balance
from hloserve.fleet import placement as lpt
from hloserve.fleet.envoy import Endpoint

__all__ = ["Controller", "RepackRecord", "WorkerLink"]

log = structlog.get_logger("hloserve.fleet")
_ROUTES_LOGGED = 20
"""How many models a log line of the routes names (a worker's, or those whose workers changed);
it counts the rest, so that a line stays short at any catalogue."""

READY = "READY"
_Status = hot.ModelControlStatusResponse


@dataclass(eq=False)
class WorkerLink:
    """The controller's view of one worker, and its connection to it."""

    name: str
    address: str  # host:port of its gRPC
    metrics: str | None  # host:port of its Prometheus endpoint
    ready: bool = False
    models: dict[str, str] = field(default_factory=dict)  # name -> state (a meta's parts READY)
    status: _Status | None = None
    http: str | None = None  # host:port of its REST
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # meta -> the parts it serves
    headers: tuple[tuple[str, str], ...] = ()
    """Metadata sent with every call: the restricted protocols' headers (`Controller` sets them),
    so that a worker that restricts them answers the controller."""
    _channel: Channel | None = None

    @property
    def channel(self) -> Channel:
        if self._channel is None:  # made on first use: grpclib binds to the running loop
            host, _, port = self.address.rpartition(":")
            window = 64 << 20
            self._channel = BigFrameChannel(  # hours long: its closed streams bounded
                host.strip("[]"),
                int(port),
                config=Configuration(http2_connection_window_size=window, http2_stream_window_size=window),
            )
            if self.headers:
                headers = self.headers

                async def add_headers(event: SendRequest) -> None:
                    for name, value in headers:
                        event.metadata[name] = value

                listen(self._channel, SendRequest, add_headers)
        return self._channel

    @property
    def inference(self) -> kserve.GrpcInferenceServiceStub:
        return kserve.GrpcInferenceServiceStub(self.channel)

    @property
    def control(self) -> control.ControlServiceStub:
        return control.ControlServiceStub(self.channel)

    # RepositoryIndex and ModelControlStatus are read as protobuf (upb) messages: at 10,000
    # models betterproto2 took 1.6 s a worker a round to parse them, upb 4 ms (the answers
    # of two workers made the controller's round last more than 3 s).

    async def index(self, timeout: float) -> hot.RepositoryIndexResponse:
        call = UnaryUnaryMethod(
            self.channel,
            "/inference.GRPCInferenceService/RepositoryIndex",
            hot.RepositoryIndexRequest,
            hot.RepositoryIndexResponse,
        )
        return await call(hot.RepositoryIndexRequest(), timeout=timeout)

    async def control_status(self, timeout: float) -> _Status:
        call = UnaryUnaryMethod(
            self.channel,
            "/hloserve_control.ControlService/ModelControlStatus",
            hot.ModelControlStatusRequest,
            _Status,
        )
        return await call(hot.ModelControlStatusRequest(), timeout=timeout)

    def reset(self) -> None:
        """Drop the connection (a worker that stopped answering may hold a dead one)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    @property
    def serving(self) -> set[str]:
        """The models it serves now (a walk of all of them: `serves` asks for one)."""
        return {m for m, state in self.models.items() if state == READY} if self.ready else set()

    def serves(self, model: str) -> bool:
        return self.ready and self.models.get(model) == READY

    def take(self, index: hot.RepositoryIndexResponse, status: _Status) -> None:
        """What the worker serves: its index, and the parts of its metas (which it lists only
        through them)."""
        self.status = status
        self.parts = {s.name: tuple(s.parts) for s in status.models if s.meta}
        self.models = {m.name: m.state for m in index.models}
        for meta in status.models:
            self.models.update(
                (part, READY if part in meta.ready_parts else "UNAVAILABLE") for part in meta.parts
            )

    @property
    def executables(self) -> set[str]:
        """The models it has loaded that have weights of their own (a meta has none), on its
        device or not (an externally managed worker lists a model off its device UNAVAILABLE)."""
        if self.status is None:
            return set()
        models = self.status.models
        return {m.name for m in models if not m.meta} | {p for m in models if m.meta for p in m.ready_parts}


@dataclass
class RepackRecord:
    count: int = 0
    last_unix: float = 0.0
    trigger: str = ""
    models_placed: int = 0
    models_moved: int = 0
    held_by_hysteresis: int = 0
    repacks_since_compaction: int = 0
    compactions_sent: int = 0


@dataclass
class _Learned:
    """What the controller learns of one model from the workers' counters."""

    utilization: float | None = None
    weight_nbytes: int = 0


class Controller:
    """Discovery, placement and the routes they give; see the module docstring."""

    def __init__(
        self,
        node: NodeConfig,
        workers: Sequence[WorkerLink],
        publish: Callable[[Mapping[str, Sequence[Endpoint]]], None],
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.node = node
        self.headers = tuple(headers)
        """Sent with every call to a worker (`WorkerLink.headers`)."""
        for worker in workers:
            worker.headers = self.headers
        self.policy: dict[str, Any] = {
            "rebalance_compute_seconds": node.rebalance_compute_s,
            "first_rebalance_compute_seconds": node.first_rebalance_compute_s,
            "hysteresis": node.hysteresis,
            "default_replicas": node.default_replicas,
            "forbid_memory_oversubscription": node.forbid_memory_oversubscription,
            "compaction_mode": node.compaction,
            "compaction_interval": node.compaction_interval,
        }
        self.generation = 0
        self.workers = list(workers)
        self.by_name = {w.name: w for w in self.workers}
        self._publish = publish
        self._published: dict[str, tuple[Endpoint, ...]] = {}
        self.routes: dict[str, tuple[str, ...]] = {}  # model -> the gRPC addresses of its workers
        self.known: set[str] = set()  # every model any worker has listed (the union)
        self.placed: dict[str, tuple[str, ...]] = {}  # model -> worker names (lpt_packing)
        self.plan = lpt.Placement()
        self.replicas: dict[str, int] = {}  # operator overrides
        self.learned: dict[str, _Learned] = {}
        self.repack = RepackRecord()
        self.compute_accumulated = 0.0
        self.compute_repacked = False  # a traffic-driven repack has happened
        self.warnings: list[str] = []
        self.rounds = 0  # the number of the last round finished
        self._started = 0
        self._baseline: dict[tuple[str, str], float] = {}  # (worker, model) -> compute seconds
        self._counters: dict[tuple[str, str], balance.Counters] = {}
        self.traffic: dict[str, balance.Traffic] = {}  # learned per model, for the endpoint weights
        self._hints_due: set[str] = set()  # workers to tell their placement (externally managed)
        self._last_poll: float | None = None
        self._wake = asyncio.Event()
        self._round_done = asyncio.Condition()
        self.requested = 0  # repack sequence asked for by operators
        self.completed = 0  # the last one done
        self.on_ready: Callable[[WorkerLink], Awaitable[None]] | None = None
        """Called when a worker (re)joins, before it is in any route."""
        self._unresolved = False  # the last resolution of `node.workers_dns` failed
        self.routes_applied = True
        """Whether the router has applied routes that serve every model once (the node's front
        holds it False from start-up until Envoy has: at 10,000 models that takes seconds)."""

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds until cancelled."""
        try:
            while True:
                await self.round()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.node.discovery_interval_s)
                self._wake.clear()
        finally:
            for worker in self.workers:
                worker.reset()

    async def refresh(self) -> None:
        """Run a round now and wait until one that started after this call has finished (after a
        load, an unload...)."""
        wanted = self._started + 1
        async with self._round_done:
            self._wake.set()
            await self._round_done.wait_for(lambda: self.rounds >= wanted)

    async def round(self) -> None:
        self._started += 1
        number = self._started
        if self.node.workers_dns:
            await self.discover()
        await asyncio.gather(*(self._probe(w) for w in self.workers))
        for worker in self.workers:
            self.known |= set(worker.models)
        fleet = self._learn()
        if self.node.scheduling == "lpt_packing":
            await self._place(fleet)
            await self._hint()
        self._route()
        self.rounds = number
        async with self._round_done:
            self._round_done.notify_all()

    async def discover(self) -> None:
        """Make the workers the addresses `node.workers_dns` resolves to now, each named by its
        address; a failed resolution keeps the last known set."""
        host, _, port = self.node.workers_dns.rpartition(":")
        try:
            async with asyncio.timeout(self.node.probe_timeout_s):
                found = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
                )
        except (OSError, TimeoutError) as e:
            if not self._unresolved:
                log.warning(
                    "workers_dns did not resolve; keeping the last known workers", name=host, error=repr(e)
                )
            self._unresolved = True
            return
        self._unresolved = False
        self.set_workers(sorted({_join(str(info[4][0]), int(port)) for info in found}))

    def set_workers(self, addresses: Sequence[str]) -> None:
        """The workers at `addresses` (named by them): the known ones kept, the new ones added,
        the others dropped with their connections."""
        known = {w.address: w for w in self.workers}
        metrics_port = self.node.workers_metrics_port
        workers = []
        for address in addresses:
            host = address.rpartition(":")[0].strip("[]")
            workers.append(
                known.pop(address)
                if address in known
                else WorkerLink(
                    address,
                    address,
                    _join(host, metrics_port),
                    http=_join(host, self.node.workers_http_port),
                    headers=self.headers,
                )
            )
        if not known and len(workers) == len(self.workers):
            return
        for gone in known.values():
            gone.reset()
        self._baseline = {key: v for key, v in self._baseline.items() if key[0] not in known}
        self.workers = workers
        self.by_name = {w.name: w for w in workers}
        log.info("discovered workers", workers=addresses, left=sorted(known))
        self._route()  # no route (nor status page) names a worker that left

    async def _probe(self, worker: WorkerLink) -> None:
        timeout = self.node.probe_timeout_s
        was_ready = worker.ready
        try:
            ready = (await worker.inference.server_ready(kserve.ServerReadyRequest(), timeout=timeout)).ready
            worker.take(await worker.index(timeout), await worker.control_status(timeout))
            if ready and not was_ready:
                self._hints_due.add(worker.name)  # a worker that restarted has its own floors again
                if self.on_ready is not None:
                    await self.on_ready(worker)
            worker.ready = ready
        except Exception as e:  # whatever it was, the worker is out until it answers
            worker.ready = False
            worker.reset()
            if was_ready:
                log.warning("worker stopped answering; out of the routes", worker=worker.name, error=repr(e))
            return
        if worker.ready and not was_ready:
            serving = sorted(worker.serving)
            log.info(
                "worker ready; in the routes",
                worker=worker.name,
                models=len(serving),
                first_models=serving[:_ROUTES_LOGGED],
            )

    def serving(self) -> dict[str, list[str]]:
        """Each model of the union, with the ready workers that list it READY."""
        found: dict[str, list[str]] = {m: [] for m in self.known}
        for worker in self.workers:
            for model in worker.serving:  # (a probe may have answered a model `known` lacks yet)
                found.setdefault(model, []).append(worker.name)
        return found

    def _route(self) -> None:
        weighted = self.node.scheduling != "round_robin"
        loads = balance.worker_loads(self.traffic) if weighted else None
        endpoints: dict[str, tuple[Endpoint, ...]] = {}
        serving = {w.name: w.serving for w in self.workers}  # once a round: each is a walk of its models
        for model, names in self.serving().items():
            # a meta only where every part it calls is served too
            names = [n for n in names if set(self.by_name[n].parts.get(model, ())) <= serving[n]]
            placed = [n for n in self.placed.get(model, ()) if n in names]
            chosen = sorted(placed or names)  # no placement yet, or its workers are down: all that serve it
            weights = balance.endpoint_weights(model, chosen, loads) if loads is not None else {}
            endpoints[model] = tuple(
                Endpoint(self.by_name[n].address, self.by_name[n].http, weights.get(n, balance.MAX_WEIGHT))
                for n in chosen
            )
        routes = {m: tuple(sorted(e.grpc for e in es)) for m, es in endpoints.items()}
        if endpoints != self._published:
            self._published = endpoints
            self._publish(endpoints)
        if routes != self.routes:
            changed = sorted(
                m for m in routes.keys() | self.routes.keys() if routes.get(m) != self.routes.get(m)
            )
            self.routes = routes
            # bounded at any catalogue: the count, and the first models whose workers changed
            shown = {m: len(routes.get(m, ())) for m in changed[:_ROUTES_LOGGED]}
            log.info("routes", models=len(routes), changed=len(changed), workers=shown)

    # -- lpt_packing ------------------------------------------------------------------------

    def _learn(self) -> float:
        """Fold the latest counters into each model's utilisation, cost per request and arrival
        rates; returns the fleet compute seconds since the previous poll."""
        now = time.monotonic()
        elapsed = 0.0 if self._last_poll is None else now - self._last_poll
        self._last_poll = now
        delta: dict[str, float] = {}
        counters: dict[tuple[str, str], balance.Counters] = {}
        for worker in self.workers:
            if not worker.ready or worker.status is None:
                continue
            for status in worker.status.models:
                key = (worker.name, status.name)
                counters[key] = balance.Counters(status.total_compute_seconds, status.requests_served)
                before = self._baseline.get(key)
                self._baseline[key] = status.total_compute_seconds
                learned = self.learned.setdefault(status.name, _Learned())
                learned.weight_nbytes = max(learned.weight_nbytes, status.weight_nbytes)
                if before is not None and status.total_compute_seconds >= before:  # < : it restarted
                    delta[status.name] = delta.get(status.name, 0.0) + status.total_compute_seconds - before
        fleet = sum(delta.values())
        halflife = self.node.ema_halflife_compute_s or self.policy["rebalance_compute_seconds"]
        if elapsed > 0:
            for model, learned in self.learned.items():
                sample = delta.get(model, 0.0) / elapsed
                learned.utilization = lpt.ewma(learned.utilization, sample, fleet, halflife)
        self.traffic = balance.learn(self.traffic, self._counters, counters, elapsed, halflife)
        self._counters = counters
        return fleet

    def threshold(self) -> float:
        first = float(self.policy["first_rebalance_compute_seconds"])
        return (
            first
            if first > 0 and not self.compute_repacked
            else float(self.policy["rebalance_compute_seconds"])
        )

    async def _place(self, fleet: float) -> None:
        self.compute_accumulated += fleet
        polled = [w for w in self.workers if w.ready and w.status is not None]
        if not polled:
            return
        trigger = None
        if self.requested > self.completed:
            trigger = "operator"
        elif not self.placed and all(w.status is not None for w in self.workers):
            trigger = "startup"
        elif self.placed and self.compute_accumulated >= self.threshold():
            trigger = "compute"
        if trigger is None:
            return
        sequence = self.requested
        await self._repack(trigger, polled)
        self.completed = max(self.completed, sequence)

    async def _repack(self, trigger: str, polled: list[WorkerLink]) -> None:
        names = [w.name for w in polled]
        listed: dict[str, list[str]] = {}
        for worker in polled:
            for status in worker.status.models if worker.status else ():
                listed.setdefault(status.name, []).append(worker.name)
        budgets = {w.name: w.status.weight_cache_max_bytes for w in polled if w.status}
        drifted = {m: ws for m, ws in listed.items() if len(ws) != len(polled)}
        demands = {
            m: lpt.Demand(
                self.learned.get(m, _Learned()).utilization or 0.0,
                self.learned.get(m, _Learned()).weight_nbytes,
                self.replicas.get(m, 0),
            )
            for m in listed
            if m not in drifted
        }
        plan = lpt.assign(
            demands,
            names,
            budgets,
            self.placed,
            default_replicas=self.policy["default_replicas"],
            hysteresis=self.policy["hysteresis"],
            forbid_memory_oversubscription=self.policy["forbid_memory_oversubscription"],
        )
        for model, workers in drifted.items():
            plan.workers[model] = tuple(sorted(workers))
        previous = self.placed
        self.placed, self.plan = with_parts(plan.workers, polled), plan
        self.warnings = [
            f"model {m!r} is not served by every worker; placed on {ws}" for m, ws in drifted.items()
        ]
        self.warnings += [
            f"worker {w} is given more weight bytes than its budget; expect eviction churn"
            for w in plan.oversubscribed(budgets)
        ]
        record = self.repack
        record.count += 1
        record.last_unix = time.time()
        record.trigger = trigger
        record.models_placed = len(plan.workers)
        record.models_moved = plan.moved
        record.held_by_hysteresis = plan.held_by_hysteresis
        if trigger == "compute":
            self.compute_repacked = True
        self.compute_accumulated = 0.0
        log.info(
            "repack",
            trigger=trigger,
            models=len(plan.workers),
            moved=plan.moved,
            held_by_hysteresis=plan.held_by_hysteresis,
            placement={m: list(ws) for m, ws in sorted(plan.workers.items())},
        )
        for warning in self.warnings:
            log.warning(warning)
        changed = changed_workers(previous, self.placed) if previous else {w.name for w in polled}
        self._hints_due |= changed
        if previous:
            await self._compact(changed)

    def given(self, worker: WorkerLink) -> list[str]:
        """The models with weights placed on `worker` (a meta's parts, not the meta)."""
        executables = worker.executables  # built per call: once, not once per model
        return sorted(m for m, ws in self.placed.items() if worker.name in ws and m in executables)

    async def _hint(self) -> None:
        """Pin on each due worker whose residency is externally managed (it loads nothing by
        itself) the models placed on it, after releasing the others to its host floor. A
        self-managed worker warms what it was given through the reload list of its compaction."""
        due = [
            self.by_name[n]
            for n in sorted(self._hints_due & self.by_name.keys())
            if self.by_name[n].ready and self.by_name[n].status is not None and self.placed
        ]
        for worker in due:
            assert worker.status is not None
            if worker.status.residency_mode != "externally_managed":
                self._hints_due.discard(worker.name)
                continue
            given = set(self.given(worker))
            targets = [(m, control.Residency.SYSTEM) for m in sorted(worker.executables - given)]
            targets += [(m, control.Residency.DEVICE) for m in sorted(given)]
            try:
                for model, target in targets:
                    await worker.control.set_model_residency(
                        control.SetModelResidencyRequest(name=model, target=target),
                        timeout=60 * self.node.probe_timeout_s,
                    )
            except Exception as e:  # tried again next round
                log.warning("residency hint failed", worker=worker.name, model=model, error=repr(e))
                continue
            self._hints_due.discard(worker.name)
            log.info("residency hints", worker=worker.name, pinned=sorted(given))

    async def _compact(self, changed: set[str]) -> None:
        mode = self.policy["compaction_mode"]
        changed = changed & self.by_name.keys()  # not the workers that left
        if mode == "off":
            return
        self.repack.repacks_since_compaction += 1
        if self.repack.repacks_since_compaction < self.policy["compaction_interval"] or not changed:
            return
        self.repack.repacks_since_compaction = 0
        models_of = {w: self.given(self.by_name[w]) for w in changed}

        async def compact(name: str) -> None:
            reload = models_of[name] if mode == "scheduled" else []
            try:
                await self.by_name[name].control.compact_memory(
                    control.CompactMemoryRequest(reload_models=reload),
                    timeout=60 * self.node.probe_timeout_s,
                )
                self.repack.compactions_sent += 1
            except Exception as e:
                log.warning("compaction failed", worker=name, error=repr(e))

        log.info("compaction fan-out", workers=sorted(changed), mode=mode)
        await asyncio.gather(*(compact(n) for n in sorted(changed)))

    async def request_repack(self, wait_s: float) -> tuple[int, bool, float]:
        """Ask for a repack (requests made before it starts share it); wait up to `wait_s` for
        it. Returns its sequence, whether it completed, and the seconds waited."""
        if self.requested == self.completed:
            self.requested += 1
        sequence = self.requested
        started = time.monotonic()
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                async with self._round_done:
                    await self._round_done.wait_for(lambda: self.completed >= sequence)
        return sequence, self.completed >= sequence, time.monotonic() - started


def _join(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_parts(
    placement: Mapping[str, Sequence[str]], workers: Sequence[WorkerLink]
) -> dict[str, tuple[str, ...]]:
    """`placement` with each meta's parts placed where the meta is (beside their own places)."""
    placed = {m: tuple(ws) for m, ws in placement.items()}
    for worker in workers:
        for meta, parts in worker.parts.items():
            for part in parts:
                placed[part] = tuple(sorted({*placed.get(part, ()), *placement.get(meta, ())}))
    return placed


def changed_workers(before: Mapping[str, Sequence[str]], after: Mapping[str, Sequence[str]]) -> set[str]:
    """The workers a model moved on to or off."""

    def pairs(placement: Mapping[str, Sequence[str]]) -> set[tuple[str, str]]:
        return {(m, w) for m, ws in placement.items() for w in ws}

    return {w for _, w in pairs(before) ^ pairs(after)}
