"""The controller's pure parts: Envoy's configuration, readiness of a partly ready node, merged
metrics and statistics."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import grpclib
import grpclib.client
import pytest
import trio
import trio_asyncio
from google.protobuf import descriptor_pb2
from grpclib.const import Status
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hloserve._proto import hloserve_gateway as gateway
from hloserve._proto import inference as kserve
from hloserve._proto.grpc.health.v1 import HealthCheckRequest, HealthStub
from hloserve._proto.grpc.health.v1 import HealthCheckResponseServingStatus as Serving
from hloserve._proto.hot import hot_status_pb2 as hot
from hloserve._transport.grpclib_patches import BigFrameChannel
from hloserve.api.grpc_server import build_grpc_server
from hloserve.api.health import Health
from hloserve.config import NodeConfig, ServerConfig
from hloserve.errors import ConfigError
from hloserve.fleet import envoy
from hloserve.fleet.controller import Controller, WorkerLink, with_parts
from hloserve.fleet.http import merge_expositions
from hloserve.fleet.services import (
    GatewayFront,
    NodeRepositoryPlane,
    merge_control_status,
    merge_statistics,
    node_readiness,
)


def test_the_descriptor_set_names_each_routed_rpc_and_its_model_field() -> None:
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(envoy.descriptor_set()).file
    assert file.package == "inference" and file.service[0].name == "GRPCInferenceService"
    messages = {m.name: m for m in file.message_type}
    for method in file.service[0].method:
        request = messages[method.input_type.rsplit(".", 1)[1]]
        (field,) = request.field
        assert (field.name, field.number) == (envoy.ROUTED_RPCS[method.name], 1)
    assert {m.name for m in file.service[0].method} == {
        "ModelInfer",
        "ModelMetadata",
        "ModelReady",
        "ModelConfig",
    }


def _routes_for(config: dict[str, Any], key: str, prefix: bool = False) -> list[dict[str, Any]]:
    """The routes Envoy's matcher gives the value `key` of its input: the exact entry, or the
    longest prefix of `key` in the map (`prefix`), or the routes for no entry."""
    host = config["virtual_hosts"][0]
    if "matcher" not in host:  # no model routed: the routes of no entry alone
        return list(host["routes"])
    tree = host["matcher"]
    entries = tree["matcher_tree"]["prefix_match_map" if prefix else "exact_match_map"]["map"]
    found = max((k for k in entries if key.startswith(k)), key=len, default=None) if prefix else key
    chosen = entries.get(found) if found is not None else None
    routes: list[dict[str, Any]] = (chosen or tree["on_no_match"])["action"]["typed_config"]["routes"]
    return routes


def _route(routes: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """The first of `routes` that matches `path` (their regular expressions read by Python's
    `re`, which agrees with RE2 on these)."""
    for route in routes:
        match = route["match"]
        if (
            match.get("path") == path
            or ("safe_regex" in match and re.fullmatch(match["safe_regex"]["regex"], path))
            or path.startswith(match.get("prefix", "\0"))
        ):
            return route
    raise AssertionError(f"no route for {path}")


INFER = "/inference.GRPCInferenceService/ModelInfer"


def test_routes_look_the_model_header_up_and_fall_back_to_the_controller() -> None:
    mlp = [envoy.Endpoint("127.0.0.1:1"), envoy.Endpoint("127.0.0.1:2")]
    (config,) = envoy.routes({"mlp": mlp, "cnn": mlp, "gone": []})["resources"]
    entries = config["virtual_hosts"][0]["matcher"]["matcher_tree"]["exact_match_map"]["map"]
    assert set(entries) == {"mlp", "cnn"}  # a model no worker serves has no entry
    route = _route(_routes_for(config, "mlp"), INFER)
    assert (
        route["route"]["cluster"]
        == envoy.pool_name(mlp)
        == _route(_routes_for(config, "cnn"), INFER)["route"]["cluster"]
    )
    assert "unavailable" in route["route"]["retry_policy"]["retry_on"]
    for model, path in (
        ("mlp", "/inference.GRPCInferenceService/ModelStatistics"),  # summed over the workers
        ("gone", INFER),
        ("", "/inference.GRPCInferenceService/RepositoryIndex"),
    ):
        assert _route(_routes_for(config, model), path)["route"]["cluster"] == "controller", (model, path)
    (empty,) = envoy.routes({"gone": []})["resources"]  # Envoy refuses an empty map
    assert "matcher" not in empty["virtual_hosts"][0]
    assert _route(_routes_for(empty, "gone"), INFER)["route"]["cluster"] == "controller"
    clusters = envoy.clusters([mlp, mlp], "127.0.0.1:9", "LEAST_REQUEST", 1 << 30)
    assert [c["name"] for c in clusters["resources"]] == ["controller", envoy.pool_name(mlp)]
    pool = clusters["resources"][1]
    assert pool["lb_policy"] == "LEAST_REQUEST"
    assert len(pool["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    window = pool["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert window["explicit_http_config"]["http2_protocol_options"]["initial_stream_window_size"] > 1 << 30


def test_models_on_the_same_workers_share_a_pool_and_other_workers_or_weights_make_another() -> None:
    """Envoy holds a cluster per set of workers (and weights), not per model: 10,000 models on
    the same workers are two clusters (gRPC and REST), and their routes are one map lookup."""
    a, b = envoy.Endpoint("127.0.0.1:1", "127.0.0.1:5"), envoy.Endpoint("127.0.0.1:2", "127.0.0.1:6")
    lighter = envoy.Endpoint("127.0.0.1:1", "127.0.0.1:5", weight=40)
    placement = {f"v{i}": [a, b] for i in range(10_000)} | {"alone": [b], "busy": [lighter, b]}
    made = envoy.clusters(placement.values(), "127.0.0.1:9", "LEAST_REQUEST", 1 << 30, "127.0.0.1:10")
    names = {c["name"] for c in made["resources"]}
    pools = {envoy.pool_name(e) for e in ([a, b], [b], [lighter, b])}
    assert names == {
        "controller",
        "controller_http",
        *pools,
        *(envoy.pool_name(e, http=True) for e in ([a, b], [b], [lighter, b])),
    }
    assert len(pools) == 3
    (grpc,) = envoy.routes(placement)["resources"]
    (http,) = envoy.http_routes(placement)["resources"]
    for model, endpoints in (("v9999", [a, b]), ("alone", [b]), ("busy", [lighter, b])):
        assert _route(_routes_for(grpc, model), INFER)["route"]["cluster"] == envoy.pool_name(endpoints)
        path = f"/v2/models/{model}/infer"
        assert _route(_routes_for(http, path, prefix=True), path)["route"]["cluster"] == envoy.pool_name(
            endpoints, http=True
        )


def test_max_requests_per_worker_bounds_each_pool_not_the_controller() -> None:
    """`node.max_requests_per_worker` is the circuit breaker of a pool's clusters (gRPC and
    REST), times its workers, over every model the pool serves; 0 (the default) leaves them
    unbounded, and the controller always."""
    mlp = [envoy.Endpoint("127.0.0.1:1", "127.0.0.1:5"), envoy.Endpoint("127.0.0.1:2", "127.0.0.1:6")]

    def thresholds(per_worker: int) -> dict[str, dict[str, int]]:
        made = envoy.clusters([mlp], "127.0.0.1:9", "LEAST_REQUEST", 1 << 30, "127.0.0.1:10", per_worker)
        return {c["name"]: c["circuit_breakers"]["thresholds"][0] for c in made["resources"]}

    bounded = thresholds(8)
    for name in (envoy.pool_name(mlp), envoy.pool_name(mlp, http=True)):
        assert bounded[name]["max_requests"] == bounded[name]["max_pending_requests"] == 16
    assert bounded["controller"]["max_requests"] == 1 << 20
    assert {t["max_requests"] for t in thresholds(0).values()} == {1 << 20}


def test_a_worker_that_refuses_is_not_ejected() -> None:
    """Envoy counts gRPC UNAVAILABLE and DEADLINE_EXCEEDED as gateway failures (503, 504); an
    overloaded worker answers them, and ejecting it left "no healthy upstream" (issue 25); nor,
    while its streams reset or time out, is a model left with no worker (panic below half)."""
    mlp = [envoy.Endpoint("127.0.0.1:1", "127.0.0.1:5")]
    for cluster in envoy.clusters([mlp], "127.0.0.1:9", "LEAST_REQUEST", 1 << 30)["resources"]:
        outliers = cluster["outlier_detection"]
        assert outliers["enforcing_consecutive_gateway_failure"] == outliers["enforcing_consecutive_5xx"] == 0
        assert outliers["split_external_local_origin_errors"]  # resets and refused connections still eject
        assert outliers["enforcing_consecutive_local_origin_failure"] == 100
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 50


def _validate(bootstrap: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(bootstrap))
    checked = subprocess.run(
        [envoy.find_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_envoy_accepts_the_bootstrap_routes_and_clusters(tmp_path: Path) -> None:
    envoy.write_atomically(tmp_path / "routing.pb", envoy.descriptor_set())
    mlp = {
        "mlp": [
            envoy.Endpoint("127.0.0.1:1", "127.0.0.1:2", weight=40),
            envoy.Endpoint("127.0.0.1:3", "127.0.0.1:4"),
        ]
    }
    clusters = envoy.clusters(
        mlp.values(),
        "127.0.0.1:9",
        "LEAST_REQUEST",
        1 << 30,
        controller_http="127.0.0.1:10",
        max_requests_per_worker=8,
    )
    envoy.write_atomically(tmp_path / "routes.json", envoy.routes(mlp))
    envoy.write_atomically(tmp_path / "routes_http.json", envoy.http_routes(mlp))
    envoy.write_atomically(tmp_path / "clusters.json", clusters)
    bootstrap = envoy.bootstrap(tmp_path, "127.0.0.1", 0, 0, 0, 1 << 30, shed=True)
    filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert filters["typed_config"]["http_filters"][0]["name"] == "envoy.filters.http.admission_control"
    _validate(bootstrap, tmp_path / "envoy.json")
    # validation does not read the watched files: the same routes and clusters again, given inline
    del bootstrap["dynamic_resources"]
    bootstrap["static_resources"]["clusters"] = [
        {k: v for k, v in c.items() if k != "@type"} for c in clusters["resources"]
    ]
    managers = [
        listener["filter_chains"][0]["filters"][0]["typed_config"]
        for listener in bootstrap["static_resources"]["listeners"]
    ]
    names = [manager.pop("rds")["route_config_name"] for manager in managers]
    for routed in (mlp, {}):  # and with no model routed (Envoy refuses an empty map)
        made = {"routes": envoy.routes(routed), "routes_http": envoy.http_routes(routed)}
        for manager, name in zip(managers, names, strict=True):
            (config,) = made[name]["resources"]
            manager["route_config"] = {k: v for k, v in config.items() if k != "@type"}
        _validate(bootstrap, tmp_path / "inline.json")


def test_a_missing_envoy_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"node\.envoy"):
        envoy.find_envoy(str(tmp_path / "envoy"))


def _controller(*workers: WorkerLink) -> Controller:
    return Controller(NodeConfig(), workers, lambda routes: None)


def test_a_node_is_ready_only_while_every_model_has_a_ready_replica() -> None:
    w0 = WorkerLink("worker0", "127.0.0.1:1", None, True, {"a": "READY", "b": "READY"})
    w1 = WorkerLink("worker1", "127.0.0.1:2", None, True, {"a": "READY", "c": "UNAVAILABLE"})
    controller = _controller(w0, w1)
    controller.known = {"a", "b", "c"}
    assert node_readiness(controller) == (True, [])  # c never loaded anywhere: not required
    w0.ready = False  # b was only on worker0
    assert node_readiness(controller) == (False, ["b"])
    w1.ready = False
    assert node_readiness(controller) == (False, ["a", "b"])


def test_metrics_of_every_worker_merge_into_one_family_each() -> None:
    text = (
        "# HELP hloserve_requests_served_total Requests\n# TYPE hloserve_requests_served_total counter\n"
        'hloserve_requests_served_total{model="mlp"} 3.0\n'
    )
    merged = merge_expositions({"worker1": text, "worker0": text.replace("3.0", "5.0")})
    (family,) = text_string_to_metric_families(merged)
    assert merged.count("# TYPE hloserve_requests_served_total counter") == 1
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"model": "mlp", "worker": "worker0"}, 5.0),
        ({"model": "mlp", "worker": "worker1"}, 3.0),
    ]


def test_merged_expositions_read_back_as_each_workers_samples_with_its_label() -> None:
    """The merge works on the text (parsing two workers' 10,000-model expositions took 3.4 s):
    read back, it is every worker's families, each once, with every sample labelled."""
    registries = {}
    for worker, scale in (("worker0", 1.0), ("worker1", 2.0), ('odd "one"', 3.0)):
        registry = CollectorRegistry()
        served = Counter("served", "Requests", ["model"], registry=registry)
        latency = Histogram("latency_seconds", "Latency", buckets=(0.1, 1.0), registry=registry)
        Gauge("up", "Up", registry=registry).set(scale)
        for i in range(3):
            served.labels(f"m{i}").inc(scale * i)
        latency.observe(0.5 * scale)
        if worker == "worker1":
            Gauge("only_here", "On one worker", ["model"], registry=registry).labels("x").set(7)
        registries[worker] = generate_latest(registry).decode()
    merged = merge_expositions(registries)
    read = {f.name: f for f in text_string_to_metric_families(merged)}
    expected: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for worker, text in sorted(registries.items()):
        for family in text_string_to_metric_families(text):
            expected.setdefault(family.name, []).extend(
                (s.name, {**s.labels, "worker": worker}, s.value) for s in family.samples
            )
    assert set(read) == set(expected)
    assert {"served", "served_created", "latency_seconds", "up", "only_here"} <= set(read)
    for name, family in read.items():
        assert [(s.name, s.labels, s.value) for s in family.samples] == expected[name], name
    assert merged.count("# TYPE served_total counter") == 1


def test_statistics_are_summed_over_workers() -> None:
    def answer(count: int, last: int) -> kserve.ModelStatisticsResponse:
        duration = kserve.StatisticDuration(count=count, ns=10 * count)
        return kserve.ModelStatisticsResponse(
            model_stats=[
                kserve.ModelStatistics(
                    name="mlp", version="1", last_inference=last, inference_count=count, execution_count=1,
                    inference_stats=kserve.InferStatistics(success=duration, queue=duration),
                    batch_stats=[kserve.InferBatchStatistics(batch_size=4, compute_infer=duration)],
                )
            ]
        )  # fmt: skip

    (merged,) = merge_statistics([answer(2, 7), answer(3, 5)]).model_stats
    assert (merged.inference_count, merged.execution_count, merged.last_inference) == (5, 2, 7)
    assert merged.inference_stats is not None and merged.inference_stats.success is not None
    assert (merged.inference_stats.success.count, merged.inference_stats.success.ns) == (5, 50)
    (batch,) = merged.batch_stats
    assert batch.compute_infer is not None and batch.compute_infer.count == 5


def _front(mode: str = "lpt_packing") -> GatewayFront:
    worker = WorkerLink("worker0", "127.0.0.1:1", None, True, {"mlp": "READY"})
    controller = Controller(NodeConfig(scheduling=mode), [worker], lambda routes: None)
    controller.known = {"mlp"}
    return GatewayFront(controller)


def _status_of(call: Any) -> Status:
    with pytest.raises(grpclib.GRPCError) as caught:
        asyncio.run(call)
    return caught.value.status


def test_the_scheduling_policy_changes_all_or_nothing() -> None:
    front = _front()
    policy = gateway.SchedulingPolicy(hysteresis=0.25, compaction_mode="scheduled")
    answer = asyncio.run(
        front.set_scheduling_policy(
            gateway.SetSchedulingPolicyRequest(["hysteresis", "compaction_mode"], policy)
        )
    )
    assert answer.applied is not None
    assert (answer.applied.hysteresis, answer.applied.compaction_mode, answer.applied.generation) == (
        0.25,
        "scheduled",
        1,
    )
    for mask, bad in (
        (["hysteresis", "mode"], policy),
        (["hysteresis"], gateway.SchedulingPolicy(hysteresis=1.5)),
    ):
        assert _status_of(front.set_scheduling_policy(gateway.SetSchedulingPolicyRequest(mask, bad))) == (
            Status.INVALID_ARGUMENT
        )
    assert _status_of(front.set_scheduling_policy(gateway.SetSchedulingPolicyRequest([], policy))) == (
        Status.INVALID_ARGUMENT
    )
    status = asyncio.run(front.get_scheduling_status(gateway.GetSchedulingStatusRequest()))
    assert status.policy is not None and status.policy.hysteresis == 0.25 and status.policy.generation == 1


def test_replicas_and_repacks_are_checked() -> None:
    front = _front()
    answer = asyncio.run(front.set_model_replicas(gateway.SetModelReplicasRequest("mlp", -1)))
    assert answer.effective_replicas == 1  # all of one worker
    assert (
        _status_of(front.set_model_replicas(gateway.SetModelReplicasRequest("nosuch", 2))) == Status.NOT_FOUND
    )
    allowed = gateway.SetModelReplicasRequest("later", 2, allow_unknown_model=True)
    assert asyncio.run(front.set_model_replicas(allowed)).effective_replicas == 1
    assert _status_of(front.set_model_replicas(gateway.SetModelReplicasRequest("mlp", -2))) == (
        Status.INVALID_ARGUMENT
    )
    assert _status_of(front.repack(gateway.RepackRequest(wait_seconds=-1))) == Status.INVALID_ARGUMENT
    # without a running controller loop nothing repacks: the wait ends, not completed
    answer = asyncio.run(front.repack(gateway.RepackRequest(wait_seconds=0.05)))
    assert (answer.sequence, answer.completed) == (1, False)


def test_placement_knobs_need_lpt_packing() -> None:
    front = _front("round_robin")
    assert _status_of(front.repack(gateway.RepackRequest())) == Status.FAILED_PRECONDITION
    assert _status_of(front.set_model_replicas(gateway.SetModelReplicasRequest("mlp", 2))) == (
        Status.FAILED_PRECONDITION
    )
    status = asyncio.run(front.get_scheduling_status(gateway.GetSchedulingStatusRequest()))
    assert status.policy is not None and status.policy.mode == "round_robin"


def test_rest_is_routed_by_path_to_the_models_workers_and_the_rest_to_the_controller() -> None:
    endpoints = [envoy.Endpoint("127.0.0.1:1", "127.0.0.1:2")]
    (config,) = envoy.http_routes(
        {"mlp": endpoints, "my model": endpoints, "grpc_only": [envoy.Endpoint("x:1")]}
    )["resources"]

    def cluster(path: str) -> str:
        return str(_route(_routes_for(config, path, prefix=True), path)["route"]["cluster"])

    for path in (
        "/v2/models/mlp", "/v2/models/mlp/ready", "/v2/models/mlp/config", "/v2/models/mlp/infer",
        "/v2/models/mlp/versions/1/infer", "/v2/models/my%20model/infer", "/v2/models/my model/ready",
    ):  # fmt: skip
        assert cluster(path) == envoy.pool_name(endpoints, http=True), path
    for path in (
        "/v2/models/mlp/stats", "/v2/models/mlp/versions/1/stats", "/v2/models/stats",
        "/v2/models/mlpx/infer", "/v2/health/ready", "/v2", "/v2/repository/index",
        "/v2/repository/models/mlp/load", "/v2/systemsharedmemory/region/r/register",
        "/v2/models/grpc_only/infer",
    ):  # fmt: skip
        assert cluster(path) == "controller_http", path
    route = _route(_routes_for(config, "/v2/models/mlp/infer", prefix=True), "/v2/models/mlp/infer")
    retry = route["route"]["retry_policy"]
    assert retry["retriable_status_codes"] == [503] and "reset" in retry["retry_on"]


def test_a_meta_is_routed_only_to_workers_that_serve_its_parts_and_its_parts_go_where_it_is_placed() -> None:
    status = hot.ModelControlStatusResponse(
        models=[
            hot.ModelStatus(name="meta", meta=True, parts=["part"], ready_parts=["part"]),
            hot.ModelStatus(name="mlp"),
        ]
    )
    index = hot.RepositoryIndexResponse(
        models=[hot.RepositoryIndexResponse.ModelIndex(name=m, state="READY") for m in ("meta", "mlp")]
    )
    w0 = WorkerLink("worker0", "127.0.0.1:1", None, True)
    w1 = WorkerLink("worker1", "127.0.0.1:2", None, True)
    for worker in (w0, w1):
        worker.take(index, status)
    assert w0.models == {"meta": "READY", "mlp": "READY", "part": "READY"}
    assert w0.executables == {"mlp", "part"}
    assert with_parts({"meta": ("worker1",), "mlp": ("worker0",)}, [w0, w1]) == {
        "meta": ("worker1",), "mlp": ("worker0",), "part": ("worker1",),
    }  # fmt: skip
    published: list[Any] = []
    controller = Controller(NodeConfig(), [w0, w1], published.append)
    controller.known = {"meta", "mlp", "part"}
    controller._route()
    assert controller.routes["meta"] == ("127.0.0.1:1", "127.0.0.1:2")
    w1.models["part"] = "UNAVAILABLE"  # unloaded there: the meta cannot run on worker1
    controller._route()
    assert controller.routes["meta"] == ("127.0.0.1:1",) and controller.routes["part"] == ("127.0.0.1:1",)
    index_answer = asyncio.run(NodeRepositoryPlane(controller).index(kserve.RepositoryIndexRequest()))
    assert [m.name for m in index_answer.models] == ["meta", "mlp"]  # a part is listed through its meta


def test_control_status_is_merged_over_workers() -> None:
    def answer(compute: float, resident: bool, parts: list[str]) -> hot.ModelControlStatusResponse:
        return hot.ModelControlStatusResponse(
            residency_mode="self_managed", weight_cache_max_bytes=100, resident_bytes=10, compactions=1,
            models=[hot.ModelStatus(
                name="mlp", total_compute_seconds=compute, requests_served=2, device_resident=resident,
                weight_nbytes=10, parts=parts,
            )],
        )  # fmt: skip

    first = answer(1.5, False, ["b"])
    merged = merge_control_status([first, answer(0.5, True, ["a", "b"])])
    assert (merged.weight_cache_max_bytes, merged.resident_bytes, merged.compactions) == (200, 20, 2)
    (mlp,) = merged.models
    assert (mlp.total_compute_seconds, mlp.requests_served, mlp.device_resident, mlp.weight_nbytes) == (
        2.0, 4, True, 10,
    )  # fmt: skip
    assert list(mlp.parts) == ["a", "b"]
    assert first.models[0].total_compute_seconds == 1.5 and list(first.models[0].parts) == ["b"]  # a copy


def test_the_controller_s_channel_to_a_worker_bounds_what_it_remembers() -> None:
    """It lives as long as the node: a stock grpclib channel's closed-stream record grew ~12 MB
    an hour in the soak (`BigFrameChannel` keeps 1,024; tests/transport/test_patches.py)."""

    async def channel() -> object:
        link = WorkerLink("worker0", "127.0.0.1:1", None)
        made = link.channel
        made.close()
        return made

    assert isinstance(asyncio.run(channel()), BigFrameChannel)


def test_the_controller_s_server_bounds_what_each_of_envoy_s_connections_remembers() -> None:
    """Envoy's connections to the controller live as long as the node: a stock grpclib server
    remembers 65,536 closed streams on each, and grew the node by ~0.3 MB a minute in the soak;
    the controller's server is built as a worker's (`build_grpc_server`), within the server's
    limits (four times `max_concurrent_streams`)."""

    async def serving(name: str) -> bool | None:
        return True

    async def main() -> int:
        config = ServerConfig(max_concurrent_streams=7)
        server = build_grpc_server(config, [], lambda draining: Health(serving, draining, max_watches=1))
        await server.start("127.0.0.1", 0)
        channel = grpclib.client.Channel("127.0.0.1", server.port)
        try:
            stub = HealthStub(channel)
            for _ in range(100):
                assert (await stub.check(HealthCheckRequest())).status == Serving.SERVING
            (protocol,) = server._protocols
            return len(protocol.connection._connection._closed_streams)
        finally:
            channel.close()
            server.close()
            await server.wait_closed()

    async def on_trio_asyncio() -> int:  # as the node runs it
        async with trio_asyncio.open_loop():
            remembered: int = await trio_asyncio.aio_as_trio(main)()
            return remembered

    assert trio.run(on_trio_asyncio) == 4 * 7


def test_the_merged_status_lists_every_worker_s_models_once_in_name_order() -> None:
    def answer(*names: str) -> hot.ModelControlStatusResponse:
        return hot.ModelControlStatusResponse(models=[hot.ModelStatus(name=n, loads=1) for n in names])

    first = answer("mlp", "b")
    merged = merge_control_status([first, answer("zeta", "mlp", "a"), answer("b")])
    assert [(m.name, m.loads) for m in merged.models] == [("a", 1), ("b", 2), ("mlp", 2), ("zeta", 1)]
    assert [m.name for m in first.models] == ["mlp", "b"]  # the answers are not changed
    assert merge_control_status([]) == hot.ModelControlStatusResponse()


def test_least_outstanding_weighs_each_worker_by_the_compute_other_models_keep_it_busy_with() -> None:
    from hloserve.fleet.balance import Traffic

    w0 = WorkerLink(
        "worker0", "127.0.0.1:1", None, True, {"mlp": "READY", "cnn": "READY"}, http="127.0.0.1:3"
    )
    w1 = WorkerLink("worker1", "127.0.0.1:2", None, True, {"mlp": "READY"}, http="127.0.0.1:4")
    for mode, expected in (("least_outstanding", (40, 100)), ("round_robin", (100, 100))):
        published: list[Any] = []
        controller = Controller(NodeConfig(scheduling=mode), [w0, w1], published.append)
        controller.known = {"mlp", "cnn"}
        # cnn keeps worker0 60% busy (30 requests/s of 20 ms); mlp's own load is Envoy's to count
        controller.traffic = {
            "cnn": Traffic(0.02, {"worker0": 30.0}),
            "mlp": Traffic(0.001, {"worker0": 100.0}),
        }
        controller._route()
        (routes,) = published
        assert tuple(e.weight for e in routes["mlp"]) == expected, mode
        assert [e.http for e in routes["mlp"]] == ["127.0.0.1:3", "127.0.0.1:4"]
