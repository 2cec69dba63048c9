"""The Grafana dashboard (deploy/grafana/hloserve-dashboard.json), checked offline: it parses
into the typed models of Grafana's dashboard schema (grafana-foundation-sdk, generated from the
schema Grafana publishes) without losing a field, it has what Grafana requires of a dashboard,
and every metric its queries name is one a real worker exports on /metrics."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families
from support.bundles import WEIGHT_BYTES, assert_affine_answers, write_affine
from support.servers import ROOT, make_config, start_worker

from hloserve.config import ModelSettings
from hloserve.engine import metrics

DASHBOARD = ROOT / "deploy" / "grafana" / "hloserve-dashboard.json"
_METRIC = re.compile(r"\bhloserve_[a-z0-9_]+")
_SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created")


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return found


def _queried(dashboard: dict[str, Any]) -> set[str]:
    names = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            names.update(_METRIC.findall(target["expr"]))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            names.update(_METRIC.findall(query["query"]))
    return names


def _contains(whole: Any, part: Any, path: str = "") -> None:
    """Every key and value of `part` is in `whole` (which may hold defaults besides)."""
    if isinstance(part, dict):
        assert isinstance(whole, dict), path
        for key, value in part.items():
            assert key in whole, f"{path}/{key} is not a field of Grafana's schema"
            _contains(whole[key], value, f"{path}/{key}")
    elif isinstance(part, list):
        assert isinstance(whole, list) and len(whole) == len(part), path
        for i, (w, p) in enumerate(zip(whole, part, strict=True)):
            _contains(w, p, f"{path}[{i}]")
    else:
        assert whole == part, f"{path}: {whole!r} != {part!r}"


def test_the_dashboard_parses_into_grafanas_schema_without_losing_a_field() -> None:
    data = _dashboard()
    parsed = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    _contains(parsed, data)


def test_the_dashboard_has_what_grafana_requires() -> None:
    data = _dashboard()
    assert data["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", data["uid"])
    assert isinstance(data["schemaVersion"], int) and data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(data)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]  # Grafana's 24 columns
        assert panel["title"] and panel["type"] in ("row", "timeseries"), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            for variable in re.findall(r"\$(\w+)", target["expr"]):
                assert variable in variables or variable.startswith("__"), (panel["title"], variable)
    rows = [p["title"] for p in data["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency by phase", "Residency and swaps", "Workers"]


@pytest.mark.slow
def test_every_metric_the_dashboard_queries_is_one_a_worker_exports(tmp_path: Path) -> None:
    for name in "ap":
        write_affine(tmp_path / name)
    config = make_config(tmp_path, scheduler={"models": {"p": ModelSettings(residency="device")}})
    config = config.replace("weights", budget_bytes=WEIGHT_BYTES + 10)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for name in "ap":
            assert_affine_answers(client, name)
        client.close()
        url = f"http://127.0.0.1:{server.worker.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.update(family.name + suffix for suffix in _SUFFIXES)
        exported.update(sample.name for sample in family.samples)
    # the allocator's statistics exist only where the backend keeps them (a GPU, not this CPU)
    device_only = {f"hloserve_device_memory_{name}_bytes" for name, _ in metrics._DEVICE_MEMORY.values()}
    queried = _queried(_dashboard())
    assert queried - exported - device_only == set()
    swaps = {
        "hloserve_weight_load_duration_seconds_bucket",
        "hloserve_weight_load_bytes_total",
        "hloserve_weight_evictions_by_cause_total",
        "hloserve_weight_load_wait_seconds_total",
        "hloserve_model_residency",
        "hloserve_weight_budget_bytes",
        "hloserve_weight_resident_bytes",
        "hloserve_weight_pinned_bytes",
        "hloserve_request_duration_seconds_bucket",
        "hloserve_requests_total",
    }
    assert swaps <= queried, f"the dashboard leaves out {sorted(swaps - queried)}"
