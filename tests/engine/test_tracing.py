"""OpenTelemetry traces: a worker exports its spans over OTLP/gRPC to a real trace service the
test runs on loopback; each request's span tree is read back from what it received.

The client's W3C `traceparent` (gRPC metadata, HTTP header) is the root's parent, at K=0 and
with two frontend processes, whose spans and the engine's join one trace across the link.
Needs the `otel` extra (the tests fail without it, as every extra's tests do).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.trace.v1 import trace_pb2
from support.bundles import WEIGHT_BYTES, X, write_affine
from support.clients import infer, wait_until
from support.otlp import Receiver, attributes, new_traceparent
from support.servers import EXAMPLES, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import ConfigError, TracingConfig
from hloserve.engine.tracing import open_tracing, settings
from hloserve.fleet import envoy
from hloserve.fleet.workers import free_port

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    # Export within 50 ms of a span's end (the SDK's default waits 5 s); frontends inherit it.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    service = Receiver()
    yield service
    service.stop()


def _assert_children_of(parent: trace_pb2.Span, spans: dict[str, trace_pb2.Span], names: list[str]) -> None:
    """Each of `names` is a child of `parent`, inside its time, and they follow in that order."""
    last_end = 0
    for name in names:
        span = spans[name]
        assert span.parent_span_id == parent.span_id, name
        assert parent.start_time_unix_nano <= span.start_time_unix_nano, name
        assert span.start_time_unix_nano <= span.end_time_unix_nano <= parent.end_time_unix_nano, name
        assert span.start_time_unix_nano >= last_end, f"{name} began before the phase before it ended"
        last_end = span.end_time_unix_nano


def _tracing_config(repository: Path, endpoint: str, **server: Any) -> Any:
    config = make_config(repository, **server)
    return config.replace("tracing", exporter="otlp", endpoint=endpoint)


def test_grpc_traceparent_parents_the_request_span_tree(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Configured by the standard variables alone; a budget of one model makes `b` load.
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "hloserve-under-test")
    for name in "ab":
        write_affine(tmp_path / name)
    config = make_config(tmp_path).replace("weights", budget_bytes=WEIGHT_BYTES + 10)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        infer(client, "a", {"INPUT": X})  # resident now; `b` must evict it
        traceparent, trace_id, client_span = new_traceparent()
        infer(client, "b", {"INPUT": X}, headers={"traceparent": traceparent})
        phases = ["decode", "admission", "queue", "weight_load", "execute", "encode", "reply"]
        spans = receiver.trace(trace_id, {"ModelInfer", *phases})
        client.close()
    root = spans["ModelInfer"]
    assert root.parent_span_id == client_span
    assert root.kind == SERVER
    assert attributes(root) == {"hloserve.model": "b", "rpc.grpc.status": "OK"}
    # the queue wait holds the load (the dispatcher took the batch, then waited for weights)
    _assert_children_of(root, spans, ["decode", "admission", "queue", "execute", "encode", "reply"])
    _assert_children_of(root, spans, ["queue", "weight_load", "execute"])
    assert attributes(spans["weight_load"]) == {
        "hloserve.weights.bytes": WEIGHT_BYTES,
        "hloserve.weights.overlapped": False,
    }
    rows = X.shape[0]
    assert attributes(spans["execute"]) == {
        "hloserve.batch_size": rows,
        "hloserve.batch_rows": rows,
        "hloserve.rows": rows,
        "hloserve.padding_rows": 0,
    }
    assert {s.kind for s in spans.values() if s is not root} == {INTERNAL}
    assert {service for service, s in receiver.spans if s.trace_id == trace_id} == {"hloserve-under-test"}


def test_rest_traceparent_parents_a_hooked_request(tmp_path: Path, receiver: Receiver) -> None:
    shutil.copytree(EXAMPLES / "severity_grader", tmp_path / "severity_grader")
    with start_worker(_tracing_config(tmp_path, receiver.endpoint)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        image = httpclient.InferInput("INPUT__0", [1, 224, 224], "UINT8")
        image.set_data_from_numpy(np.zeros((1, 224, 224), np.uint8))
        traceparent, trace_id, client_span = new_traceparent()
        result = client.infer("severity_grader", [image], headers={"traceparent": traceparent})
        assert result.as_numpy("grade").shape == (1, 1)
        phases = ["decode", "admission", "queue", "execute", "postprocess", "encode", "reply"]
        spans = receiver.trace(trace_id, {"ModelInfer", *phases})
        client.close()
    root = spans["ModelInfer"]
    assert root.parent_span_id == client_span and root.kind == SERVER
    _assert_children_of(root, spans, phases)


def test_a_split_request_has_one_execute_span_per_execution(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")  # compiled at 1 and 2 rows: 5 rows run as 2 + 2 + 1
    with start_worker(_tracing_config(tmp_path, receiver.endpoint)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        traceparent, trace_id, _ = new_traceparent()
        rows = np.arange(20, dtype=np.float32).reshape(5, 4)
        infer(client, "a", {"INPUT": rows}, headers={"traceparent": traceparent})
        receiver.trace(trace_id, {"ModelInfer", "execute", "reply"})
        client.close()
    executions = sorted(
        (s.start_time_unix_nano, attributes(s)["hloserve.batch_rows"])
        for _, s in receiver.spans
        if s.trace_id == trace_id and s.name == "execute"
    )
    assert [batch_rows for _, batch_rows in executions] == [2, 2, 1]
    assert all(attributes(s)["hloserve.rows"] == 5 for _, s in receiver.spans if s.name == "execute")


def test_a_request_without_traceparent_is_a_root(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")
    with start_worker(_tracing_config(tmp_path, receiver.endpoint)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        infer(client, "a", {"INPUT": X})
        client.close()
        deadline = time.monotonic() + 30
        while not any(s.name == "ModelInfer" for _, s in receiver.spans) and time.monotonic() < deadline:
            time.sleep(0.05)
    roots = [s for _, s in receiver.spans if s.name == "ModelInfer"]
    assert len(roots) == 1 and roots[0].parent_span_id == b""


def test_an_unknown_model_ends_its_span_with_the_status(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")
    with start_worker(_tracing_config(tmp_path, receiver.endpoint)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        traceparent, trace_id, _ = new_traceparent()
        with pytest.raises(Exception, match="nope"):
            infer(client, "nope", {"INPUT": X}, headers={"traceparent": traceparent})
        assert infer(client, "a", {"INPUT": X}).as_numpy("OUTPUT").shape == (X.shape[0], 3)
        root = receiver.trace(trace_id, {"ModelInfer"})["ModelInfer"]
        client.close()
    assert attributes(root) == {"hloserve.model": "<unknown>", "rpc.grpc.status": "NOT_FOUND"}
    assert root.status.code == trace_pb2.Status.STATUS_CODE_ERROR


@pytest.mark.slow
def test_frontends_and_the_engine_join_one_trace(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")
    config = _tracing_config(tmp_path, receiver.endpoint, frontends=2)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        traceparent, trace_id, client_span = new_traceparent()
        infer(client, "a", {"INPUT": X}, headers={"traceparent": traceparent})
        frontend = ["decode", "admission", "link", "encode", "reply"]
        spans = receiver.trace(trace_id, {"ModelInfer", "engine", "queue", "execute", *frontend})
        client.close()
    root = spans["ModelInfer"]
    assert root.parent_span_id == client_span and root.kind == SERVER
    _assert_children_of(root, spans, frontend)
    link, engine = spans["link"], spans["engine"]
    assert link.kind == CLIENT
    assert engine.parent_span_id == link.span_id and engine.kind == SERVER
    assert attributes(engine) == {"hloserve.model": "a", "rpc.grpc.status": "OK"}
    _assert_children_of(engine, spans, ["queue", "execute"])
    # the engine's clock and the frontend's are one machine's: the engine's span is in the link's
    assert link.start_time_unix_nano <= engine.start_time_unix_nano
    assert engine.end_time_unix_nano <= link.end_time_unix_nano


@pytest.mark.slow
def test_rest_through_a_frontend_joins_the_engines_trace(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")
    with start_worker(_tracing_config(tmp_path, receiver.endpoint, frontends=2)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        tensor = httpclient.InferInput("INPUT", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)
        traceparent, trace_id, client_span = new_traceparent()
        client.infer("a", [tensor], headers={"traceparent": traceparent})
        spans = receiver.trace(trace_id, {"ModelInfer", "link", "engine", "queue", "execute", "reply"})
        client.close()
    assert spans["ModelInfer"].parent_span_id == client_span
    assert spans["link"].parent_span_id == spans["ModelInfer"].span_id
    assert spans["engine"].parent_span_id == spans["link"].span_id
    assert spans["execute"].parent_span_id == spans["engine"].span_id


@pytest.mark.parametrize("frontends", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_request_the_sampler_leaves_out_exports_no_span(
    tmp_path: Path, receiver: Receiver, frontends: int
) -> None:
    """At ratio 0 a request without a traceparent is answered and exports nothing, in the
    frontend or the engine; a client's sampled traceparent still gets its whole tree (the
    parent decides)."""
    write_affine(tmp_path / "a")
    config = _tracing_config(tmp_path, receiver.endpoint, frontends=frontends).replace(
        "tracing", sampler="parentbased_traceidratio", sampler_arg="0"
    )
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for _ in range(3):
            assert infer(client, "a", {"INPUT": X}).as_numpy("OUTPUT").shape == (X.shape[0], 3)
        traceparent, trace_id, _ = new_traceparent()
        infer(client, "a", {"INPUT": X}, headers={"traceparent": traceparent})
        receiver.trace(trace_id, {"ModelInfer", "queue", "execute", "reply"})
        client.close()
    assert {s.trace_id for _, s in receiver.spans} == {trace_id}


def test_an_unsampled_request_records_no_phase(receiver: Receiver) -> None:
    """Left out by the sampler, a request's phases make no span and the dispatcher fills no
    record for it; a sampled one's do."""
    for sampler, recorded in (("always_off", False), ("always_on", True)):
        tracing = open_tracing(TracingConfig(exporter="otlp", endpoint=receiver.endpoint, sampler=sampler))
        assert tracing is not None
        spans = tracing.request("ModelInfer", "a", None, time.monotonic_ns())
        spans.mark("decode")
        spans.end()
        assert (spans.engine is not None) == recorded
        assert (tracing.engine_request("a", "").engine is not None) == recorded
        tracing.shutdown()
    assert sorted(s.name for _, s in receiver.spans) == ["ModelInfer", "decode"]


