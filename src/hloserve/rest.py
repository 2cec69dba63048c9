"""The KServe V2 REST front end: Starlette routes over the gRPC service object, served by
hypercorn's trio worker in the worker's own trio run.

Every route calls an `InferenceService` method (with the betterproto2 messages; inference with
the hot-path request through `_infer`), so checks, statistics, metrics and error classes are the
gRPC ones. A gRPC status becomes an HTTP status as Triton maps its error codes (`HTTP_STATUS`),
with a JSON `{"error": "..."}` body. Request bodies are bounded by `server.max_message_bytes`,
refused from their Content-Length before they are read (and counted while read when chunked or
compressed).
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import betterproto2
import hypercorn.config
import hypercorn.trio
import hypercorn.trio.run
import hypercorn.utils
import trio
import trio_asyncio
from grpclib.const import Status
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hloserve._proto import inference as kserve
from hloserve._status import to_grpc_error
from hloserve.config import ServerConfig
from hloserve.rest_codec import decode_infer, encode_infer

if TYPE_CHECKING:
    from hloserve.service import InferenceService
    from hloserve.worker import ModelEntry

__all__ = ["HTTP_STATUS", "RestServer", "build_app"]

HTTP_STATUS = {
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 503,  # Triton answers a request whose timeout expired UNAVAILABLE
    Status.INTERNAL: 500,
    Status.UNIMPLEMENTED: 501,
}
"""HTTP status by gRPC status, as Triton's HttpCodeFromError; every other status is 400."""

_HEADER_LENGTH = "inference-header-content-length"
_WBITS = {"gzip": 31, "deflate": 15}  # zlib window bits: gzip container, zlib container (as Triton)


class HttpRefusal(Exception):
    """A request refused at the HTTP layer (its body or headers), before the service sees it."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        self.status, self.headers = status, dict(headers or {})
        super().__init__(message)


def _error_response(error: Exception, rpc: str) -> Response:
    if isinstance(error, HttpRefusal):
        return JSONResponse({"error": str(error)}, error.status, error.headers)
    grpc_error = to_grpc_error(error, rpc)
    return JSONResponse({"error": grpc_error.message}, HTTP_STATUS.get(grpc_error.status, 400))


def _plain(value: Any) -> Any:
    """A betterproto2 `to_dict` in Python form as JSON values: enums by name, unset messages gone."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.name if isinstance(value, Enum) else value


def _to_json(message: betterproto2.Message) -> Any:
    return _plain(
        message.to_dict(
            output_format=betterproto2.OutputFormat.PYTHON,
            casing=betterproto2.Casing.SNAKE,
            include_default_values=True,
        )
    )


def _response_encoding(accept: str | None) -> str | None:
    """gzip or deflate when the client's Accept-Encoding prefers it (q weights as Triton reads
    them); None for identity."""
    best, weight = None, 0.0
    for part in (accept or "").split(","):
        name, _, q = part.partition(";")
        name, q = name.strip().lower(), q.strip()
        try:
            w = float(q[2:]) if q.startswith("q=") else 1.0
        except ValueError:
            continue
        if name in ("identity", "gzip", "deflate") and w > weight:
            best, weight = name, w
    return None if best == "identity" else best


def _compress(body: bytes, encoding: str) -> bytes:
    return zlib.compress(body, 6, _WBITS[encoding])


Handler = Callable[[Request], Awaitable[Response]]


