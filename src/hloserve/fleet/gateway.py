"""The front of a node of two workers or more (or of the workers `node.workers_dns` names): Envoy
on the public gRPC and REST ports, the controller on loopback ports behind it (gRPC and REST) and
on the public metrics port. Started by `hloserve.fleet.node`."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import structlog
import trio
import trio_asyncio

from hloserve.api.control import ControlService
from hloserve.api.grpc_server import build_grpc_server
from hloserve.api.grpc_service import InferenceService
from hloserve.api.health import Health
from hloserve.api.rest.routes import build_app
from hloserve.api.rest.server import RestServer
from hloserve.config import Config, ServerConfig
from hloserve.engine import tracing
from hloserve.fleet import envoy
from hloserve.fleet.controller import Controller, WorkerLink
from hloserve.fleet.http import NodeHttp
from hloserve.fleet.services import (
    GatewayFront,
    NodeControlPlane,
    NodeDataPlane,
    NodeModelPlane,
    NodeRepositoryPlane,
    node_readiness,
    replicas_ready,
)
from hloserve.fleet.supervisor import Child, Supervisor
from hloserve.fleet.workers import WorkerSpec, free_port
from hloserve.restricted import Restrictions
from hloserve.tls import server_context

__all__ = ["run_front"]

NODE_SERVICES = frozenset(
    {
        "",
        "inference.GRPCInferenceService",
        "hloserve_control.ControlService",
        "hloserve_gateway.GatewayControlService",
        "grpc.health.v1.Health",
    }
)
"""The names the node's health service answers: the node itself and the services of its port."""

log = structlog.get_logger("hloserve.fleet")

_ENVOY_GRACE_S = 5.0


_APPLY_WAIT_S = 60.0
"""How long a publication waits for Envoy to apply a file before it writes on regardless (an
Envoy stopped, restarting, or refusing the file); Envoy takes about 5 s for 10,000 models."""

_APPLY_POLL_S = 0.05


class _Publisher:
    """Writes the clusters and routes Envoy watches, make-before-break. Envoy applies each file
    on its own, in its own time: written together, a busy Envoy applied routes naming a pool it
    did not have yet (or no longer had) and answered their requests 503 with no body, gRPC
    UNAVAILABLE with no message. So a publication writes its clusters (its routes' pools and
    those of the routes before, which requests may still be on), then its routes once Envoy has
    those clusters, and the next publication waits until Envoy has applied these routes.
    The controller's calls only ask; `run` writes the newest routes asked for."""

    def __init__(self, directory: Path, controller_address: str, config: Config, admin: str) -> None:
        self._directory = directory
        self._controller = controller_address
        self._admin = admin
        self.controller_http: str | None = None
        """The controller's REST address, with REST (set before the first call)."""
        self._balance = "ROUND_ROBIN" if config.node.scheduling == "round_robin" else "LEAST_REQUEST"
        self._max_message_bytes = config.server.max_message_bytes
        self._max_requests_per_worker = config.node.max_requests_per_worker
        self._grpc_restrictions = Restrictions.grpc(config.server.grpc_restricted_protocol)
        self._http_restrictions = Restrictions.http(config.server.http_restricted_api)
        self._previous: Mapping[str, Sequence[envoy.Endpoint]] = {}
        self._wanted: Mapping[str, Sequence[envoy.Endpoint]] = {}
        self._asked = trio.Event()
        self.requested = 0
        """How many routes were asked for: each publication's `version_info` is the count when
        it began, so Envoy's readouts say whether it has applied the routes of a given call."""

    def __call__(self, routes: Mapping[str, Sequence[envoy.Endpoint]]) -> None:
        """The controller's routes, to be written by `run` (the newest of those asked for)."""
        self._wanted = routes
        self.requested += 1
        self._asked.set()

    def write_before_envoy_starts(self) -> None:
        """The files Envoy reads at start (no routes yet), all at once: it reads them in order."""
        self._write_clusters(self._wanted, self.requested)
        self._write_routes(self._wanted, self.requested)
        self._previous = self._wanted

    async def run(self) -> None:
        """Publish what the controller asks for, until cancelled."""
        while True:
            await self._asked.wait()
            self._asked = trio.Event()
            version, routes = self.requested, self._wanted
            # In a thread: at 10,000 models building and writing the files takes about a second.
            await trio.to_thread.run_sync(self._write_clusters, routes, version)
            await self._until_envoy_has(version, "clusters", lambda a: a.clusters, lambda a: a.warming == 0)
            await trio.to_thread.run_sync(self._write_routes, routes, version)
            await self._until_envoy_has(version, "routes", lambda a: a.routes)
            self._previous = routes

    def _write_clusters(self, routes: Mapping[str, Sequence[envoy.Endpoint]], version: int) -> None:
        clusters = envoy.clusters(
            [*self._previous.values(), *routes.values()],
            self._controller,
            self._balance,
            self._max_message_bytes,
            self.controller_http,
            self._max_requests_per_worker,
        )
        envoy.write_atomically(self._directory / "clusters.json", {"version_info": str(version)} | clusters)

    def _write_routes(self, routes: Mapping[str, Sequence[envoy.Endpoint]], version: int) -> None:
        versioned = {"version_info": str(version)}
        grpc = envoy.routes(routes, self._grpc_restrictions)
        envoy.write_atomically(self._directory / "routes.json", versioned | grpc)
        if self.controller_http is not None:
            http = envoy.http_routes(routes, self._http_restrictions)
            envoy.write_atomically(self._directory / "routes_http.json", versioned | http)

    async def _until_envoy_has(
        self,
        version: int,
        what: str,
        applied: Callable[[envoy.Applied], int | None],
        settled: Callable[[envoy.Applied], bool] = lambda _: True,
    ) -> None:
        """Wait until Envoy has applied `version` of `what` (or a later one), or `_APPLY_WAIT_S`."""
        with trio.move_on_after(_APPLY_WAIT_S):
            while True:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    readouts = await trio.to_thread.run_sync(envoy.applied, self._admin)
                    done = applied(readouts)
                    if done is not None and done >= version and settled(readouts):
                        return
                await trio.sleep(_APPLY_POLL_S)
        log.warning("envoy has not applied the node's files; writing on", file=what, version=version)