def test_trace_settings_answer_hloserves_over_grpc_and_rest(tmp_path: Path, receiver: Receiver) -> None:
    write_affine(tmp_path / "a")
    config = _tracing_config(tmp_path, receiver.endpoint).replace(
        "tracing", sampler="parentbased_traceidratio", sampler_arg="0.01"
    )
    with start_worker(config) as server:
        grpc_client = grpcclient.InferenceServerClient(server.url)
        http_client = httpclient.InferenceServerClient(server.http_url)
        answered = grpc_client.get_trace_settings(as_json=True)["settings"]
        assert {k: v["value"] for k, v in answered.items()} == {
            "trace_mode": ["opentelemetry"],
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": ["100"],
            "trace_count": ["-1"],
            "log_frequency": ["0"],
            "trace_file": [""],
            "url": [receiver.endpoint],
            "sampler": ["parentbased_traceidratio"],
            "sampler_arg": ["0.01"],
            "service_name": ["hloserve"],
        }
        for model in ("", "a"):
            rest = http_client.get_trace_settings(model_name=model)
            assert rest["trace_level"] == ["TIMESTAMPS"] and rest["trace_rate"] == "100", rest
            assert rest["url"] == receiver.endpoint
        assert grpc_client.get_trace_settings(model_name="a", as_json=True) == {"settings": answered}
        with pytest.raises(InferenceServerException, match="nope"):
            grpc_client.get_trace_settings(model_name="nope")
        with pytest.raises(InferenceServerException, match="changing trace settings while serving"):
            grpc_client.update_trace_settings(settings={"trace_rate": "1"})
        with pytest.raises(InferenceServerException, match="changing trace settings while serving"):
            http_client.update_trace_settings(model_name="a", settings={"trace_rate": "1"})
        grpc_client.close()
        http_client.close()


