"""A frontend process (docs/frontends.md): `python -m hloserve.frontends.frontend LINK_FD PORT HTTP_PORT`.

Started by the engine (`hloserve.frontends.pool`), which writes the configuration and a summary of its
model table to the process's stdin and hands it one end of a socketpair. The frontend dies with
the engine (PR_SET_PDEATHSIG), runs the bundles' model.py (never weights, never the device),
listens on the public gRPC port (and REST port, unless it is -1) beside its siblings
(SO_REUSEPORT), parses, checks and runs hooks, and executes over its link. What only the engine
can answer goes to it whole: loads, unloads, shared-memory regions, statistics, and ModelInfer
for a meta model or naming a client's region. The engine pushes every change of its model table
(`TableChanged`), applied before the change's RPC returns. It exits when the link closes.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TypeVar, cast

import trio
import trio_asyncio
from grpclib.metadata import Deadline

from hloserve._process import die_with_parent
from hloserve._proto import hloserve_control as hc
from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve._proto.hot import hot_status_pb2 as hot_status
from hloserve._transport import grpclib_patches as _grpclib_patches
from hloserve._transport import trio_asyncio_patches as _trio_asyncio_patches
from hloserve.allocator import keep_freed_memory, limit_arenas, settle_heap
from hloserve.api import grpc_server
from hloserve.api.control import ControlService
from hloserve.api.data_plane import Call, LocalDataPlane
from hloserve.api.grpc_server import build_grpc_server
from hloserve.api.grpc_service import InferenceService
from hloserve.api.health import worker_health
from hloserve.api.model_plane import LocalModelPlane
from hloserve.api.repository_plane import index_of
from hloserve.api.rest.routes import build_app
from hloserve.api.rest.server import RestServer
from hloserve.api.tensor_codec import SHM_REGION, InferRequest
from hloserve.config import Config
from hloserve.engine.buffer_pool import BufferPool
from hloserve.engine.meta import MetaModels
from hloserve.engine.metrics import Metrics
from hloserve.engine.model_entry import Failed, Meta, ModelEntry, Remote, registration_of
from hloserve.engine.policy import PolicyParams
from hloserve.engine.statistics import Statistics
from hloserve.engine.tracing import RequestSpans, open_tracing
from hloserve.frontends.frontend_link import FrontendLink, execute_over
from hloserve.frontends.protocol import ARENA_PREFIX, FORWARD, EngineCalls, Listening, ModelSummary, Setup
from hloserve.memory_probe import start_memory_probe
from hloserve.tls import server_context

__all__: list[str] = []

ARENA_BYTES = 256 << 20
"""Each frontend's shared-memory arena (sparse: pages are used only as requests need them)."""
ARENA_SLOTS = 256

R = TypeVar("R")


def _entry(summary: ModelSummary) -> ModelEntry:
    """The frontend's entry for an engine model (blocking: it runs the bundle's model.py)."""
    bundle = summary.bundle
    if summary.error is not None or bundle is None:
        return ModelEntry(summary.name, Failed(summary.error or "not loaded"))
    try:
        registration = registration_of(bundle)
    except Exception as e:  # as the engine's load would have failed: said, not fatal
        return ModelEntry(summary.name, Failed(f"model.py failed in a frontend: {e}"))
    if bundle.manifest.is_meta:
        assert registration is not None
        return ModelEntry(summary.name, Meta(bundle, registration))  # its calls go to the engine
    return ModelEntry(summary.name, Remote(bundle, summary.batch_sizes, summary.coalescable, registration))


def _names_a_region(request: InferRequest) -> bool:
    """Whether a ModelInfer names a client's shared-memory region (for an input or an output)."""
    return any(SHM_REGION in t.parameters for t in request.inputs) or any(
        SHM_REGION in o.parameters for o in request.outputs
    )


class _OverLink:
    """The engine's answers to the calls only it can answer (`EngineCalls`), over the link."""

    def __init__(self, link: FrontendLink) -> None:
        self._call = trio_asyncio.trio_as_aio(link.call)

    async def __call__(self, method: str, message: object, reply: type[R]) -> R:
        return cast(R, await self._call(method, message))


