"""Swap metrics on /metrics: per model loads (durations, bytes), evictions by cause, the time
requests waited for loads and the residency state; per worker the budget and the bytes resident
and pinned. A real worker with a budget of one affine model, scraped over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import trio
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from support.bundles import WEIGHT_BYTES, assert_affine_answers, write_affine
from support.servers import ServerThread, make_config, start_worker

from hloserve.config import ModelSettings


def scrape(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on the worker's /metrics by (name, sorted labels)."""
    url = f"http://127.0.0.1:{server.worker.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_swaps_under_a_budget_are_counted_per_model_and_per_worker(tmp_path: Path) -> None:
    for name in "abp":
        write_affine(tmp_path / name)
    config = make_config(tmp_path, scheduler={"models": {"p": ModelSettings(residency="device")}})
    config = config.replace("weights", budget_bytes=WEIGHT_BYTES + 10)
    with start_worker(config) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for name in "abap":  # a loads, b evicts it, a evicts b; p is pinned: never loaded on demand
            # then a compaction frees a, and b loads again
            assert_affine_answers(client, name)
        trio.from_thread.run(server.worker.compact, [], trio_token=server._token)
        assert_affine_answers(client, "b")
        metrics = scrape(server)
        client.close()

    def value(name: str, **labels: str) -> float:
        return metrics[name, tuple(sorted(labels.items()))]

    assert value("hloserve_weight_load_duration_seconds_count", model="a") == 2
    assert value("hloserve_weight_load_duration_seconds_bucket", model="a", le="+Inf") == 2
    assert value("hloserve_weight_load_duration_seconds_count", model="b") == 2
    assert value("hloserve_weight_load_duration_seconds_count", model="p") == 0
    assert value("hloserve_weight_load_bytes_total", model="a") == 2 * WEIGHT_BYTES
    assert value("hloserve_weight_evictions_by_cause_total", model="a", cause="budget") == 1
    assert value("hloserve_weight_evictions_by_cause_total", model="a", cause="compaction") == 1
    assert value("hloserve_weight_evictions_by_cause_total", model="b", cause="budget") == 1
    assert value("hloserve_weight_evictions_by_cause_total", model="b", cause="control") == 0
    assert value("hloserve_weight_load_wait_seconds_total", model="a") > 0
    assert value("hloserve_weight_load_wait_seconds_total", model="p") == 0
    assert value("hloserve_model_residency", model="a", state="host", floor="system") == 1
    assert value("hloserve_model_residency", model="b", state="device", floor="system") == 1
    assert value("hloserve_model_residency", model="p", state="device", floor="device") == 1
    assert value("hloserve_weight_budget_bytes") == WEIGHT_BYTES + 10
    assert value("hloserve_weight_resident_bytes") == WEIGHT_BYTES
    assert value("hloserve_weight_pinned_bytes") == WEIGHT_BYTES