async def _hold_unready_until_envoy_applies_the_routes(
    controller: Controller, publish: _Publisher, admin: str
) -> None:
    """The node answers ready only once Envoy has applied routes to a replica of every model:
    until then a client told "ready" would be answered 404 (at 10,000 models Envoy takes
    seconds to load the routes). Once: afterwards a model's routes follow its load."""
    controller.routes_applied = False
    ready_in_round = wanted = None
    while True:
        if ready_in_round is None and replicas_ready(controller)[0]:
            ready_in_round = controller.rounds  # a probe may have answered in a round not done yet
        if wanted is None and ready_in_round is not None and controller.rounds > ready_in_round:
            wanted = publish.requested  # the round after asked for the routes of every replica
        if wanted is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                applied = (await trio.to_thread.run_sync(envoy.applied, admin)).version
                if applied is not None and applied >= wanted:
                    controller.routes_applied = True
                    log.info("envoy applied the routes", version=applied)
                    return
        await trio.sleep(0.1)


def _envoy_tls(server: ServerConfig, protocol: Literal["grpc", "http"]) -> envoy.Tls | None:
    """The TLS of Envoy's public `protocol` listener: the node's settings, its files read first
    (so a bad one is a `ConfigError` here, not an Envoy that will not start)."""
    if server_context(server, protocol) is None:
        return None
    cert, key = getattr(server, f"{protocol}_server_cert"), getattr(server, f"{protocol}_server_key")
    mutual = getattr(server, f"{protocol}_use_ssl_mutual")
    return envoy.Tls(
        cert.resolve(), key.resolve(), getattr(server, f"{protocol}_root_cert").resolve() if mutual else None
    )


