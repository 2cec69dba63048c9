"""Prometheus metrics of one worker, on its own registry and HTTP endpoint.

The endpoint (`MetricsEndpoint`, bounded as the other listeners are) runs on the worker's
trio-asyncio loop; the exposition is built in a worker thread (its collectors hop to the loop,
a hundred models' statistics at a time).

Request counters and latency histograms are updated as requests finish; per-model execution
statistics are read at scrape time from `Statistics`, fetched on the event-loop thread (which
owns them) through the trio token, so a scrape never sees a half-updated record.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
import trio
import trio_asyncio
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from hloserve._transport.metrics_endpoint import Answer, MetricsEndpoint
from hloserve.engine.statistics import LOAD_BUCKETS_S, ModelStatistics, Statistics

__all__ = ["Metrics"]

_LATENCY_BUCKETS = tuple(0.0005 * 2**k for k in range(15))  # 0.5 ms .. 8 s
_COPIES_PER_HOP = 100
"""Models whose statistics one hop to the serving loop copies during a scrape (a few ms)."""


class _StatisticsCollector(Collector):
    """Per-model families from one statistics snapshot per scrape (taken on the serving loop), the
    weight swaps' included."""

    def __init__(self, read: Callable[[], tuple[dict[str, ModelStatistics], int | None]]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        stats, budget = self._read()
        yield from _request_families(stats)
        yield from _swap_families(stats, budget)


_WAIT_QUANTILES = (0.5, 0.99)


def _request_families(stats: dict[str, ModelStatistics]) -> Iterator[Any]:
    """Executions, requests, rows, queue and compute time, batch sizes and drops per model."""
    model = ["model"]
    executions = CounterMetricFamily("hloserve_executions", "Executions (dispatches) per model", labels=model)
    requests = CounterMetricFamily(
        "hloserve_requests_served", "Requests answered from executions", labels=model
    )
    rows = CounterMetricFamily("hloserve_inference_rows", "Rows (batch elements) executed", labels=model)
    queue = CounterMetricFamily("hloserve_queue_seconds", "Time requests spent queued", labels=model)
    compute = CounterMetricFamily("hloserve_compute_seconds", "Time spent executing", labels=model)
    batches = CounterMetricFamily(
        "hloserve_batch_executions", "Executions per compiled batch size", labels=["model", "batch_size"]
    )
    drops = CounterMetricFamily(
        "hloserve_dropped_requests", "Requests that never ran, by reason", labels=["model", "reason"]
    )
    depth = GaugeMetricFamily("hloserve_queue_depth", "Requests waiting", labels=model)
    wait = GaugeMetricFamily(
        "hloserve_queue_wait_seconds",
        "Queue wait of the last 1024 requests",
        labels=["model", "quantile"],
    )
    cost = GaugeMetricFamily(
        "hloserve_cost_estimate_seconds", "Learned seconds per execution", labels=["model", "batch_size"]
    )
    resident = GaugeMetricFamily(
        "hloserve_model_resident", "Weights on the device (1) or not (0)", labels=model
    )
    weight_bytes = GaugeMetricFamily("hloserve_model_weight_bytes", "Bytes of weights", labels=model)
    loads = CounterMetricFamily("hloserve_weight_loads", "Weight loads to the device", labels=model)
    evictions = CounterMetricFamily(
        "hloserve_weight_evictions", "Weight evictions from the device", labels=model
    )
    load_seconds = CounterMetricFamily(
        "hloserve_weight_load_seconds", "Time spent loading weights", labels=model
    )
    prefetches = CounterMetricFamily(
        "hloserve_weight_prefetches",
        "Weight loads started while another model executed (counted in the loads too)",
        labels=model,
    )
    pinned = GaugeMetricFamily(
        "hloserve_model_host_pinned",
        "Host copy of the weights in pinned memory (1) or not (0)",
        labels=model,
    )
    for name, s in stats.items():
        executions.add_metric([name], s.execution_count)
        requests.add_metric([name], s.requests_served)
        rows.add_metric([name], s.inference_count)
        queue.add_metric([name], s.queue.ns / 1e9)
        c = s.compute
        compute.add_metric([name], (c.compute_input.ns + c.compute_infer.ns + c.compute_output.ns) / 1e9)
        for size, times in sorted(s.by_batch_size.items()):
            batches.add_metric([name, str(size)], times.compute_infer.count)
        for reason, count in sorted(s.drops.items()):
            drops.add_metric([name, reason], count)
        depth.add_metric([name], s.queue_depth)
        for q, seconds in zip(_WAIT_QUANTILES, s.wait_quantiles(_WAIT_QUANTILES), strict=True):
            wait.add_metric([name, str(q)], seconds)
        for size, seconds in sorted(s.cost.items()):
            cost.add_metric([name, str(size)], seconds)
        if s.residency:
            resident.add_metric([name], int(s.resident))
            weight_bytes.add_metric([name], s.weight_bytes)
            loads.add_metric([name], s.weight_loads)
            evictions.add_metric([name], s.weight_evictions)
            load_seconds.add_metric([name], s.weight_load_seconds)
            prefetches.add_metric([name], s.weight_prefetches)
            pinned.add_metric([name], int(s.host_pinned))
    yield from (executions, requests, rows, queue, compute, batches, drops, depth, wait, cost)
    yield from (resident, weight_bytes, loads, evictions, load_seconds, prefetches, pinned)
    yield from _triton_families(stats)


_TRITON_COUNTERS: tuple[tuple[str, str, Callable[[ModelStatistics], int]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes",
        lambda s: s.fail.count,
    ),
    ("nv_inference_count", "Number of inferences performed (batch elements)", lambda s: s.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed", lambda s: s.execution_count),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        lambda s: s.success.ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        lambda s: s.compute.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        lambda s: s.compute.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds",
        lambda s: s.compute.compute_output.ns // 1000,
    ),
)
"""Triton's per-model counters: name, help and how each is read from a model's statistics."""


def _triton_families(stats: dict[str, ModelStatistics]) -> Iterator[Any]:
    """The per-model inference metrics under Triton's names and labels (`nv_inference_*`, with
    `model` and `version`), from the same counters as the statistics extension, as Triton derives
    them: dashboards and alerts written for Triton read hloserve unchanged. Triton's counters carry
    no `_total` suffix, which prometheus_client adds to every counter, so they are exposed
    untyped under their exact names. Every model reports version "1", as the statistics do."""
    labels = ["model", "version"]
    for name, doc, read in _TRITON_COUNTERS:
        family = UnknownMetricFamily(name, doc, labels=labels)
        for model, s in stats.items():
            family.add_metric([model, "1"], read(s))
        yield family
    pending = GaugeMetricFamily(
        "nv_inference_pending_request_count",
        "Instantaneous number of pending requests awaiting execution per-model.",
        labels=labels,
    )
    for model, s in stats.items():
        pending.add_metric([model, "1"], s.queue_depth)
    yield pending


_EVICTION_CAUSES = ("budget", "compaction", "control")


def _swap_families(stats: dict[str, ModelStatistics], budget: int | None) -> Iterator[Any]:
    """Weight swaps: per model, loads (a duration histogram, bytes), evictions by cause, the time
    requests waited for loads and the residency state; per worker, the budget and the bytes
    resident and pinned."""
    model = ["model"]
    durations = HistogramMetricFamily(
        "hloserve_weight_load_duration_seconds", "Duration of each weight load", labels=model
    )
    moved = CounterMetricFamily("hloserve_weight_load_bytes", "Bytes copied to the device", labels=model)
    causes = CounterMetricFamily(
        "hloserve_weight_evictions_by_cause", "Weight evictions by cause", labels=["model", "cause"]
    )
    waited = CounterMetricFamily(
        "hloserve_weight_load_wait_seconds",
        "Time requests waited for their model's weights to load, summed over requests",
        labels=model,
    )
    state = GaugeMetricFamily(
        "hloserve_model_residency",
        "Where a model's weights are: 1 for its state (device, host, none) and floor",
        labels=["model", "state", "floor"],
    )
    resident_bytes = pinned_bytes = 0
    for name, s in stats.items():
        if not s.residency:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip(LOAD_BUCKETS_S, s.weight_load_buckets, strict=True):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", s.weight_loads))
        durations.add_metric([name], buckets, s.weight_load_seconds)
        moved.add_metric([name], s.weight_load_bytes)
        for cause in _EVICTION_CAUSES:
            causes.add_metric([name, cause], s.evictions_by_cause.get(cause, 0))
        waited.add_metric([name], s.load_wait_seconds)
        where = "device" if s.resident else "host" if s.host_resident else "none"
        state.add_metric([name, where, s.residency], 1)
        if s.resident:
            if s.residency == "device":
                pinned_bytes += s.weight_bytes
            else:
                resident_bytes += s.weight_bytes
    yield from (durations, moved, causes, waited, state)
    gauge = GaugeMetricFamily
    yield gauge(
        "hloserve_weight_resident_bytes", "Weight bytes on the device, budgeted", value=resident_bytes
    )
    yield gauge("hloserve_weight_pinned_bytes", "Weight bytes pinned on the device", value=pinned_bytes)
    if budget is not None:
        yield gauge("hloserve_weight_budget_bytes", "The weight cache's byte budget", value=budget)


class _CompactionCollector(Collector):
    def __init__(self, read: Callable[[], int]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        compactions = CounterMetricFamily("hloserve_compactions", "Weight-cache compactions")
        compactions.add_metric([], self._read())
        yield compactions


_DEVICE_MEMORY = {
    "bytes_in_use": ("in_use", "Device memory in use by live buffers"),
    "bytes_limit": ("limit", "The allocator's arena"),
    "peak_bytes_in_use": ("peak_in_use", "High-water mark of device memory in use"),
    "pool_bytes": ("pool", "Device memory the allocator holds"),
}


class _DeviceMemoryCollector(Collector):
    """The allocator's statistics, where the backend keeps them (a GPU; not the CPU)."""

    def __init__(self, read: Callable[[], dict[str, int] | None]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        stats = self._read()
        if stats is None:
            return
        for key, (name, doc) in _DEVICE_MEMORY.items():
            if stats.get(key, -1) >= 0:
                yield GaugeMetricFamily(f"hloserve_device_memory_{name}_bytes", doc, value=stats[key])
        if stats.get("bytes_limit", -1) >= 0 and stats.get("bytes_in_use", -1) >= 0:
            free = stats["bytes_limit"] - stats["bytes_in_use"]
            yield GaugeMetricFamily("hloserve_device_memory_free_bytes", "Arena not in use", value=free)


class _ProgramsCollector(Collector):
    def __init__(self, read: Callable[[], int]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "hloserve_programs_loaded",
            "Programs loaded (executables per batch size), each shared by the models whose modules "
            "are byte-identical",
            value=self._read(),
        )


class _UnexposedCollector(Collector):
    def __init__(self, read: Callable[[], int]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "hloserve_models_unexposed",
            "Models left out of the per-model series (server.metrics_max_models)",
            value=self._read(),
        )


class Metrics:
    """The worker's metric objects and, once `serve` is called, its HTTP endpoint. `programs`
    reads how many programs are loaded (`Programs`), thread-safe; `max_models` bounds the models
    whose series a scrape exposes (0: all); `device_memory` reads the device allocator's
    statistics (`_xla.memory_stats`: the engine's; a frontend, which runs no model, has none)."""

    def __init__(
        self,
        statistics: Statistics,
        programs: Callable[[], int] | None = None,
        max_models: int = 0,
        device_memory: Callable[[], dict[str, int] | None] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "hloserve_requests",
            "ModelInfer calls by model and gRPC status",
            ["model", "status"],
            registry=self.registry,
        )
        self.request_seconds = prometheus_client.Histogram(
            "hloserve_request_duration_seconds",
            "ModelInfer duration in the server, from its request read to its reply sent",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.models_loaded = prometheus_client.Gauge(
            "hloserve_models_loaded", "Models ready to serve", registry=self.registry
        )
        self.models_failed = prometheus_client.Gauge(
            "hloserve_models_failed", "Bundles that failed to load", registry=self.registry
        )
        token = trio.lowlevel.current_trio_token()

        def on_loop(read: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: trio.from_thread.run_sync(read, trio_token=token)

        def snapshot() -> tuple[dict[str, ModelStatistics], int | None]:
            """The exposed models' copies, `_COPIES_PER_HOP` per hop to the loop, so that no hop
            holds it long (a copy is about 25 us; a model's own record is consistent, the set
            need not be)."""
            names: list[str] = on_loop(lambda: statistics.busiest(max_models))()
            copies: dict[str, ModelStatistics] = {}
            for start in range(0, len(names), _COPIES_PER_HOP):
                copies.update(
                    on_loop(functools.partial(statistics.copies, names[start : start + _COPIES_PER_HOP]))()
                )
            return copies, on_loop(lambda: statistics.weight_budget_bytes)()

        self.registry.register(_StatisticsCollector(snapshot))
        if max_models:
            self.registry.register(_UnexposedCollector(on_loop(lambda: max(0, len(statistics) - max_models))))
        self.registry.register(_CompactionCollector(on_loop(lambda: statistics.compactions)))
        if device_memory is not None:
            self.registry.register(_DeviceMemoryCollector(device_memory))
        if programs is not None:
            self.registry.register(_ProgramsCollector(programs))
        self._endpoint: MetricsEndpoint | None = None

    def forget(self, model: str) -> None:
        """Drop `model`'s request series (at its unload; its statistics' series go with them)."""
        self.requests.remove_by_labels({"model": model})
        self.request_seconds.remove(model)

    async def serve(
        self, host: str, port: int, max_connections: int, timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> int:
        """Start the HTTP endpoint (HTTPS with `tls`) on the worker's trio-asyncio loop; returns
        the bound port."""
        scrape = self._scrape
        self._endpoint = MetricsEndpoint({b"/metrics": scrape, b"/": scrape}, max_connections, timeout_s)
        return int(await trio_asyncio.aio_as_trio(self._endpoint.start)(host, port, tls))

    async def _scrape(self) -> Answer:
        """The exposition, built in a worker thread (its collectors hop to the loop)."""
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
        return Answer(200, "OK", CONTENT_TYPE_LATEST, body)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