def test_trace_settings_say_off_when_tracing_is_off(tmp_path: Path) -> None:
    write_affine(tmp_path / "a")
    with start_worker(make_config(tmp_path)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        answered = client.get_trace_settings()
        client.close()
    assert answered["trace_level"] == ["OFF"] and answered["trace_mode"] == "opentelemetry"
    assert answered["url"] == ""


def test_envoy_accepts_its_tracing(tmp_path: Path) -> None:
    envoy.write_atomically(tmp_path / "routing.pb", envoy.descriptor_set())
    envoy.write_atomically(tmp_path / "routes.json", envoy.routes({}))
    envoy.write_atomically(tmp_path / "routes_http.json", envoy.http_routes({}))
    clusters = envoy.clusters({}, "127.0.0.1:9", "LEAST_REQUEST", 1 << 30, controller_http="127.0.0.1:10")
    envoy.write_atomically(tmp_path / "clusters.json", clusters)
    chosen = settings(
        TracingConfig(exporter="otlp", endpoint="http://127.0.0.1:4317", sampler="traceidratio"),
        {"OTEL_TRACES_SAMPLER_ARG": "0.5"},
    )
    bootstrap = envoy.bootstrap(tmp_path, "127.0.0.1", 0, 0, 0, 1 << 30, traces=chosen)
    managers = [
        listener["filter_chains"][0]["filters"][0]["typed_config"]
        for listener in bootstrap["static_resources"]["listeners"]
    ]
    assert [m["tracing"]["random_sampling"]["value"] for m in managers] == [50.0, 50.0]
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap))
    checked = subprocess.run(
        [envoy.find_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "clusters" not in envoy.bootstrap(tmp_path, "127.0.0.1", 0, 0, 0, 1 << 30)["static_resources"]


@pytest.mark.slow
@pytest.mark.serial  # Envoy and two workers
def test_envoy_and_the_worker_join_the_clients_trace_through_the_node(
    tmp_path: Path, receiver: Receiver
) -> None:
    write_affine(tmp_path / "a")
    grpc_port, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.3",
    }
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--", sys.executable, "-m", "hloserve.cli", "node",
             "--cpu-workers", "2", "--grpc-port", str(grpc_port), "--http-port", "-1",
             "--metrics-port", str(metrics_port), "--model-repository", str(tmp_path)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")

        def ready() -> bool:
            try:
                return process.poll() is not None or client.is_model_ready("a")
            except InferenceServerException:
                return False

        wait_until(ready, 120, "the node")
        assert process.poll() is None, log.read_text()[-4000:]
        traceparent, trace_id, client_span = new_traceparent()
        infer(client, "a", {"INPUT": X}, headers={"traceparent": traceparent})
        client.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with receiver._lock:
                found = [(service, s) for service, s in receiver.spans if s.trace_id == trace_id]
            services = {service for service, _ in found}
            if {"hloserve", "hloserve-envoy"} <= services and any(s.name == "reply" for _, s in found):
                break
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(30)
    (proxy,) = [s for service, s in found if service == "hloserve-envoy"]
    (root,) = [s for service, s in found if service == "hloserve" and s.name == "ModelInfer"]
    assert proxy.parent_span_id == client_span
    assert root.parent_span_id == proxy.span_id


def test_off_by_default_without_importing_the_sdk() -> None:
    code = (
        "import sys, hloserve.worker, hloserve.frontends.frontend\n"
        "from hloserve.config import TracingConfig\n"
        "from hloserve.engine.tracing import open_tracing\n"
        "assert open_tracing(TracingConfig(), {}) is None\n"
        "assert open_tracing(TracingConfig(), {'OTEL_TRACES_EXPORTER': 'none'}) is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_config_fields_win_over_the_otel_variables() -> None:
    environ = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert settings(TracingConfig(), environ) == {
        "exporter": "otlp",
        "endpoint": "http://collector:4317",
        "sampler": "traceidratio",
        "sampler_arg": "0.25",
        "service_name": "hloserve",
    }
    chosen = TracingConfig(exporter="none", endpoint="http://other:4317", sampler="always_off")
    assert settings(chosen, environ) | {"sampler_arg": "x"} == {
        "exporter": "none",
        "endpoint": "http://other:4317",
        "sampler": "always_off",
        "sampler_arg": "x",
        "service_name": "hloserve",
    }
    assert settings(TracingConfig(), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1"})["endpoint"] == (
        "http://t:1"
    )
    assert open_tracing(chosen, environ) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("exporter", "jaeger", r"^config tracing\.exporter: expected otlp or none$"),
        ("sampler", "sometimes", r"^config tracing\.sampler: expected one of always_on, .*$"),
        ("sampler_arg", "2", r"^config tracing\.sampler_arg: expected a ratio from 0 to 1$"),
    ],
)
def test_bad_tracing_settings_are_refused(field: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TracingConfig(**{field: value}).validate()
