"""Restricted APIs, as Triton's `--grpc-restricted-protocol` and `--http-restricted-api`.

A restriction names protocol groups and the header a call to any of them must carry:
`<group>,<group>,...:<key>=<value>`. On gRPC the header is `triton-grpc-protocol-<key>` and a call
without it (or with another value) is answered UNAVAILABLE "This protocol is restricted, expecting
header 'triton-grpc-protocol-<key>'"; on REST the header is `<key>` itself and the answer is 403
with `{"error": "This API is restricted, expecting header '<key>'"}`: Triton's codes and words
(`grpc_server.cc`, `http_server.cc`), so its clients and tests read them unchanged.

The groups are Triton's (`health`, `metadata`, `inference`, `shared-memory`, `model-config`,
`model-repository`, `statistics`, `trace`, `logging`) and hloserve's `control` (the control
service, and the node's gateway). A group may be in one restriction only; a call that belongs to
no group (none exists today) is never restricted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError

from hloserve.errors import ConfigError

__all__ = [
    "GROUPS",
    "GRPC_HEADER_PREFIX",
    "GRPC_PATHS",
    "HTTP_PATHS",
    "Restriction",
    "Restrictions",
    "grpc_group",
    "grpc_message",
    "http_group",
    "http_message",
    "restrict_grpc",
]

GROUPS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
    "control",
)
"""The protocol groups a restriction may name: Triton's, and hloserve's control service."""

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
"""What Triton puts before a gRPC restriction's key to name its header."""

_GRPC_METHODS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
_GRPC_SERVICES = {
    "grpc.health.v1.Health": "health",  # Triton puts the gRPC health protocol in `health` too
    "hloserve_control.ControlService": "control",
    "hloserve_gateway.GatewayControlService": "control",
}

# A header name (an HTTP token, lower case as HTTP/2 sends it) and a value without control bytes.
_SPEC = re.compile(r"(?P<groups>[a-z-]+(?:,[a-z-]+)*):(?P<key>[!#$%&'*+.^_`|~0-9A-Za-z-]+)=(?P<value>[ -~]*)")


def grpc_group(method: str) -> str | None:
    """The group of a gRPC method path (`/inference.GRPCInferenceService/ModelInfer`)."""
    service, _, name = method.strip("/").partition("/")
    if service == "inference.GRPCInferenceService":
        if name.startswith(("SystemSharedMemory", "CudaSharedMemory")):
            return "shared-memory"
        return _GRPC_METHODS.get(name)
    return _GRPC_SERVICES.get(service)


_MODEL = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?(?P<kind>/[^/]+(?:/setting)?)?")
_MODEL_KINDS = {
    None: "metadata",
    "/ready": "health",
    "/infer": "inference",
    "/generate": "inference",
    "/generate_stream": "inference",
    "/config": "model-config",
    "/stats": "statistics",
    "/trace/setting": "trace",
}


def http_group(path: str) -> str | None:
    """The group of a REST path, as Triton's `HTTPAPIServer::Handle` sorts them."""
    if path in ("/v2", "/v2/"):
        return "metadata"
    if path == "/v2/models/stats":
        return "statistics"
    if path.startswith("/v2/health/"):
        return "health"
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if path.startswith("/v2/repository"):
        return "model-repository"
    if path.startswith("/v2/trace"):
        return "trace"
    if path.startswith("/v2/logging"):
        return "logging"
    match = _MODEL.fullmatch(path)
    if match is not None:
        return _MODEL_KINDS.get(match["kind"])
    return None


_V2_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_INFERENCE_SERVICE = r"/inference[.]GRPCInferenceService/"

HTTP_PATHS = {
    "health": rf"/v2/health/.*|{_V2_MODEL}/ready",
    "metadata": rf"/v2/?|{_V2_MODEL}",
    "inference": rf"{_V2_MODEL}/(?:infer|generate|generate_stream)",
    "model-config": rf"{_V2_MODEL}/config",
    "statistics": rf"/v2/models/stats|{_V2_MODEL}/stats",
    "model-repository": r"/v2/repository(?:/.*)?",
    "shared-memory": r"/v2/(?:system|cuda)sharedmemory(?:/.*)?",
    "trace": rf"/v2/trace(?:/.*)?|{_V2_MODEL}/trace/setting",
    "logging": r"/v2/logging(?:/.*)?",
}
"""Each group's REST paths as full-match regular expressions (RE2 and Python alike): what
Envoy's routes match to refuse them at the node's edge (`http_group` sorts a path alike;
`/v2/models/stats` matches `metadata` too, so Envoy tries `statistics` first)."""


