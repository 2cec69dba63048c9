"""Prometheus metrics of one worker, on its own registry and HTTP endpoint.

Request counters and latency histograms are updated as requests finish; per-model execution
statistics are read at scrape time from `Statistics`, fetched on the event-loop thread (which
owns them) through the trio token, so a scrape never sees a half-updated record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from hloserve.statistics import ModelStatistics, Statistics

__all__ = ["Metrics"]

_LATENCY_BUCKETS = tuple(0.0005 * 2**k for k in range(15))  # 0.5 ms .. 8 s


class _StatisticsCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, ModelStatistics]]):
        self._read = read

    def collect(self) -> Iterator[Any]:
        stats = self._read()
        families = {
            "executions": CounterMetricFamily(
                "hloserve_executions", "Executions run per model", labels=["model"]
            ),
            "rows": CounterMetricFamily(
                "hloserve_inference_rows", "Rows (batch elements) executed", labels=["model"]
            ),
            "queue": CounterMetricFamily(
                "hloserve_queue_seconds", "Time requests spent queued", labels=["model"]
            ),
            "compute": CounterMetricFamily(
                "hloserve_compute_seconds", "Time spent executing (input, infer, output)", labels=["model"]
            ),
            "batches": CounterMetricFamily(
                "hloserve_batch_executions",
                "Executions per compiled batch size",
                labels=["model", "batch_size"],
            ),
        }
        for model, s in stats.items():
            families["executions"].add_metric([model], s.execution_count)
            families["rows"].add_metric([model], s.inference_count)
            families["queue"].add_metric([model], s.queue.ns / 1e9)
            c = s.compute
            families["compute"].add_metric(
                [model], (c.compute_input.ns + c.compute_infer.ns + c.compute_output.ns) / 1e9
            )
            for size, times in sorted(s.by_batch_size.items()):
                families["batches"].add_metric([model, str(size)], times.compute_infer.count)
        yield from families.values()
        depth = GaugeMetricFamily("hloserve_queue_depth", "Requests waiting per model", labels=["model"])
        for model, s in stats.items():
            depth.add_metric([model], s.queue_depth)
        yield depth


class Metrics:
    """The worker's metric objects and, once `serve` is called, its HTTP endpoint."""

    def __init__(self, statistics: Statistics) -> None:
        self.registry = CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "hloserve_requests",
            "ModelInfer calls by model and gRPC status",
            ["model", "status"],
            registry=self.registry,
        )
        self.request_seconds = prometheus_client.Histogram(
            "hloserve_request_duration_seconds",
            "ModelInfer duration in the server, decode to encode",
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

        self.registry.register(_StatisticsCollector(on_loop(statistics.snapshot)))
        self._httpd: Any = None

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port."""
        self._httpd, _ = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        return int(self._httpd.server_port)

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
