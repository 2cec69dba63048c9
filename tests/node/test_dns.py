"""`node.workers_dns`: a node that starts no worker and fronts the addresses a name resolves to
(a fleet's router in front of a headless Service). A cluster DNS cannot exist here, so the
discovery tests answer `socket.getaddrinfo` themselves, with loopback addresses real workers
listen on; the node test resolves `localhost`."""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpclib
import numpy as np
import pytest
import trio
import tritonclient.grpc as triton
from grpclib.client import Channel
from structlog.testing import capture_logs
from support.clients import assert_serves, free_port, infer, wait_ready, wait_until
from support.servers import EXAMPLES, SERVE, make_config, start_worker

from hloserve._proto import hloserve_gateway as gateway
from hloserve.config import Config, NodeConfig, load_config
from hloserve.errors import ConfigError
from hloserve.fleet.controller import Controller
from hloserve.fleet.envoy import find_envoy
from hloserve.fleet.gateway import run_front
from hloserve.fleet.supervisor import Supervisor

NAME = "workers.fleet.svc"

# The front started in this process forks Envoy with a preexec_fn (PR_SET_PDEATHSIG); other tests
# may have started JAX here, which warns at every fork. The child execs at once, so the
# deadlock the warning is about cannot happen.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


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


def _worker_on(host: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`hloserve serve` of the example repository on `host:port` (another loopback address than
    `start_worker`'s), ready."""
    env = {**os.environ, "HLOSERVE_SERVER_HTTP_PORT": "-1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*SERVE, "--model-repository", str(EXAMPLES), "--host", host, "--grpc-port", str(port),
             "--metrics-port", "-1"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_ready(f"{host}:{port}", process, 120, log.read_text)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Two workers (subprocesses: this process never runs JAX, so the front may fork Envoy) on
    the same port of 127.0.0.1 and 127.0.0.2; yields that port."""
    with start_worker(process="subprocess", env={"HLOSERVE_SERVER_HTTP_PORT": "-1"}) as first:
        second = _worker_on("127.0.0.2", first.grpc_port, tmp_path_factory.mktemp("second") / "log")
        try:
            yield first.grpc_port
        finally:
            second.kill()
            second.wait()


def _controller(port: int, published: list[dict[str, Any]]) -> Controller:
    node = NodeConfig(workers_dns=f"{NAME}:{port}", workers_metrics_port=9100, probe_timeout_s=5.0)
    node.validate()
    return Controller(node, [], lambda routes: published.append(dict(routes)))


@pytest.mark.slow
def test_discovered_workers_join_and_leave_the_routes_and_a_failed_resolution_keeps_them(
    two_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = two_workers
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
        assert controller.routes["mlp"] == tuple(both)
        first = controller.workers[0]

        resolver.addresses = ["127.0.0.1"]  # a pod went away
        await controller.round()
        assert [w.name for w in controller.workers] == both[:1]
        assert controller.workers[0] is first  # a worker still there keeps its link
        assert controller.routes["mlp"] == tuple(both[:1])
        assert set(controller.by_name) == set(both[:1])

        resolver.failure = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        with capture_logs() as logs:
            await controller.round()
            await controller.round()
        assert [w.name for w in controller.workers] == both[:1]
        assert controller.routes["mlp"] == tuple(both[:1])
        assert [e["event"] for e in logs].count(
            "workers_dns did not resolve; keeping the last known workers"
        ) == 1

        resolver.failure = None
        resolver.addresses = ["127.0.0.1", "127.0.0.2"]  # it came back
        await controller.round()
        assert controller.routes["mlp"] == tuple(both)
        for worker in controller.workers:
            worker.reset()

    asyncio.run(rounds())
    assert resolver.calls == 5
    assert [tuple(e.grpc for e in routes["mlp"]) for routes in published] == [
        tuple(both), tuple(both[:1]), tuple(both),
    ]  # fmt: skip
    assert published[0]["mlp"][0].http == "127.0.0.1:8000"  # node.workers_http_port
    for address in both:  # and both still serve
        assert_serves(address)


class _Front:
    """The node's front (Envoy and the controller, no worker) run in a thread of this process,
    so that the test's `getaddrinfo` is the one its controller calls."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._started: queue.Queue[BaseException | None] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel = trio.CancelScope()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    supervisor = Supervisor(self.config.node)
                    await nursery.start(run_front, self.config, [], supervisor, find_envoy(""))
                    self._started.put(None)
                    await trio.sleep_forever()
        except BaseException as e:
            self._started.put(e)
            raise

    def __enter__(self) -> _Front:
        self._thread.start()
        failure = self._started.get(timeout=60)
        if failure is not None:
            raise RuntimeError("the front did not start") from failure
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(30)

    def status(self) -> gateway.GetSchedulingStatusResponse:
        async def call() -> gateway.GetSchedulingStatusResponse:
            channel = Channel("127.0.0.1", self.config.server.grpc_port)
            try:
                stub = gateway.GatewayControlServiceStub(channel)
                return await stub.get_scheduling_status(gateway.GetSchedulingStatusRequest(), timeout=10)
            finally:
                channel.close()

        return asyncio.run(call())

    def replicas(self) -> list[str]:
        """The workers Envoy's route for `mlp` names ([] while Envoy is not listening yet)."""
        try:
            models = self.status().models
        except (OSError, grpclib.GRPCError):
            return []
        return sorted(r.worker for m in models if m.name == "mlp" for r in m.replicas)


def _inferences(address: str) -> int:
    client = triton.InferenceServerClient(address)
    try:
        return int(client.get_inference_statistics("mlp").model_stats[0].inference_count)
    finally:
        client.close()


@pytest.mark.slow
def test_discovered_workers_serve_through_envoy_and_one_whose_record_goes_leaves_the_routes(
    two_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = two_workers
    both = [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    resolver = _Resolver(["127.0.0.1", "127.0.0.2"])
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    config = make_config(grpc_port=free_port(), metrics_port=-1, http_port=-1)
    config = config.replace("node", workers_dns=f"{NAME}:{port}", discovery_interval_s=0.2)
    with _Front(config) as front:
        client = triton.InferenceServerClient(f"127.0.0.1:{config.server.grpc_port}")
        try:
            _poll(lambda: front.replicas() == both, 30, "both discovered workers in the route")
            before = [_inferences(a) for a in both]
            _poll(lambda: client.is_model_ready("mlp"), 10, "Envoy to take the route")
            for _ in range(8):  # round robin over both
                _mlp(client)
            assert all(_inferences(a) > b for a, b in zip(both, before, strict=True))

            resolver.addresses = ["127.0.0.1"]  # its pod went away
            _poll(lambda: front.replicas() == both[:1], 10, "the route to lose 127.0.0.2")

            def only_the_first_serves() -> bool:
                gone = _inferences(both[1])
                for _ in range(4):
                    _mlp(client)  # never a failed request
                return _inferences(both[1]) == gone

            _poll(only_the_first_serves, 10, "Envoy to send nothing more to 127.0.0.2")
        finally:
            client.close()


def _mlp(client: triton.InferenceServerClient) -> np.ndarray:
    """What `client`'s server answers for one fixed MLP input."""
    x = np.random.default_rng(0).random((2, 16), dtype=np.float32)
    return infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0")


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_node_given_workers_dns_starts_no_worker_and_serves_through_the_one_it_resolves(
    tmp_path: Path,
) -> None:
    with start_worker(process="subprocess", env={"HLOSERVE_SERVER_HTTP_PORT": "-1"}) as worker:
        grpc_port, metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "HLOSERVE_NODE_WORKERS_DNS": f"localhost:{worker.grpc_port}",
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
        direct = triton.InferenceServerClient(worker.url)
        try:
            wait_until(
                lambda: client.is_model_ready("mlp"),
                60,
                "the node to route mlp",
                lambda: f"the node said:\n{log.read_text()[-4000:]}",
            )
            np.testing.assert_array_equal(_mlp(client), _mlp(direct))  # the worker's own answer
            said = log.read_text()
            assert "[worker" not in said  # no worker of its own
            assert "node front listening" in said
        finally:
            client.close()
            direct.close()
            process.terminate()
            process.wait(30)