async def run_front(
    config: Config,
    specs: Sequence[WorkerSpec],
    supervisor: Supervisor,
    binary: str,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start Envoy (`binary`) and the controller; run until cancelled."""
    server_config = config.server
    directory = Path(tempfile.mkdtemp(prefix="hloserve-node-"))
    try:
        controller_address = f"127.0.0.1:{free_port()}"
        envoy.write_atomically(directory / "routing.pb", envoy.descriptor_set())
        serves_http = server_config.http_port >= 0
        workers = [
            WorkerLink(
                s.name,
                s.address,
                f"127.0.0.1:{s.metrics_port}" if s.metrics_port else None,
                http=f"127.0.0.1:{s.http_port}" if serves_http else None,
            )
            for s in specs
        ]
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            admin = free_port()
            publish = _Publisher(directory, controller_address, config, f"127.0.0.1:{admin}")
            grpc_restrictions = Restrictions.grpc(server_config.grpc_restricted_protocol)
            # The controller passes every restriction of the workers it calls.
            headers = [*grpc_restrictions.headers()]
            controller = Controller(config.node, workers, publish, headers)
            data, models = NodeDataPlane(controller), NodeModelPlane(controller)
            repository = NodeRepositoryPlane(controller)
            controller.on_ready = repository.restore_regions
            rest_server = None
            if serves_http:  # the controller's REST: what Envoy's REST routes give no worker
                # The REST routes over the node's planes, as over a worker's.
                # Behind Envoy, which terminates TLS; its restrictions are the node's.
                settings = dataclasses.replace(
                    server_config,
                    host="127.0.0.1",
                    http_port=0,
                    http_use_ssl=False,
                    http_use_ssl_mutual=False,
                )
                app = build_app(data=data, models=models, repository=repository, config=settings)
                rest_server = RestServer(app, settings)
                publish.controller_http = f"127.0.0.1:{await nursery.start(rest_server.run)}"
            publish.write_before_envoy_starts()
            bootstrap = envoy.bootstrap(
                directory,
                server_config.host,
                server_config.grpc_port,
                server_config.http_port if serves_http else -1,
                admin,
                server_config.max_message_bytes,
                _envoy_tls(server_config, "grpc"),
                _envoy_tls(server_config, "http"),
                traces=tracing.settings(config.tracing),
                shed=config.node.max_requests_per_worker > 0,
            )
            envoy.write_atomically(directory / "envoy.json", bootstrap)

            async def serving(name: str) -> bool | None:
                """grpc.health.v1 (Kubernetes' gRPC probes): the node, and each of its services,
                SERVING while the node is ready; any other name is unknown."""
                return node_readiness(controller)[0] if name in NODE_SERVICES else None

            # Built as a worker's: Envoy's connections to it live as long as the node, and a stock
            # grpclib server's remember h2's 65,536 closed streams each (~6 MB). Envoy passes the
            # client's headers through, so the node's restrictions apply here.
            server = build_grpc_server(
                server_config,
                [
                    InferenceService(data=data, models=models, repository=repository),
                    ControlService(NodeControlPlane(controller)),
                    GatewayFront(controller),
                ],
                lambda draining: Health(serving, draining, max_watches=config.server.max_health_watches),
            )
            host, _, port = controller_address.rpartition(":")
            await trio_asyncio.aio_as_trio(server.start)(host, int(port))
            http = None
            if server_config.metrics_port >= 0:
                pages = NodeHttp(controller, lambda: supervisor.starts, f"127.0.0.1:{admin}")
                http = await trio_asyncio.aio_as_trio(pages.serve)(server_config)
            argv = [
                binary,
                "-c",
                str(directory / "envoy.json"),
                "--log-level",
                "warn",
                "--disable-hot-restart",
            ]
            nursery.start_soon(supervisor.keep_running, Child("envoy", argv, {}, _ENVOY_GRACE_S))
            nursery.start_soon(publish.run)
            nursery.start_soon(
                _hold_unready_until_envoy_applies_the_routes, controller, publish, f"127.0.0.1:{admin}"
            )
            log.info(
                "node front listening",
                grpc=f"{server_config.host}:{server_config.grpc_port}",
                http=f"{server_config.host}:{server_config.http_port}" if serves_http else None,
                metrics=f"{server_config.host}:{server_config.metrics_port}",
                controller=controller_address,
                workers={s.name: s.address for s in specs} or config.node.workers_dns,
                scheduling=config.node.scheduling,
            )
            task_status.started()
            try:
                await trio_asyncio.aio_as_trio(controller.run)()
            finally:
                with trio.CancelScope(shield=True):
                    server.close()
                    if http is not None:
                        http.close()
                    if rest_server is not None:
                        rest_server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