def _methods(*names: str) -> str:
    return _INFERENCE_SERVICE + "(?:" + "|".join(names) + ")"


GRPC_PATHS = {
    "health": _methods("ServerLive", "ServerReady", "ModelReady") + r"|/grpc[.]health[.]v1[.]Health/.*",
    "metadata": _methods("ServerMetadata", "ModelMetadata"),
    "inference": _methods("ModelInfer", "ModelStreamInfer"),
    "model-config": _methods("ModelConfig"),
    "statistics": _methods("ModelStatistics"),
    "model-repository": _methods("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "shared-memory": _INFERENCE_SERVICE + r"(?:System|Cuda)SharedMemory.*",
    "trace": _methods("TraceSetting"),
    "logging": _methods("LogSettings"),
    "control": r"/hloserve_control[.]ControlService/.*|/hloserve_gateway[.]GatewayControlService/.*",
}
"""Each group's gRPC method paths, likewise (`grpc_group` sorts a path alike)."""


@dataclass(frozen=True, slots=True)
class Restriction:
    """One group's rule: the header a call must carry (`name` as configured, `header` in lower
    case as HTTP/2 sends it and as it is looked up), and its value."""

    name: str
    value: str

    @property
    def header(self) -> str:
        return self.name.lower()

    def allows(self, value: str | None) -> bool:
        return value == self.value


class Restrictions:
    """The restrictions of one protocol (gRPC or REST), by group."""

    def __init__(self, rules: Mapping[str, Restriction]) -> None:
        self.rules = dict(rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    @classmethod
    def parse(cls, specs: Iterable[str], *, field: str, header_prefix: str = "") -> Restrictions:
        """Read `<group>,...:<key>=<value>` specs; raises `ConfigError` naming `field`."""
        rules: dict[str, Restriction] = {}
        for spec in specs:
            match = _SPEC.fullmatch(spec.strip())
            if match is None:
                raise ConfigError(
                    field,
                    f"got {spec[:200]!r}; expected <group>,<group>,...:<key>=<value> "
                    f"(groups: {', '.join(GROUPS)}; key a header name)",
                )
            rule = Restriction(header_prefix + match["key"], match["value"])
            for group in match["groups"].split(","):
                if group not in GROUPS:
                    raise ConfigError(field, f"unknown group {group!r}; expected one of {', '.join(GROUPS)}")
                if group in rules:
                    raise ConfigError(field, f"group {group!r} is in more than one restriction")
                rules[group] = rule
        return cls(rules)

    @classmethod
    def grpc(cls, specs: Iterable[str]) -> Restrictions:
        """`server.grpc_restricted_protocol`: headers `triton-grpc-protocol-<key>`."""
        return cls.parse(specs, field="server.grpc_restricted_protocol", header_prefix=GRPC_HEADER_PREFIX)

    @classmethod
    def http(cls, specs: Iterable[str]) -> Restrictions:
        """`server.http_restricted_api`: headers `<key>`."""
        return cls.parse(specs, field="server.http_restricted_api")

    def refusal(self, group: str | None, headers: Mapping[str, Any]) -> Restriction | None:
        """The rule a call of `group` with `headers` (lower-case names) breaks, if any."""
        rule = None if group is None else self.rules.get(group)
        if rule is None:
            return None
        value = headers.get(rule.header)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        return None if rule.allows(value) else rule

    def headers(self) -> list[tuple[str, str]]:
        """Every header these restrictions ask for, once each: what a trusted caller (the node's
        controller calling its workers) sends to pass all of them."""
        return sorted({(r.header, r.value) for r in self.rules.values()})


def grpc_message(rule: Restriction) -> str:
    """Triton's words for a refused gRPC call."""
    return f"This protocol is restricted, expecting header '{rule.name}'"


def http_message(rule: Restriction) -> str:
    """Triton's words for a refused REST call."""
    return f"This API is restricted, expecting header '{rule.name}'"


def restrict_grpc(server: Any, restrictions: Restrictions) -> None:
    """Refuse `server`'s calls that break `restrictions`, before their message is read."""
    if not restrictions:
        return

    async def check(event: RecvRequest) -> None:
        rule = restrictions.refusal(grpc_group(event.method_name), event.metadata)
        if rule is not None:
            raise GRPCError(Status.UNAVAILABLE, grpc_message(rule))

    listen(server, RecvRequest, check)