class _Routes:
    """The endpoints, bound to one service."""

    def __init__(self, service: InferenceService, models: Mapping[str, ModelEntry], limit: int) -> None:
        self._service = service
        self._models = models
        self._limit = limit
        self._infer = trio_asyncio.aio_as_trio(service._infer)

    async def _body(self, request: Request) -> bytes:
        """The request body, decompressed, refused once it passes the limit."""
        limit = self._limit
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise self._too_large(f"request body of {declared} bytes")
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self._too_large(f"request body of more than {limit} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in _WBITS:
            inflater = zlib.decompressobj(_WBITS[encoding])
            try:
                body = inflater.decompress(body, limit + 1)
            except zlib.error as e:
                raise HttpRefusal(400, f"the body is not valid {encoding} data: {e}") from None
            if len(body) > limit:
                raise self._too_large(f"{encoding} body that inflates to more than {limit} bytes")
            if not inflater.eof:
                raise HttpRefusal(400, f"the {encoding} body is truncated")
        elif encoding not in ("identity", ""):
            raise HttpRefusal(
                501,
                f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or identity",
                {"Accept-Encoding": "gzip, deflate"},
            )
        return body

    def _too_large(self, what: str) -> HttpRefusal:
        return HttpRefusal(
            400, f"{what} exceeds the server's limit of {self._limit} bytes (server.max_message_bytes)"
        )

    async def _json(self, request: Request) -> dict[str, Any]:
        """A JSON object body; an empty body is {}."""
        body = await self._body(request)
        if not body.strip():
            return {}
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpRefusal(400, f"the request is not valid JSON: {e}"[:200]) from None
        if not isinstance(value, dict):
            raise HttpRefusal(400, "the request must be a JSON object")
        return value

    async def _call(self, method: Callable[[Any], Awaitable[Any]], message: Any) -> Any:
        return await trio_asyncio.aio_as_trio(method)(message)

    # -- inference -----------------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        started = time.perf_counter()
        model = request.path_params["model"]
        label = model if model in self._models else "<unknown>"
        try:
            header_length = request.headers.get(_HEADER_LENGTH)
            if header_length is not None and not header_length.strip().isdigit():
                raise HttpRefusal(
                    400, f"Inference-Header-Content-Length must be a byte count, got {header_length!r}"[:200]
                )
            decoded = decode_infer(
                await self._body(request),
                None if header_length is None else int(header_length),
                model,
                request.path_params.get("version", ""),
            )
            content, binary_length = encode_infer(await self._infer(decoded.request, None), decoded)
        except Exception as e:
            response = _error_response(e, "ModelInfer")
            self._service._count(label, "HTTP_" + str(response.status_code), started, failed=True)
            return response
        self._service._count(label, "OK", started, failed=False)
        headers = {}
        if binary_length is not None:
            headers["Inference-Header-Content-Length"] = str(binary_length)
        encoding = _response_encoding(request.headers.get("accept-encoding"))
        if encoding is not None:
            content = _compress(content, encoding)
            headers["Content-Encoding"] = encoding
        media_type = "application/json" if binary_length is None else "application/octet-stream"
        return Response(content, headers=headers, media_type=media_type)

    # -- health and metadata -------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        reply = await self._call(self._service.server_live, kserve.ServerLiveRequest())
        return Response(status_code=200 if reply.live else 400)

    async def ready(self, request: Request) -> Response:
        reply = await self._call(self._service.server_ready, kserve.ServerReadyRequest())
        return Response(status_code=200 if reply.ready else 400)

    async def server_metadata(self, request: Request) -> Response:
        reply = await self._call(self._service.server_metadata, kserve.ServerMetadataRequest())
        return JSONResponse(_to_json(reply))

    @staticmethod
    def _model(request: Request) -> tuple[str, str]:
        return request.path_params["model"], request.path_params.get("version", "")

    async def model_ready(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._call(self._service.model_ready, kserve.ModelReadyRequest(name, version))
        return Response(status_code=200 if reply.ready else 400)

    async def model_metadata(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._call(self._service.model_metadata, kserve.ModelMetadataRequest(name, version))
        return JSONResponse(_to_json(reply))

    async def model_config(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._call(self._service.model_config, kserve.ModelConfigRequest(name, version))
        return JSONResponse(_to_json(reply)["config"])  # Triton answers the config itself

    async def model_stats(self, request: Request) -> Response:
        name, version = request.path_params.get("model", ""), request.path_params.get("version", "")
        reply = await self._call(self._service.model_statistics, kserve.ModelStatisticsRequest(name, version))
        return JSONResponse(_to_json(reply))

    # -- model repository ----------------------------------------------------------------------

    async def repository_index(self, request: Request) -> Response:
        ready = (await self._json(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise HttpRefusal(400, "Invalid value for 'ready': expected a boolean")
        reply = await self._call(self._service.repository_index, kserve.RepositoryIndexRequest(ready=ready))
        return JSONResponse(_to_json(reply)["models"])

    async def load(self, request: Request) -> Response:
        await self._json(request)  # parameters (a config override, files) are not supported, as on gRPC
        name = request.path_params["model"]
        await self._call(
            self._service.repository_model_load, kserve.RepositoryModelLoadRequest(model_name=name)
        )
        return Response()

    async def unload(self, request: Request) -> Response:
        await self._json(request)
        name = request.path_params["model"]
        await self._call(
            self._service.repository_model_unload, kserve.RepositoryModelUnloadRequest(model_name=name)
        )
        return Response()

    # -- system shared memory ------------------------------------------------------------------

    async def shm_status(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        reply = await self._call(
            self._service.system_shared_memory_status, kserve.SystemSharedMemoryStatusRequest(name)
        )
        return JSONResponse([_to_json(r) for r in reply.regions.values()])

    async def shm_register(self, request: Request) -> Response:
        body = await self._json(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise HttpRefusal(400, "Shared memory register request needs 'key', a string")
        for field, value in (("offset", offset), ("byte_size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
                raise HttpRefusal(400, f"Shared memory register request needs '{field}', an integer >= 0")
        assert isinstance(size, int)
        message = kserve.SystemSharedMemoryRegisterRequest(request.path_params["region"], key, offset, size)
        await self._call(self._service.system_shared_memory_register, message)
        return Response()

    async def shm_unregister(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        await self._call(
            self._service.system_shared_memory_unregister, kserve.SystemSharedMemoryUnregisterRequest(name)
        )
        return Response()

    async def cuda_shm(self, request: Request) -> Response:
        await self._service._unimplemented("CudaSharedMemoryStatus", None)  # raises the gRPC answer
        raise AssertionError("unreachable")


def _endpoint(handler: Handler, rpc: str) -> Handler:
    """`handler`, with whatever it raises answered as an error response."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            return _error_response(e, rpc)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, exc.status_code, exc.headers)


def build_app(service: InferenceService, models: Mapping[str, ModelEntry], limit: int) -> Starlette:
    """The Starlette application of the V2 REST protocol over `service`."""
    r = _Routes(service, models, limit)

    def get(path: str, handler: Handler, rpc: str) -> Route:
        return Route(path, _endpoint(handler, rpc), methods=["GET"])

    def post(path: str, handler: Handler, rpc: str) -> Route:
        return Route(path, _endpoint(handler, rpc), methods=["POST"])

    routes = [
        get("/v2", r.server_metadata, "ServerMetadata"),
        get("/v2/health/live", r.live, "ServerLive"),
        get("/v2/health/ready", r.ready, "ServerReady"),
        get("/v2/models/stats", r.model_stats, "ModelStatistics"),
        post("/v2/repository/index", r.repository_index, "RepositoryIndex"),
        post("/v2/repository/models/{model}/load", r.load, "RepositoryModelLoad"),
        post("/v2/repository/models/{model}/unload", r.unload, "RepositoryModelUnload"),
        get("/v2/systemsharedmemory/status", r.shm_status, "SystemSharedMemoryStatus"),
        get("/v2/systemsharedmemory/region/{region}/status", r.shm_status, "SystemSharedMemoryStatus"),
        post("/v2/systemsharedmemory/region/{region}/register", r.shm_register, "SystemSharedMemoryRegister"),
        post(
            "/v2/systemsharedmemory/region/{region}/unregister",
            r.shm_unregister,
            "SystemSharedMemoryUnregister",
        ),
        post("/v2/systemsharedmemory/unregister", r.shm_unregister, "SystemSharedMemoryUnregister"),
        Route(
            "/v2/cudasharedmemory/{rest:path}",
            _endpoint(r.cuda_shm, "CudaSharedMemory"),
            methods=["GET", "POST"],
        ),
    ]
    for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            get(model, r.model_metadata, "ModelMetadata"),
            get(model + "/ready", r.model_ready, "ModelReady"),
            get(model + "/config", r.model_config, "ModelConfig"),
            get(model + "/stats", r.model_stats, "ModelStatistics"),
            Route(model + "/infer", r.infer, methods=["POST"]),  # catches its own errors, to count them
        ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


class RestServer:
    """hypercorn serving the REST app on `server.host`:`server.http_port` until `stop()`."""

    def __init__(self, app: Starlette, config: ServerConfig) -> None:
        self._app = app
        self._config = config
        self._stop = trio.Event()
        self.stopped = trio.Event()
        """Set once every connection is closed (after `stop()`, within the grace period)."""

    def stop(self) -> None:
        """Stop accepting connections; those open finish their requests within the grace period."""
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound port, serve until stopped; an address in use raises OSError."""
        host, port = self._config.host, self._config.http_port
        settings = hypercorn.config.Config()
        settings.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        settings.graceful_timeout = self._config.shutdown_grace_s
        settings.accesslog = settings.errorlog = None  # the routes answer and log what goes wrong
        try:
            # Bound here rather than inside hypercorn, so a bind error is a plain OSError.
            sockets = settings.create_sockets()
            sockets.insecure_sockets[0].listen(settings.backlog)
            bound = sockets.insecure_sockets[0].getsockname()[1]
            serve = functools.partial(
                hypercorn.trio.run.worker_serve,
                hypercorn.utils.wrap_app(self._app, settings.wsgi_max_body_size, "asgi"),  # type: ignore[arg-type]
                settings,
                sockets=sockets,
                shutdown_trigger=self._stop.wait,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                task_status.started(bound)
        finally:
            self.stopped.set()
