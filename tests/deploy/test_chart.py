"""The Helm chart (deploy/helm/hloserve), rendered for each mode with no cluster: it lints,
every object it renders passes Kubernetes 1.32's schemas strictly (a ServiceMonitor, the
Prometheus Operator's CRD schema), the pods are what each mode
promises (GPUs, command, ports, gRPC probes, security, repository source), the configuration
and the environment it hands hloserve are ones hloserve accepts, and bad values fail rendering
with a message naming the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python.chart import lint
from helm_python.errors import HelmRenderError, HelmValuesError

from hloserve.cli import SERVER_FLAGS
from hloserve.config import TracingConfig, load_config
from hloserve.engine.tracing import settings

from .support import CHART, KUBERNETES, crd_validator, named, of_kind, render, validate_kubernetes

PVC = {"pvc": {"claimName": "hloserve-models"}}
PVC_ONLY = {"modelRepository": PVC}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "worker-cpu": {"modelRepository": PVC, "config": {"scheduler": {"discipline": "fifo"}}},
    "worker-gpu": {
        "gpus": 1,
        "replicas": 2,
        "modelRepository": {"hostPath": {"path": "/srv/hloserve/models"}},
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "sharedMemorySize": "1Gi",
    },
    "node-4-gpus": {
        "mode": "node",
        "gpus": 4,
        "modelRepository": {
            "initContainer": {
                "image": "amazon/aws-cli:2.17.0",
                "args": ["s3", "sync", "s3://my-bucket/repository", "/mnt/models"],
            },
            "sizeLimit": "20Gi",
        },
        "http": {"enabled": True},
    },
    "fleet": {
        "mode": "fleet",
        "gpus": 1,
        "replicas": 4,
        "modelRepository": {"pvc": {"claimName": "hloserve-models", "subPath": "repository"}},
        "fleet": {"router": {"replicas": 2, "resources": {"requests": {"cpu": "2"}}}},
        "http": {"enabled": False},
    },
}


def _pod(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def _selects(service: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


@pytest.fixture(scope="module", name="rendered")
def _rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_lints_strictly(name: str) -> None:
    report = lint(CHART, VALUE_SETS[name], strict=True, kube_version=f"v{KUBERNETES}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_passes_kubernetes_strict_validation(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objects = rendered[name]
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":  # the Prometheus Operator's CRD
            crd_validator("servicemonitor.v1.json").validate(obj)
        else:
            validate_kubernetes(obj)
    kinds = sorted(o["kind"] for o in objects)
    expected = {
        "worker-cpu": ["ConfigMap", "Deployment", "Service"],
        "worker-gpu": ["ConfigMap", "Deployment", "Service", "ServiceMonitor"],
        "node-4-gpus": ["ConfigMap", "Deployment", "Service"],
        "fleet": ["ConfigMap", "Deployment", "Deployment", "Service", "Service"],
    }
    assert kinds == expected[name]


def test_the_validation_would_catch_a_malformed_pod(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The strict check can fail: an unknown field, and a gRPC probe's port given by name (a
    gRPC probe takes a number only), are both refused."""
    deployment = named(rendered["worker-cpu"], "Deployment", "hloserve")
    for mistake in (
        {"readinesProbe": {"grpc": {"port": 8001}}},
        {"readinessProbe": {"grpc": {"port": "grpc"}}},
    ):
        broken = yaml.safe_load(yaml.safe_dump(deployment))
        _pod(broken)["containers"][0].update(mistake)
        with pytest.raises(kubernetes_validate.ValidationError):
            validate_kubernetes(broken)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_are_what_the_mode_promises(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    values, objects = VALUE_SETS[name], rendered[name]
    gpus, mode = values.get("gpus", 0), values.get("mode", "worker")
    deployment = named(objects, "Deployment", "hloserve")
    assert deployment["spec"]["replicas"] == values.get("replicas", 1)
    pod = _pod(deployment)
    (container,) = pod["containers"]
    assert container["args"][0] == ("node" if mode == "node" else "serve")
    assert container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == (gpus or None)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    rest = values.get("http", {}).get("enabled", True)
    assert ports == {"grpc": 8001, "metrics": 8002, **({"http": 8000} if rest else {})}
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["HLOSERVE_SERVER_HTTP_PORT"] == ("8000" if rest else "-1")  # -1: REST off
    startup, liveness, readiness = (container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    for probe in (startup, liveness, readiness):
        assert probe["grpc"]["port"] == 8001
    assert readiness["grpc"].get("service", "") == ""  # the whole server: every bundle ready
    assert liveness["grpc"]["service"] == startup["grpc"]["service"] == "inference.GRPCInferenceService"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # XLA compilation
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert not container["securityContext"]["allowPrivilegeEscalation"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    repository = values["modelRepository"]
    source = next(k for k in ("pvc", "hostPath", "initContainer") if k in repository)
    assert {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "initContainer": "emptyDir"}[source] in (
        volumes["models"]
    )
    mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == "/mnt/models" and mount["readOnly"]
    if source == "initContainer":
        (init,) = pod["initContainers"]
        assert init["args"] == repository["initContainer"]["args"]
        assert volumes["models"]["emptyDir"] == {"sizeLimit": "20Gi"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8002"
    for key in ("nodeSelector", "tolerations"):
        assert pod.get(key) == values.get(key)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_service_reaches_the_front_pods(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered[name]
    service = named(objects, "Service", "hloserve")
    front = named(objects, "Deployment", "hloserve-router" if name == "fleet" else "hloserve")
    assert _selects(service, front)
    assert [d for d in of_kind(objects, "Deployment") if _selects(service, d)] == [front]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c" and grpc["targetPort"] == "grpc"


def test_the_fleet_finds_its_workers_through_a_headless_service(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["fleet"]
    headless = named(objects, "Service", "hloserve-workers")
    workers = named(objects, "Deployment", "hloserve")
    router = named(objects, "Deployment", "hloserve-router")
    assert headless["spec"]["clusterIP"] == "None" and _selects(headless, workers)
    assert not _selects(headless, router)
    (container,) = _pod(router)["containers"]
    assert container["args"][0] == "node"
    environ = {e["name"]: e["value"] for e in container["env"]}
    assert environ["HLOSERVE_NODE_WORKERS_DNS"] == "hloserve-workers.ml.svc:8001"
    assert environ["HLOSERVE_NODE_WORKERS_METRICS_PORT"] == "8002"
    assert "nvidia.com/gpu" not in str(container.get("resources")) and router["spec"]["replicas"] == 2
    assert _pod(router).get("nodeSelector") is None  # routers need no GPU node


def test_the_service_monitor_scrapes_the_metrics_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["worker-gpu"]
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = named(objects, "Service", "hloserve")
    labels = service["metadata"]["labels"]
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("name", ["worker-cpu", "worker-gpu", "fleet"])
def test_hloserve_accepts_the_configuration_and_environment_it_is_given(
    name: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The ConfigMap is an hloserve configuration, the environment's HLOSERVE_ variables name
    real fields, and the flags are `hloserve serve`'s (the REST port, a later feature, is left
    out of these value sets)."""
    objects = rendered[name]
    (configmap,) = of_kind(objects, "ConfigMap")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(configmap["data"]["config.yaml"])
    (container,) = _pod(named(objects, "Deployment", "hloserve"))["containers"]
    environ = {e["name"]: e["value"] for e in container["env"]}
    config = load_config(config_file, environ=environ)
    assert config.server.host == "0.0.0.0" and config.server.grpc_port == 8001
    assert str(config.server.model_repository) == "/mnt/models"
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == VALUE_SETS[name].get("config", {})
    flags = [a for a in container["args"][1:] if a.startswith("--")]
    assert set(flags) <= {"--config", *SERVER_FLAGS.values()}


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"gpus": -1, "modelRepository": PVC}, HelmValuesError, "at '/gpus': minimum: got -1, want 0"),
        ({}, HelmRenderError, "modelRepository: set exactly one of modelRepository.pvc.claimName"),
        (
            {"modelRepository": {**PVC, "hostPath": {"path": "/srv/models"}}},
            HelmRenderError,
            "(where the bundles come from); 2 are set",
        ),
        ({"gpus": 2, "modelRepository": PVC}, HelmRenderError, "use mode: node"),
        ({"gpu": 1, "modelRepository": PVC}, HelmValuesError, "additional properties 'gpu' not allowed"),
        ({"mode": "cluster", "modelRepository": PVC}, HelmValuesError, "at '/mode'"),
        (
            {"modelRepository": PVC, "tracing": {"enabled": True}},
            HelmRenderError,
            "tracing.endpoint: name the OTLP/gRPC collector",
        ),
        ({**PVC_ONLY, "tracing": {"sampler": "sometimes"}}, HelmValuesError, "at '/tracing/sampler'"),
        ({**PVC_ONLY, "tracing": {"samplerArg": "2"}}, HelmValuesError, "at '/tracing/samplerArg'"),
        ({**PVC_ONLY, "tracing": {"endpoint": "collector"}}, HelmValuesError, "at '/tracing/endpoint'"),
    ],
)
def test_bad_values_fail_rendering_with_a_message_naming_them(
    values: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as failed:
        render(values)
    assert message in str(failed.value)


# -- restricted APIs and TLS (issue 25) --------------------------------------------------------

SECURE = {
    "modelRepository": PVC,
    "restricted": {
        "grpc": ["model-repository,control:admin-key=admin-value", "health:probe-key=p"],
        "http": ["model-repository:admin-key=admin-value", "health:probe-key=p"],
    },
    "tls": {"enabled": True, "secretName": "hloserve-tls"},
}


@pytest.mark.parametrize("mode", ["worker", "node", "fleet"])
def test_tls_and_restrictions_reach_hloserve_from_a_secret(mode: str, tmp_path: Path) -> None:
    values = {**SECURE, "mode": mode, **({"gpus": 1} if mode == "fleet" else {})}
    lint_report = lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES}")
    assert not lint_report["errors"], lint_report
    objects = render(values)
    for obj in objects:
        validate_kubernetes(obj)
    front = named(objects, "Deployment", "hloserve-router" if mode == "fleet" else "hloserve")
    pod = _pod(front)
    (container,) = pod["containers"]
    environ = {e["name"]: e["value"] for e in container["env"]}
    server = load_config(environ=environ).server
    assert server.grpc_restricted_protocol == tuple(SECURE["restricted"]["grpc"])
    assert server.http_restricted_api == tuple(SECURE["restricted"]["http"])
    assert server.grpc_tls and server.http_tls and not server.grpc_use_ssl_mutual
    assert str(server.grpc_server_cert) == "/etc/hloserve-tls/tls.crt"
    assert str(server.http_server_key) == "/etc/hloserve-tls/tls.key"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "hloserve-tls"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": "/etc/hloserve-tls", "readOnly": True}
    # The kubelet's gRPC probe has no TLS: REST's health over HTTPS, with the health header.
    for probe, path in (("startupProbe", "/v2/health/live"), ("readinessProbe", "/v2/health/ready")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == (path, 8000, "HTTPS")
        assert get["httpHeaders"] == [{"name": "probe-key", "value": "p"}]
    service = named(objects, "Service", "hloserve")
    assert next(p for p in service["spec"]["ports"] if p["name"] == "grpc")["appProtocol"] == "grpc"
    if mode == "fleet":  # the workers behind the routers: restrictions, no TLS
        (worker,) = _pod(named(objects, "Deployment", "hloserve"))["containers"]
        behind = load_config(environ={e["name"]: e["value"] for e in worker["env"]}).server
        assert behind.grpc_restricted_protocol and not behind.grpc_tls and not behind.http_tls
        assert "tls" not in [m["name"] for m in worker["volumeMounts"]]
        assert worker["readinessProbe"]["httpGet"]["scheme"] == "HTTP"  # its gRPC health is restricted


def test_mutual_tls_probes_open_a_tcp_connection() -> None:
    values = {"modelRepository": PVC, "tls": {"enabled": True, "secretName": "s", "mutual": True}}
    (container,) = _pod(named(render(values), "Deployment", "hloserve"))["containers"]
    environ = {e["name"]: e["value"] for e in container["env"]}
    server = load_config(environ=environ).server
    assert server.grpc_use_ssl_mutual and str(server.http_root_cert) == "/etc/hloserve-tls/ca.crt"
    assert container["readinessProbe"]["tcpSocket"] == {"port": 8001}


def test_tls_without_a_secret_fails_rendering() -> None:
    with pytest.raises(HelmRenderError, match=r"tls\.secretName: name the kubernetes\.io/tls Secret"):
        render({"modelRepository": PVC, "tls": {"enabled": True}})


# -- tracing (issue 30) ------------------------------------------------------------------------

TRACED = {
    "modelRepository": PVC,
    "tracing": {
        "enabled": True,
        "endpoint": "http://otel-collector.observability:4317",
        "sampler": "parentbased_traceidratio",
        "samplerArg": "0.05",
        "serviceName": "hloserve-prod",
    },
}


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for d in of_kind(objects, "Deployment") for c in _pod(d)["containers"]]


@pytest.mark.parametrize("mode", ["worker", "node", "fleet"])
def test_tracing_values_reach_every_hloserve_container_as_otel_variables(mode: str) -> None:
    """Workers, nodes, and the fleet's workers and routers (whose Envoy exports too) get the
    OTEL_* variables, and hloserve reads from them the settings the values name."""
    values = {**TRACED, "mode": mode, **({"gpus": 1} if mode == "fleet" else {})}
    report = lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES}")
    assert not report["errors"], report
    objects = render(values)
    for obj in objects:
        validate_kubernetes(obj)
    containers = _containers(objects)
    assert len(containers) == (2 if mode == "fleet" else 1)
    for container in containers:
        environ = {e["name"]: e["value"] for e in container["env"]}
        chosen = settings(load_config(environ=environ).tracing, environ)
        assert chosen == {
            "exporter": "otlp",
            "endpoint": "http://otel-collector.observability:4317",
            "sampler": "parentbased_traceidratio",
            "sampler_arg": "0.05",
            "service_name": "hloserve-prod",
        }
        TracingConfig(sampler=chosen["sampler"], sampler_arg=chosen["sampler_arg"]).validate()


def test_tracing_is_off_unless_enabled(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        for container in _containers(objects):
            environ = {e["name"]: e["value"] for e in container["env"]}
            assert not [name for name in environ if name.startswith("OTEL_")], container["name"]
            assert settings(load_config(environ=environ).tracing, environ)["exporter"] == "none"


@pytest.mark.parametrize("mode", ["worker", "node"])
def test_tls_metrics_serves_the_metrics_port_over_https_and_the_monitor_scrapes_it(mode: str) -> None:
    ca = {"ca": {"secret": {"name": "hloserve-tls", "key": "ca.crt"}}, "serverName": "hloserve"}
    values = {
        **SECURE,
        "mode": mode,
        "tls": {**SECURE["tls"], "metrics": True},
        "metrics": {"serviceMonitor": {"enabled": True, "tlsConfig": ca}},
    }
    objects = render(values)
    (monitor,) = of_kind(objects, "ServiceMonitor")
    crd_validator("servicemonitor.v1.json").validate(monitor)  # strict: a misplaced key fails
    for obj in objects:
        if obj is not monitor:
            validate_kubernetes(obj)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == ca
    (container,) = _pod(named(objects, "Deployment", "hloserve"))["containers"]
    server = load_config(environ={e["name"]: e["value"] for e in container["env"]}).server
    assert server.metrics_use_ssl and str(server.http_server_cert) == "/etc/hloserve-tls/tls.crt"
    annotations = named(objects, "Deployment", "hloserve")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"
    plain = render(SECURE)  # without tls.metrics: plain text, as before
    (plain_container,) = _pod(named(plain, "Deployment", "hloserve"))["containers"]
    assert not load_config(
        environ={e["name"]: e["value"] for e in plain_container["env"]}
    ).server.metrics_use_ssl


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**PVC_ONLY, "tls": {"metrics": True}}, "tls.metrics: the metrics port serves the certificate"),
        (
            {**SECURE, "mode": "fleet", "gpus": 1, "tls": {**SECURE["tls"], "metrics": True}},
            "not with mode: fleet",
        ),
    ],
)
def test_tls_metrics_without_tls_or_in_fleet_mode_fails_rendering(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(HelmRenderError, match=message):
        render(values)
