"""The node's metrics port: `/metrics` (every worker's families with a `worker` label, the
controller's own and Envoy's), `/healthz` (the controller answers) and `/readyz` (the node is ready, as
ServerReady answers; the body names the models without a ready replica)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from hloserve.fleet.controller import Controller
from hloserve.fleet.services import node_readiness

__all__ = ["NodeHttp", "merge_expositions"]

_MAX_REQUEST_BYTES = 8192


def merge_expositions(texts: Mapping[str, str]) -> list[Metric]:
    """One family per name, holding every worker's samples with a `worker` label added."""
    merged: dict[str, Metric] = {}
    for worker, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))
    return list(merged.values())


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _controller_families(
    controller: Controller, restarts: Mapping[str, int], up: Mapping[str, bool]
) -> list[Metric]:
    ready = GaugeMetricFamily(
        "hloserve_node_worker_ready", "The worker answers and is ready", labels=["worker"]
    )
    scraped = GaugeMetricFamily(
        "hloserve_node_worker_metrics_up", "The worker's metrics were read for this scrape", labels=["worker"]
    )
    starts = CounterMetricFamily(
        "hloserve_node_worker_starts", "Times the worker was started", labels=["worker"]
    )
    for worker in controller.workers:
        ready.add_metric([worker.name], float(worker.ready))
        scraped.add_metric([worker.name], float(up.get(worker.name, False)))
        starts.add_metric([worker.name], float(restarts.get(worker.name, 0)))
    routes = GaugeMetricFamily("hloserve_node_routed_models", "Models with a route to a worker")
    routes.add_metric([], float(sum(1 for a in controller.routes.values() if a)))
    replicas = GaugeMetricFamily(
        "hloserve_node_route", "1 when the model's requests go to the worker", labels=["model", "worker"]
    )
    by_address = {w.address: w.name for w in controller.workers}
    for model, addresses in sorted(controller.routes.items()):
        for address in addresses:
            replicas.add_metric([model, by_address[address]], 1.0)
    utilization = GaugeMetricFamily(
        "hloserve_node_model_utilization", "Learned busy fraction of one worker per model", labels=["model"]
    )
    for model, learned in sorted(controller.learned.items()):
        utilization.add_metric([model], learned.utilization or 0.0)
    repacks = CounterMetricFamily("hloserve_node_repacks", "Placements computed (lpt_packing)")
    repacks.add_metric([], float(controller.repack.count))
    ready_node = GaugeMetricFamily("hloserve_node_ready", "Every model has a ready replica")
    ready_node.add_metric([], float(node_readiness(controller)[0]))
    return [ready, scraped, starts, routes, replicas, utilization, repacks, ready_node]


def _fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return str(answer.read().decode())


class NodeHttp:
    """The answers of the node's metrics port."""

    def __init__(
        self, controller: Controller, restarts: Callable[[], Mapping[str, int]], envoy_admin: str | None
    ) -> None:
        self._controller = controller
        self._restarts = restarts
        self._envoy = envoy_admin

    async def exposition(self) -> bytes:
        """Every worker's families with a `worker` label, the controller's, then Envoy's own
        (`envoy_*`: requests, retries and ejections per model cluster)."""
        controller = self._controller
        timeout = controller.node.probe_timeout_s
        sources = {w.name: f"http://{w.metrics}/metrics" for w in controller.workers if w.metrics}
        if self._envoy:
            sources["envoy"] = f"http://{self._envoy}/stats/prometheus"
        results = await asyncio.gather(
            *(asyncio.to_thread(_fetch, url, timeout) for url in sources.values()), return_exceptions=True
        )
        texts = {n: r for n, r in zip(sources, results, strict=True) if isinstance(r, str)}
        envoy = texts.pop("envoy", "")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(merge_expositions(texts)))
        registry.register(
            _Families(_controller_families(controller, self._restarts(), dict.fromkeys(texts, True)))
        )
        return bytes(generate_latest(registry)) + envoy.encode()

    async def answer(self, path: bytes) -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if path == b"/metrics":
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", await self.exposition()
        if path == b"/healthz":
            return "200 OK", text, b"ok\n"
        if path == b"/readyz":
            ready, missing = node_readiness(self._controller)
            if ready:
                return "200 OK", text, b"ready\n"
            detail = f"no ready replica of {', '.join(missing)}" if missing else "no worker is ready"
            return "503 Service Unavailable", text, f"not ready: {detail}\n".encode()
        return "404 Not Found", text, b"expected /metrics, /healthz or /readyz\n"

    async def serve(self, host: str, port: int) -> asyncio.Server:
        """Listen on `host:port`; the caller closes the returned server."""

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                writer.close()
                return
            path = head.split(b" ", 2)[1].split(b"?")[0] if head.count(b" ") >= 2 else b""
            status, kind, body = await self.answer(path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            try:
                await writer.drain()
            finally:
                writer.close()

        return await asyncio.start_server(answer, host, port, limit=_MAX_REQUEST_BYTES)