class LinkedDataPlane:
    """A frontend's data plane: ModelInfer decoded, checked and run through `model.py` here, its
    executable inputs sent to the engine over the link (`execute_over`) and its calls counted
    by the engine (`local` records them over the link); a request only the engine can serve (a
    meta model's, one naming a client's shared-memory region) forwarded whole; readiness the
    engine's when it manages residency."""

    def __init__(
        self, link: FrontendLink, local: LocalDataPlane, config: Config, models: Mapping[str, ModelEntry]
    ) -> None:
        self._local = local
        self._config = config
        self._models = models
        self._engine = _OverLink(link)

    def call(self, rpc: str, model: str, traceparent: object = None, received_ns: int | None = None) -> Call:
        return self._local.call(rpc, model, traceparent, received_ns)

    def serves(self, name: str) -> bool:
        return self._local.serves(name)

    async def infer(
        self, request: InferRequest, deadline: Deadline | None, spans: RequestSpans | None = None
    ) -> hot.ModelInferResponse:
        entry = self._models.get(request.model_name)
        # Without client regions allowed, one named fails here as at K=0: no need to look.
        regions = self._config.server.allow_client_shm and _names_a_region(request)
        if (entry is not None and entry.meta_run is not None) or regions:
            remaining = None if deadline is None else deadline.time_remaining()
            reply = await self._engine(FORWARD, (request.SerializeToString(), remaining), bytes)
            return hot.ModelInferResponse.FromString(reply)
        return await self._local.infer(request, deadline, spans)

    async def ready(self) -> bool:
        return await self._local.ready()

    async def model_ready(self, name: str, version: str = "") -> bool:
        if self._config.weights.externally_managed:  # ready means resident: the engine knows
            return await self._engine(EngineCalls.MODEL_READY, (name, version), bool)
        return await self._local.model_ready(name, version)


class LinkedModelPlane:
    """A frontend's model plane: metadata, configuration and trace settings from its own table
    (`local`), statistics the engine's (which counts every frontend's calls)."""

    def __init__(self, link: FrontendLink, local: LocalModelPlane) -> None:
        self._local = local
        self._engine = _OverLink(link)

    async def server_metadata(self) -> kserve.ServerMetadataResponse:
        return await self._local.server_metadata()

    async def metadata(self, message: kserve.ModelMetadataRequest) -> kserve.ModelMetadataResponse:
        return await self._local.metadata(message)

    async def config(self, message: kserve.ModelConfigRequest) -> kserve.ModelConfigResponse:
        return await self._local.config(message)

    async def trace_settings(self, message: kserve.TraceSettingRequest) -> kserve.TraceSettingResponse:
        return await self._local.trace_settings(message)

    async def statistics(self, message: kserve.ModelStatisticsRequest) -> kserve.ModelStatisticsResponse:
        return await self._engine(EngineCalls.STATISTICS, message, kserve.ModelStatisticsResponse)


class LinkedRepositoryPlane:
    """A frontend's repository plane: loads, unloads and the client's regions are the engine's,
    answered over the link with the statuses it would give; the index is this frontend's table
    (the engine's, as pushed), unless the engine manages residency (readiness is residency)."""

    def __init__(
        self, link: FrontendLink, config: Config, models: Mapping[str, ModelEntry], statistics: Statistics
    ) -> None:
        self._engine = _OverLink(link)
        self._config = config
        self._models = models
        self._statistics = statistics

    def close(self) -> None:
        """Nothing: the regions are the engine's."""

    async def index(self, message: kserve.RepositoryIndexRequest) -> hot_status.RepositoryIndexResponse:
        if self._config.weights.externally_managed:
            answer = await self._engine(EngineCalls.INDEX, message, bytes)
            return hot_status.RepositoryIndexResponse.FromString(answer)
        return await index_of(self._models, self._config, self._statistics, message.ready)

    async def load(self, message: kserve.RepositoryModelLoadRequest) -> kserve.RepositoryModelLoadResponse:
        return await self._engine(EngineCalls.LOAD, message, kserve.RepositoryModelLoadResponse)

    async def unload(
        self, message: kserve.RepositoryModelUnloadRequest
    ) -> kserve.RepositoryModelUnloadResponse:
        return await self._engine(EngineCalls.UNLOAD, message, kserve.RepositoryModelUnloadResponse)

    async def register_region(
        self, message: kserve.SystemSharedMemoryRegisterRequest
    ) -> kserve.SystemSharedMemoryRegisterResponse:
        reply = kserve.SystemSharedMemoryRegisterResponse
        return await self._engine(EngineCalls.REGISTER_REGION, message, reply)

    async def region_status(
        self, message: kserve.SystemSharedMemoryStatusRequest
    ) -> kserve.SystemSharedMemoryStatusResponse:
        reply = kserve.SystemSharedMemoryStatusResponse
        return await self._engine(EngineCalls.REGION_STATUS, message, reply)

    async def unregister_region(
        self, message: kserve.SystemSharedMemoryUnregisterRequest
    ) -> kserve.SystemSharedMemoryUnregisterResponse:
        reply = kserve.SystemSharedMemoryUnregisterResponse
        return await self._engine(EngineCalls.UNREGISTER_REGION, message, reply)


