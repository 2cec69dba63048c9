"""The node's publisher against a real Envoy: make-before-break. Envoy applies the clusters and
the routes files each on its own; a route that names a cluster Envoy does not have is answered
503 with no body (gRPC UNAVAILABLE with no message), which CI met while a killed worker moved a
model to another pool."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from hloserve.config import Config
from hloserve.fleet import envoy
from hloserve.fleet.gateway import _Publisher
from hloserve.fleet.workers import free_port
from tests.node.test_fleet import INFER, _route, _routes_for

A = envoy.Endpoint("127.0.0.1:1", "127.0.0.1:3")
B = envoy.Endpoint("127.0.0.1:2", "127.0.0.1:4")


@dataclass
class Front:
    directory: Path
    publish: _Publisher
    envoy: subprocess.Popen[bytes]
    admin: str

    def clusters(self) -> set[str]:
        return {c["name"] for c in self._read("clusters.json")["resources"]}

    def routed(self, file: str, key: str, path: str) -> str:
        """The cluster the written `file` sends `path` to, for the model named by `key`."""
        (config,) = self._read(file)["resources"]
        routes = _routes_for(config, key, prefix=file == "routes_http.json")
        return str(_route(routes, path)["route"]["cluster"])

    def version(self, file: str) -> int:
        return int(self._read(file)["version_info"])

    def _read(self, file: str) -> dict[str, Any]:
        return dict(json.loads((self.directory / file).read_text()))

    async def published(self) -> None:
        """Until Envoy has applied the routes of every call so far (20 s at most)."""
        with trio.fail_after(20):
            while True:
                with contextlib.suppress(OSError):  # (Envoy starting)
                    applied = await trio.to_thread.run_sync(envoy.applied, self.admin)
                    if applied.version == self.publish.requested:
                        return
                await trio.sleep(0.05)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    admin = free_port()
    publish = _Publisher(tmp_path, "127.0.0.1:9", Config(), f"127.0.0.1:{admin}")
    publish.controller_http = "127.0.0.1:10"
    envoy.write_atomically(tmp_path / "routing.pb", envoy.descriptor_set())
    publish.write_before_envoy_starts()
    bootstrap = envoy.bootstrap(tmp_path, "127.0.0.1", free_port(), free_port(), admin, 1 << 24)
    envoy.write_atomically(tmp_path / "envoy.json", bootstrap)
    argv = ["-c", str(tmp_path / "envoy.json"), "--disable-hot-restart", "--log-level", "error"]
    process = subprocess.Popen([envoy.find_envoy(), *argv])
    try:
        yield Front(tmp_path, publish, process, f"127.0.0.1:{admin}")
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)


def test_routes_to_a_new_pool_are_written_only_once_envoy_has_its_cluster(front: Front) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.publish.run)
            front.publish({"a": [A]})
            await front.published()
            os.kill(front.envoy.pid, signal.SIGSTOP)  # Envoy busy: it applies nothing for a while
            front.publish({"a": [A], "b": [B]})
            await trio.sleep(1.0)
            asked = front.publish.requested
            assert front.version("clusters.json") == asked and envoy.pool_name([B]) in front.clusters()
            assert front.version("routes.json") < asked and front.version("routes_http.json") < asked
            assert front.routed("routes.json", "b", INFER) == "controller"  # not yet to b's pool
            os.kill(front.envoy.pid, signal.SIGCONT)
            await front.published()
            assert front.routed("routes.json", "b", INFER) == envoy.pool_name([B])
            path = "/v2/models/b/infer"
            assert front.routed("routes_http.json", path, path) == envoy.pool_name([B], http=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_pools_cluster_outlives_the_last_route_to_it_by_one_publication(front: Front) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.publish.run)
            front.publish({"a": [A], "b": [B]})
            await front.published()
            front.publish({"a": [A]})
            await front.published()
            assert front.routed("routes.json", "a", INFER) == envoy.pool_name([A])
            assert front.routed("routes.json", "b", INFER) == "controller"
            path = "/v2/models/b/infer"
            assert front.routed("routes_http.json", path, path) == "controller_http"
            pools = {envoy.pool_name(e, http=h) for e in ([A], [B]) for h in (False, True)}
            assert front.clusters() == {*pools, "controller", "controller_http"}  # b's may be in flight
            front.publish({"a": [A]})
            await front.published()
            assert front.clusters() == {
                envoy.pool_name([A]),
                envoy.pool_name([A], http=True),
                "controller",
                "controller_http",
            }
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_calls_made_while_envoy_applies_are_published_as_the_newest(front: Front) -> None:
    written: list[int] = []
    write_clusters = front.publish._write_clusters

    def recorded(routes: Any, version: int) -> None:
        written.append(version)
        write_clusters(routes, version)

    front.publish._write_clusters = recorded  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.publish.run)
            front.publish({"a": [A]})
            await front.published()
            os.kill(front.envoy.pid, signal.SIGSTOP)
            for weight in range(90, 40, -10):  # four superseded before Envoy applies one
                front.publish({"a": [envoy.Endpoint(A.grpc, A.http, weight)]})
                await trio.sleep(0.05)
            os.kill(front.envoy.pid, signal.SIGCONT)
            await front.published()
            newest = envoy.pool_name([envoy.Endpoint(A.grpc, A.http, 50)])
            assert front.routed("routes.json", "a", INFER) == newest
            # the first call's version, the first of the five (Envoy was stopped while the
            # publisher waited on it) and the newest: the three between were never written
            assert written == [1, 2, 6]
            nursery.cancel_scope.cancel()

    started = time.monotonic()
    trio.run(main)
    assert time.monotonic() - started < 20
