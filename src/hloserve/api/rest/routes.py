"""The KServe V2 REST routes: an adapter over the planes, as the gRPC service is.

Inference is a bare ASGI handler; the other routes go through Starlette. Inference and readiness
go through the data plane (`hloserve.api.data_plane`), metadata, configuration, statistics and
trace settings through the model plane (`hloserve.api.model_plane`), the repository and regions
through the repository plane (`hloserve.api.repository_plane`), in the betterproto2 messages that
gRPC carries, so checks, statistics and errors are the gRPC ones. A status becomes an HTTP status
as Triton maps its error codes (`HTTP_STATUS`), with a JSON `{"error": "..."}` body. Request
bodies are read within the server's bounds (`hloserve.api.rest.body`). A client that disconnects
while its inference is awaited cancels it, which withdraws it from its model's queue. Binary
outputs are sent after the JSON header without joining them. Each inference is one call of the
data plane (`DataPlane.call`), which counts and traces it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from typing import TYPE_CHECKING, Any

from grpclib.const import Status
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hloserve._proto import inference as kserve
from hloserve._proto.hot import hot_infer_pb2 as hot
from hloserve.api.repository_plane import cuda_region_status, no_cuda_regions
from hloserve.api.rest.body import BodyReader, Disconnected, HttpRefusal, Receive, compress, response_encoding
from hloserve.api.rest.inflight import InFlight
from hloserve.api.rest.json_codec import (
    INLINE_JSON,
    decode_infer,
    encode_infer,
    header_length,
    json_output_bytes,
    parse_json,
)
from hloserve.api.rest.messages import fields_json, load_parameters, parse_fairly, to_json
from hloserve.api.status import to_grpc_error
from hloserve.config import ServerConfig
from hloserve.restricted import Restrictions, http_group, http_message

if TYPE_CHECKING:
    from hloserve.api.data_plane import Call, DataPlane
    from hloserve.api.model_plane import ModelPlane
    from hloserve.api.repository_plane import RepositoryPlane
    from hloserve.api.tensor_codec import InferRequest

__all__ = ["HTTP_STATUS", "App", "Routes", "build_app"]


HTTP_STATUS = {
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 503,  # Triton answers a request whose timeout expired UNAVAILABLE
    Status.INTERNAL: 500,
    Status.UNIMPLEMENTED: 501,
}
"""HTTP status by gRPC status, as Triton's HttpCodeFromError; every other status is 400."""

_HEADER_LENGTH = "inference-header-content-length"

_HEADER_LENGTH_OUT = b"Inference-Header-Content-Length"

_INFER_HEADERS = {
    b"content-length",
    b"content-encoding",
    b"accept-encoding",
    _HEADER_LENGTH.encode(),
    b"traceparent",
}  # the request headers inference reads


def _error(error: Exception, rpc: str) -> tuple[Status, int, str, dict[str, str]]:
    """The gRPC status, HTTP status, message and extra headers a client gets for `error`."""
    if isinstance(error, HttpRefusal):
        return error.status, error.http or HTTP_STATUS.get(error.status, 400), str(error), error.headers
    grpc_error = to_grpc_error(error, rpc)
    return grpc_error.status, HTTP_STATUS.get(grpc_error.status, 400), grpc_error.message or "", {}


def _error_response(error: Exception, rpc: str) -> Response:
    _, http, message, headers = _error(error, rpc)
    return JSONResponse({"error": message}, http, headers)


Handler = Callable[[Request], Awaitable[Response]]

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")

_JSON = [(b"content-type", b"application/json")]

_BINARY = [(b"content-type", b"application/octet-stream")]