class LinkedControlPlane:
    """A frontend's control plane: every call is the engine's, answered by its control plane
    over the link."""

    def __init__(self, link: FrontendLink) -> None:
        self._engine = _OverLink(link)

    async def status(self, message: hc.ModelControlStatusRequest) -> hot_status.ModelControlStatusResponse:
        answer = await self._engine(EngineCalls.CONTROL_STATUS, message, bytes)
        return hot_status.ModelControlStatusResponse.FromString(answer)

    async def set_residency(self, message: hc.SetModelResidencyRequest) -> hc.SetModelResidencyResponse:
        return await self._engine(EngineCalls.SET_RESIDENCY, message, hc.SetModelResidencyResponse)

    async def set_policy(self, message: hc.SetModelPolicyRequest) -> hc.SetModelPolicyResponse:
        return await self._engine(EngineCalls.SET_POLICY, message, hc.SetModelPolicyResponse)

    async def compact(self, message: hc.CompactMemoryRequest) -> hc.CompactMemoryResponse:
        return await self._engine(EngineCalls.COMPACT_MEMORY, message, hc.CompactMemoryResponse)


class _Host:
    """The host a frontend's model plane reads (`ConfigHost`): the configuration as loads changed it."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def apply(self, summary: ModelSummary) -> None:
        """Take a model's load settings (ModelConfig reports them)."""
        models = dict(self.config.scheduler.models)
        if summary.settings is None:
            models.pop(summary.name, None)
        else:
            models[summary.name] = summary.settings
        self.config = self.config.replace("scheduler", models=models)


async def _apply_changes(link: FrontendLink, models: dict[str, ModelEntry], host: _Host) -> None:
    """Apply the engine's table changes in order, each acknowledged once this frontend serves it."""
    async for ident, change in link.pushes:
        summary = change.summary
        if summary is None:
            models.pop(change.name, None)
        else:
            models[change.name] = await trio.to_thread.run_sync(_entry, summary)
            host.apply(summary)
        link.applied(ident)


async def _serve(link_fd: int, port: int, http_port: int, setup: Setup) -> None:
    config = setup.config
    _grpclib_patches.install()
    _trio_asyncio_patches.install()
    models = {s.name: _entry(s) for s in setup.models}
    statistics = Statistics()
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=link_fd))
    name = f"{ARENA_PREFIX}{setup.index}"
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        with BufferPool(ARENA_BYTES, ARENA_SLOTS, name=name) as arena:
            link = FrontendLink(trio.SocketStream(sock), arena)
            await nursery.start(link.run)
            host = _Host(config)
            nursery.start_soon(_apply_changes, link, models, host)
            tracing = open_tracing(config.tracing)
            metas = MetaModels(models, 1, 1, None, statistics, PolicyParams())
            local = LocalDataPlane(
                config=config,
                models=models,
                statistics=statistics,
                metrics=Metrics(statistics),
                metas=metas,
                execute=execute_over(link),
                tracing=tracing,
                record=link.count,  # the engine counts every frontend's calls
            )
            data = LinkedDataPlane(link, local, config, models)
            model_plane = LinkedModelPlane(
                link,
                LocalModelPlane(
                    config=config, models=models, statistics=statistics, host=host, platform=setup.platform
                ),
            )
            repository = LinkedRepositoryPlane(link, config, models, statistics)
            service = InferenceService(data=data, models=model_plane, repository=repository)
            server = build_grpc_server(  # as the single process's
                config.server,
                [service, ControlService(LinkedControlPlane(link))],
                lambda draining: worker_health(data, config.server.max_health_watches, draining),
            )
            await grpc_server.start(
                server, config.server, port, server_context(config.server, "grpc"), reuse_port=True
            )
            rest = None
            if http_port >= 0:
                rest_config = dataclasses.replace(config.server, http_port=http_port)
                app = build_app(data=data, models=model_plane, repository=repository, config=rest_config)
                rest = RestServer(app, rest_config, reuse_port=True)
                await nursery.start(rest.run)
            settle_heap()  # as the engine does: startup's objects out of the collector's walks
            start_memory_probe(config.logging, "frontend")
            await link.announce(Listening())
            await _until_stopped(link)
            with trio.CancelScope(shield=True):
                if rest is not None:
                    rest.stop()
                await grpc_server.shut_down(server, config.server)
                if rest is not None:
                    with trio.move_on_after(config.server.shutdown_grace_s + 1):
                        await rest.stopped.wait()
                if tracing is not None:
                    await trio.to_thread.run_sync(tracing.shutdown)
            nursery.cancel_scope.cancel()


async def _until_stopped(link: FrontendLink) -> None:
    """Until SIGTERM or SIGINT (the engine drains us) or the link closes (the engine is gone)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()

            async def on_close() -> None:
                await link.closed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(on_close)


def main(argv: list[str]) -> None:
    die_with_parent(signal.SIGKILL)  # the engine forked us from its trio thread
    link_fd, port, http_port = int(argv[0]), int(argv[1]), int(argv[2])
    setup = pickle.load(sys.stdin.buffer)  # from the engine that started us: trusted
    limit_arenas(setup.config.server.malloc_arenas)
    keep_freed_memory(setup.config.server.keep_freed_bytes)
    trio.run(_serve, link_fd, port, http_port, setup)


if __name__ == "__main__":
    main(sys.argv[1:])
