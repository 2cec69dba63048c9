"""Rendering the chart and validating what it renders, offline: Helm's SDK as a library
(helm-python-sdk, no helm binary), Kubernetes' own schemas (kubernetes-validate), and the CRD
schemas of KServe and the Prometheus Operator kept in schemas/ (jsonschema)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from helm_python.chart import Chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "hloserve"
KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES = "1.32.0"


def render(values: dict[str, Any], namespace: str = "ml") -> list[dict[str, Any]]:
    """Every object the chart renders for `values`, as a release `hloserve` in `namespace`."""
    with Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="hloserve", namespace=namespace)
    return [
        obj
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for obj in yaml.safe_load_all(text)
        if obj
    ]


def validate_kubernetes(obj: dict[str, Any]) -> None:
    """Strict validation against Kubernetes' schema for the object's kind (unknown fields fail)."""
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def strict(schema: Any) -> Any:
    """A CRD schema that rejects unknown fields, as the API server's strict field validation
    does (a structural schema otherwise prunes them in silence)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(name: str) -> jsonschema.protocols.Validator:
    schema = strict(json.loads((SCHEMAS / name).read_text()))
    return jsonschema.Draft7Validator(schema)


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found
