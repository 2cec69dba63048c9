"""The KServe ClusterServingRuntime and sample InferenceService (deploy/kserve) against KServe's
own CRD schemas (schemas/, from kserve/kserve), strictly; the runtime's container against
Kubernetes' schema; and the two agree with each other and with hloserve."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml

from hloserve.cli import SERVER_FLAGS
from hloserve.config import ServerConfig

from .support import KSERVE, crd_validator, validate_kubernetes

RUNTIME = yaml.safe_load((KSERVE / "clusterservingruntime.yaml").read_text())
SAMPLE = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())


def test_the_runtime_is_a_valid_cluster_serving_runtime() -> None:
    crd_validator("clusterservingruntime.v1alpha1.json").validate(RUNTIME)


def test_the_sample_is_a_valid_inference_service() -> None:
    crd_validator("inferenceservice.v1beta1.json").validate(SAMPLE)


@pytest.mark.parametrize(
    "mistake",
    [
        lambda r: r["spec"].update(protocolVersions="grpc-v2"),  # not a list
        lambda r: r["spec"]["containers"][0].update(readinesProbe={}),  # an unknown field
        lambda r: r["spec"]["supportedModelFormats"][0].update(priority="high"),
    ],
)
def test_the_crd_schema_rejects_a_malformed_runtime(mistake: Any) -> None:
    broken = copy.deepcopy(RUNTIME)
    mistake(broken)
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("clusterservingruntime.v1alpha1.json").validate(broken)


def test_the_runtime_container_is_a_valid_kubernetes_container() -> None:
    """As a pod KServe would make of it (KServe copies the container into its predictor pod)."""
    (container,) = RUNTIME["spec"]["containers"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [container]}}
    validate_kubernetes(pod)


def test_the_runtime_serves_what_kserve_expects() -> None:
    spec = RUNTIME["spec"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert [f["name"] for f in spec["supportedModelFormats"]] == ["hloserve"]
    grpc = container["ports"][0]  # KServe maps the first port to the Service
    assert grpc["name"] == "h2c"
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"][1:])
    assert container["args"][0] == "serve" and set(flags) <= {
        f.removeprefix("--") for f in SERVER_FLAGS.values()
    }
    assert flags["model-repository"] == "/mnt/models" and flags["host"] == "0.0.0.0"
    assert int(flags["grpc-port"]) == grpc["containerPort"] == ServerConfig().grpc_port
    (http,) = (p for p in container["ports"] if p["name"] == "http")
    assert int(flags["http-port"]) == http["containerPort"] == ServerConfig().http_port
    assert spec["annotations"]["prometheus.kserve.io/port"] == flags["metrics-port"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == grpc["containerPort"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # XLA compilation
    assert container["securityContext"]["runAsUser"] == 1000 and container["securityContext"]["runAsNonRoot"]


def test_the_sample_selects_the_runtime() -> None:
    model = SAMPLE["spec"]["predictor"]["model"]
    assert model["runtime"] == RUNTIME["metadata"]["name"]
    assert model["modelFormat"]["name"] in [f["name"] for f in RUNTIME["spec"]["supportedModelFormats"]]
    assert model["protocolVersion"] in RUNTIME["spec"]["protocolVersions"]  # KServe's default, v1, is not
