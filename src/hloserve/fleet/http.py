"""The node's metrics port: `/metrics` (every worker's families with a `worker` label, the
controller's own and Envoy's), `/healthz` (the controller answers) and `/readyz` (the node is ready, as
ServerReady answers; the body names the models without a ready replica). It is bounded as a
worker's is (`MetricsEndpoint`: the `server.metrics_*` keys, TLS with `server.metrics_use_ssl`)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from hloserve._transport.metrics_endpoint import Answer, MetricsEndpoint
from hloserve.config import ServerConfig
from hloserve.fleet.controller import Controller
from hloserve.fleet.services import node_readiness
from hloserve.tls import server_context

__all__ = ["NodeHttp", "merge_expositions"]

_TEXT = "text/plain; charset=utf-8"


def merge_expositions(texts: Mapping[str, str]) -> str:
    """Every worker's exposition (text format 0.0.4) as one: each family once, its HELP and TYPE
    lines then every worker's samples with a `worker` label added. Done on the text, not parsed:
    two workers' 2.7 MB expositions (10,000 models) took prometheus_client 3.4 s to parse and
    1.1 s to write again, on the controller's loop; this takes 0.15 s, in a thread."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name: (HELP and TYPE lines, samples)
    for worker, text in sorted(texts.items()):
        label = f'worker="{_label_value(worker)}"'
        current: tuple[list[str], list[str]] | None = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], ([], []))
                    if line not in current[0]:
                        current[0].append(line)
                continue
            if current is None:  # samples before any header: a family of their own name
                current = families.setdefault(line.split("{", 1)[0].split(" ", 1)[0], ([], []))
            closing = line.rfind("}")  # the labels' end: a sample's value and time have none
            if closing == -1:
                space = line.index(" ")
                current[1].append(f"{line[:space]}{{{label}}}{line[space:]}")
            else:
                comma = "" if line[closing - 1] == "{" else ","
                current[1].append(f"{line[:closing]}{comma}{label}{line[closing:]}")
    return "".join("\n".join([*headers, *samples, ""]) for headers, samples in families.values())


def _label_value(value: str) -> str:
    """`value` escaped as the text format's label values are."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
        self._building: asyncio.Future[bytes] | None = None

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
        own = _controller_families(controller, self._restarts(), dict.fromkeys(texts, True))
        registry.register(_Families(own))  # built on the loop, which changes the controller

        def write() -> bytes:
            return merge_expositions(texts).encode() + bytes(generate_latest(registry)) + envoy.encode()

        return await asyncio.to_thread(write)

    async def _metrics(self) -> Answer:
        """Scrapes that arrive while one is being built share its answer: a crowd of scrapers
        costs the workers one scrape, not one each."""
        if self._building is None or self._building.done():
            self._building = asyncio.ensure_future(self.exposition())
        body = await asyncio.shield(self._building)
        return Answer(200, "OK", CONTENT_TYPE_LATEST, body)

    async def _healthz(self) -> Answer:
        return Answer(200, "OK", _TEXT, b"ok\n")

    async def _readyz(self) -> Answer:
        ready, missing = node_readiness(self._controller)
        if ready:
            return Answer(200, "OK", _TEXT, b"ready\n")
        detail = f"no ready replica of {', '.join(missing)}" if missing else "no worker is ready"
        return Answer(503, "Service Unavailable", _TEXT, f"not ready: {detail}\n".encode())

    async def serve(self, server: ServerConfig) -> MetricsEndpoint:
        """Listen on the node's metrics port (`server`'s host, port, bounds and TLS) on the running
        asyncio loop; the caller closes the returned endpoint."""
        routes = {b"/metrics": self._metrics, b"/healthz": self._healthz, b"/readyz": self._readyz}
        endpoint = MetricsEndpoint(routes, server.metrics_max_connections, server.metrics_timeout_s)
        await endpoint.start(server.host, server.metrics_port, server_context(server, "metrics"))
        return endpoint