class Routes:
    """The endpoints, bound to one process's planes."""

    def __init__(
        self, *, data: DataPlane, models: ModelPlane, repository: RepositoryPlane, config: ServerConfig
    ) -> None:
        self._data = data
        self._models = models
        self._repository = repository
        self.inflight = InFlight(config.http_body_timeout_s, config.http_idle_timeout_s)
        self.bodies = BodyReader(config, self.inflight)

    async def _json(self, request: Request, files: bool = False) -> dict[str, Any]:
        """A JSON object body (at most `server.http_max_json_bytes`, or with `files`, a load's,
        whose `file:` contents are base64 strings, `server.max_message_bytes`); an empty body is
        {}. Past `INLINE_JSON` bytes it is parsed in a worker thread, fairly (`parse_json`)."""
        body = bytes(
            await self.bodies.read(
                request.headers, request.receive, None if files else self.bodies.json_limit
            )
        )
        if not body.strip():
            return {}
        try:
            if len(body) <= INLINE_JSON:
                value = parse_json(body)  # with no numpy to convert, arrays cost what numbers do
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(None, parse_fairly, body)
        except ValueError as e:
            raise HttpRefusal(str(e)) from None
        if not isinstance(value, dict):
            raise HttpRefusal("the request must be a JSON object")
        return value

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self, model: str, version: str, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None:
        """POST .../infer as a bare ASGI handler: the hot path skips Starlette's routing,
        middleware and request objects."""
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _INFER_HEADERS
        }
        replying = False
        try:
            with self._data.call("ModelInfer", model, headers.get("traceparent")) as call:
                pieces, response_headers = await self._answer(model, version, headers, scope, receive, call)
                replying = True
                sending, task = self.inflight.sending, asyncio.current_task()
                assert task is not None
                sending[task] = (
                    asyncio.get_running_loop().time() + self.inflight.body_timeout_s,
                    scope["client"],
                )
                try:
                    await _respond(send, 200, pieces, response_headers)
                finally:
                    sending.pop(task, None)
        except Disconnected:
            return  # nobody to answer; as a cancelled gRPC call, it is not counted
        except Exception as e:
            if replying:
                raise
            _, http, message, extra = _error(e, "ModelInfer")
            body = json.dumps({"error": message}).encode()
            extra_headers = [(k.lower().encode(), v.encode()) for k, v in extra.items()]
            await _respond(send, http, [body], _JSON + extra_headers)

    async def _answer(
        self,
        model: str,
        version: str,
        headers: dict[str, str],
        scope: MutableMapping[str, Any],
        receive: Receive,
        call: Call,
    ) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
        """The answer to an inference request: its body's pieces and its headers."""
        length = header_length(headers.get(_HEADER_LENGTH), model)
        if length is not None and length > self.bodies.json_limit:
            raise self.bodies.too_large(
                f"the JSON header of {length} bytes", self.bodies.json_limit, "server.http_max_json_bytes"
            )
        received = await self.bodies.read(
            headers, receive, self.bodies.json_limit if length is None else None
        )
        loop = asyncio.get_running_loop()
        if (len(received) if length is None else length) <= INLINE_JSON:
            decoded = decode_infer(received, length, model, version)
        else:  # the worker thread gives the loop the interpreter back (`parse_json(fair=True)`)
            decoded = await loop.run_in_executor(None, decode_infer, received, length, model, version)
        response = await self._unless_disconnected(decoded.request, scope["client"], call)
        if json_output_bytes(response, decoded) <= INLINE_JSON:
            pieces, binary_length = encode_infer(response, decoded)
        else:  # written a slice at a time in a worker thread, which gives the loop the interpreter
            pieces, binary_length = await loop.run_in_executor(None, encode_infer, response, decoded, True)
        response_headers = _JSON if binary_length is None else _BINARY
        if binary_length is not None:
            response_headers = [*response_headers, (_HEADER_LENGTH_OUT, str(binary_length).encode())]
        encoding = response_encoding(headers.get("accept-encoding"))
        if encoding is not None:
            pieces = [await compress(pieces, encoding)]
            response_headers = [*response_headers, (b"content-encoding", encoding.encode())]
        return pieces, response_headers

    async def _unless_disconnected(
        self, request: InferRequest, client: Hashable, call: Call
    ) -> hot.ModelInferResponse:
        """The service's answer; a client that disconnects meanwhile cancels it, so that a
        request still in its model's queue is withdrawn (as a gRPC cancellation withdraws one)."""
        task, serving = asyncio.current_task(), self.inflight.serving
        assert task is not None
        serving[client] = task
        try:
            return await self._data.infer(request, None, call.spans)
        except asyncio.CancelledError:
            if not self.inflight.ours(task):
                raise
            raise Disconnected() from None
        finally:
            if serving.get(client) is task:
                del serving[client]
            self.inflight.cancelled.discard(task)  # a cancellation the service swallowed, if any

    # -- health and metadata -------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)  # it answers: it lives

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if await self._data.ready() else 400)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse(to_json(await self._models.server_metadata()))

    @staticmethod
    def _model(request: Request) -> tuple[str, str]:
        return request.path_params["model"], request.path_params.get("version", "")

    async def model_ready(self, request: Request) -> Response:
        name, version = self._model(request)
        return Response(status_code=200 if await self._data.model_ready(name, version) else 400)

    async def model_metadata(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._models.metadata(kserve.ModelMetadataRequest(name, version))
        return JSONResponse(to_json(reply))

    async def model_config(self, request: Request) -> Response:
        name, version = self._model(request)
        reply = await self._models.config(kserve.ModelConfigRequest(name, version))
        return JSONResponse(to_json(reply)["config"])  # Triton answers the config itself

    async def model_stats(self, request: Request) -> Response:
        name, version = request.path_params.get("model", ""), request.path_params.get("version", "")
        reply = await self._models.statistics(kserve.ModelStatisticsRequest(name, version))
        return JSONResponse(fields_json(reply))

    async def trace_setting(self, request: Request) -> Response:
        """GET or POST /v2[/models/{model}]/trace/setting: the settings as Triton writes them
        (`trace_level` a list, the others strings); a POST that changes any is refused (501)."""
        changes = await self._json(request) if request.method == "POST" else {}
        message = kserve.TraceSettingRequest(
            {
                str(key)[:64]: kserve.TraceSettingRequestSettingValue(
                    [str(v) for v in value] if isinstance(value, list) else [str(value)]
                )
                for key, value in changes.items()
            },
            request.path_params.get("model", ""),
        )
        reply = await self._models.trace_settings(message)
        return JSONResponse(
            {k: v.value if k == "trace_level" else "".join(v.value) for k, v in reply.settings.items()}
        )

    # -- model repository ----------------------------------------------------------------------

    async def repository_index(self, request: Request) -> Response:
        ready = (await self._json(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise HttpRefusal("Invalid value for 'ready': expected a boolean")
        reply = await self._repository.index(kserve.RepositoryIndexRequest(ready=ready))
        fields = ("name", "version", "state", "reason")
        return JSONResponse([{f: getattr(m, f) for f in fields} for m in reply.models])

    async def load(self, request: Request) -> Response:
        parameters = (await self._json(request, files=True)).get("parameters", {})
        if not isinstance(parameters, dict):
            raise HttpRefusal("Invalid value for 'parameters': expected an object")
        files = sum(
            len(v) for k, v in parameters.items() if isinstance(v, str) and str(k).startswith("file:")
        )
        if files <= INLINE_JSON:
            decoded = load_parameters(parameters)
        else:  # decoded a slice at a time in a worker thread, which gives the loop the interpreter back
            decoded = await asyncio.get_running_loop().run_in_executor(None, load_parameters, parameters)
        message = kserve.RepositoryModelLoadRequest(
            model_name=request.path_params["model"], parameters=decoded
        )
        await self._repository.load(message)
        return Response()

    async def unload(self, request: Request) -> Response:
        await self._json(request)
        name = request.path_params["model"]
        await self._repository.unload(kserve.RepositoryModelUnloadRequest(model_name=name))
        return Response()

    # -- system shared memory ------------------------------------------------------------------

    async def shm_status(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        reply = await self._repository.region_status(kserve.SystemSharedMemoryStatusRequest(name))
        return JSONResponse([to_json(r) for r in reply.regions.values()])

    async def shm_register(self, request: Request) -> Response:
        body = await self._json(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise HttpRefusal("Shared memory register request needs 'key', a string")
        for field, value in (("offset", offset), ("byte_size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
                raise HttpRefusal(f"Shared memory register request needs '{field}', an integer >= 0")
        assert isinstance(size, int)
        message = kserve.SystemSharedMemoryRegisterRequest(request.path_params["region"], key, offset, size)
        await self._repository.register_region(message)
        return Response()

    async def shm_unregister(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        await self._repository.unregister_region(kserve.SystemSharedMemoryUnregisterRequest(name))
        return Response()

    async def cuda_shm_status(self, request: Request) -> Response:
        cuda_region_status(request.path_params.get("region", ""))
        return JSONResponse([])

    async def cuda_shm_unregister(self, request: Request) -> Response:
        return Response()  # nothing is registered: done

    async def cuda_shm(self, request: Request) -> Response:
        raise no_cuda_regions("CudaSharedMemoryRegister")


_JOIN_BYTES = 1 << 16
"""A response this small is joined and sent in one piece (one pass through hypercorn and h11
costs more than copying it); a larger one is sent piece by piece, its tensors never copied."""


async def _respond(send: Send, status: int, pieces: list[bytes], headers: list[tuple[bytes, bytes]]) -> None:
    length = sum(map(len, pieces))
    headers = [*headers, (b"content-length", str(length).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if length <= _JOIN_BYTES:
        pieces = [b"".join(pieces)]
    for i, piece in enumerate(pieces, 1 - len(pieces)):
        await send({"type": "http.response.body", "body": piece, "more_body": i < 0})


def _endpoint(handler: Handler, rpc: str) -> Handler:
    """`handler`, with whatever it raises answered as an error response."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except Disconnected:
            return Response(status_code=400)  # nobody is left to read it
        except Exception as e:
            return _error_response(e, rpc)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, exc.status_code, exc.headers)


def build_app(
    *, data: DataPlane, models: ModelPlane, repository: RepositoryPlane, config: ServerConfig
) -> App:
    """The Starlette application of the V2 REST protocol over a process's planes."""
    r = Routes(data=data, models=models, repository=repository, config=config)

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
        get("/v2/cudasharedmemory/status", r.cuda_shm_status, "CudaSharedMemoryStatus"),
        get("/v2/cudasharedmemory/region/{region}/status", r.cuda_shm_status, "CudaSharedMemoryStatus"),
        post("/v2/cudasharedmemory/unregister", r.cuda_shm_unregister, "CudaSharedMemoryUnregister"),
        post(
            "/v2/cudasharedmemory/region/{region}/unregister",
            r.cuda_shm_unregister,
            "CudaSharedMemoryUnregister",
        ),
        Route("/v2/trace/setting", _endpoint(r.trace_setting, "TraceSetting"), methods=["GET", "POST"]),
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
            Route(
                model + "/trace/setting", _endpoint(r.trace_setting, "TraceSetting"), methods=["GET", "POST"]
            ),
        ]
    starlette = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return App(r, starlette, config.http_max_header_bytes, Restrictions.http(config.http_restricted_api))


class App:
    """The ASGI application: inference straight to its handler, the rest through Starlette;
    a request to a restricted API group without its header is answered 403 first."""

    def __init__(
        self, routes: Routes, starlette: Starlette, max_head_bytes: int, restrictions: Restrictions
    ) -> None:
        self.routes, self._starlette, self._max_head_bytes = routes, starlette, max_head_bytes
        self._restrictions = restrictions
        self.inflight = routes.inflight

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self._starlette(scope, receive, send)
        # h11 bounds a head still arriving; one that came whole in a single read is counted here
        head = (
            len(scope["raw_path"])
            + len(scope["query_string"])
            + sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        )
        if head > self._max_head_bytes:
            message = (
                f"the request line and headers take {head} bytes, past the server's limit of "
                f"{self._max_head_bytes} (server.http_max_header_bytes)"
            )
            return await _respond(send, 431, [json.dumps({"error": message}).encode()], _JSON)
        if self._restrictions:
            headers = {name.decode("latin-1"): value for name, value in scope["headers"]}
            rule = self._restrictions.refusal(http_group(scope["path"]), headers)
            if rule is not None:  # Triton's status and words (http_server.cc RespondIfRestricted)
                # A body it declared is never read: the connection closes after the answer
                # (reading it would let a client without the header make the server take its
                # bytes), else it stays open for the next request.
                body = headers.get("content-length", b"0") != b"0" or "transfer-encoding" in headers
                extra = [(b"connection", b"close")] if body else []
                error = json.dumps({"error": http_message(rule)}).encode()
                return await _respond(send, 403, [error], [*_JSON, *extra])
        if scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                return await self.routes.infer(match[1], match[2] or "", scope, receive, send)
        await self._starlette(scope, receive, send)
