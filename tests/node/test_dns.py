"""`node.workers_dns`: a node that starts no worker and fronts the addresses a name resolves to
(a fleet's router in front of a headless Service). A cluster DNS cannot exist here, so the
discovery tests answer `socket.getaddrinfo` themselves, with loopback addresses real workers
listen on; the node test resolves `localhost`."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as triton
from structlog.testing import capture_logs
from support.bundles import assert_affine_answers, write_affine
from support.clients import assert_good_request_served, free_port
from support.servers import ServerThread, make_config, start_worker

from hloserve.config import NodeConfig, load_config
from hloserve.errors import ConfigError
from hloserve.fleet.controller import Controller

NAME = "workers.fleet.svc"


@pytest.mark.parametrize(
    "value", ["workers", "workers:", ":8001", "workers:0", "workers:65536", "workers:80a", "[]:8001"]
)
def test_a_workers_dns_without_a_host_and_a_port_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"node\.workers_dns.*expected host:port"):
        load_config(environ={"HLOSERVE_NODE_WORKERS_DNS": value})


@pytest.mark.parametrize("value", ["workers.ns.svc:8001", "10.0.0.1:1", "[::1]:65535"])
def test_a_workers_dns_of_host_and_port_is_taken(value: str) -> None:
    assert load_config(environ={"HLOSERVE_NODE_WORKERS_DNS": value}).node.workers_dns == value


def test_a_workers_metrics_port_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"node\.workers_metrics_port"):
        load_config(environ={"HLOSERVE_NODE_WORKERS_METRICS_PORT": "0"})


class _Resolver:
    """Answers `getaddrinfo` for NAME with `addresses` (or raises `failure`); any other name as
    the system would."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.failure: OSError | None = None
        self.calls = 0
        self._real = socket.getaddrinfo

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != NAME:
            return self._real(host, port, *args, **kwargs)
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.addresses]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[ServerThread]]]:
    """Two workers serving the `affine` bundle on the same port of 127.0.0.1 and 127.0.0.2."""
    repository = tmp_path_factory.mktemp("repository")
    write_affine(repository / "affine")
    port = free_port()
    workers: list[ServerThread] = []
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            config = make_config(repository, host=host, grpc_port=port, metrics_port=-1, http_port=-1)
            workers.append(start_worker(config))
        yield port, workers
    finally:
        for worker in workers:
            worker.stop()


def _controller(port: int, published: list[dict[str, Any]]) -> Controller:
    node = NodeConfig(workers_dns=f"{NAME}:{port}", workers_metrics_port=9100, probe_timeout_s=5.0)
    node.validate()
    return Controller(node, [], lambda routes: published.append(dict(routes)))


@pytest.mark.slow
def test_discovered_workers_join_and_leave_the_routes_and_a_failed_resolution_keeps_them(
    two_workers: tuple[int, list[ServerThread]], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, _ = two_workers
    both = [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    resolver = _Resolver(["127.0.0.2", "127.0.0.1", "127.0.0.1"])  # a duplicate record counts once
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    published: list[dict[str, Any]] = []
    controller = _controller(port, published)

    async def rounds() -> None:
        await controller.round()
        assert [w.name for w in controller.workers] == both  # each named by its address
        assert [w.metrics for w in controller.workers] == ["127.0.0.1:9100", "127.0.0.2:9100"]
        assert all(w.ready for w in controller.workers)
        assert controller.routes == {"affine": tuple(both)}
        first = controller.workers[0]

        resolver.addresses = ["127.0.0.1"]  # a pod went away
        await controller.round()
        assert [w.name for w in controller.workers] == both[:1]
        assert controller.workers[0] is first  # a worker still there keeps its link
        assert controller.routes == {"affine": tuple(both[:1])}
        assert set(controller.by_name) == set(both[:1])

        resolver.failure = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        with capture_logs() as logs:
            await controller.round()
            await controller.round()
        assert [w.name for w in controller.workers] == both[:1]
        assert controller.routes == {"affine": tuple(both[:1])}
        assert [e["event"] for e in logs].count(
            "workers_dns did not resolve; keeping the last known workers"
        ) == 1

        resolver.failure = None
        resolver.addresses = ["127.0.0.1", "127.0.0.2"]  # it came back
        await controller.round()
        assert controller.routes == {"affine": tuple(both)}
        for worker in controller.workers:
            worker.reset()

    asyncio.run(rounds())
    assert resolver.calls == 5
    assert published == [
        {"affine": tuple(both)},
        {"affine": tuple(both[:1])},
        {"affine": tuple(both)},
    ]
    for address in both:  # and both still serve
        client = triton.InferenceServerClient(address)
        assert_affine_answers(client, "affine")
        client.close()


def _wait(condition: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; the node said:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_a_node_given_workers_dns_starts_no_worker_and_serves_through_the_one_it_resolves(
    tmp_path: Path,
) -> None:
    port = free_port()
    with start_worker(make_config(host="127.0.0.1", grpc_port=port, metrics_port=-1, http_port=-1)):
        grpc_port, metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "HLOSERVE_NODE_WORKERS_DNS": f"localhost:{port}",
            "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.3",
        }
        log = tmp_path / "node.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "hloserve.cli", "node", "--grpc-port", str(grpc_port),
                 "--metrics-port", str(metrics_port)],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            _wait(lambda: client.is_model_ready("mlp"), 60, "the node to route mlp", log)
            assert_good_request_served(client)
            said = log.read_text()
            assert "[worker" not in said  # no worker of its own
            assert "node front listening" in said
        finally:
            client.close()
            process.terminate()
            process.wait(30)
