"""`hloserve node --cpu-workers 2` over 10,000 models (issue 36): the controller discovers every
worker's models, Envoy routes each through one pool of both workers (two clusters, not 20,000),
unmodified clients get each variant's own answer through Envoy, over gRPC (the model's name
read from the body) and REST, the control status sums both workers' 10,000 models in one
answer, and one bundle changed among the 10,000 is reloaded by the workers' repository watch."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from grpclib.client import Channel
from support.bundles import PARAMS, X, affine, affine_output, edit_manifest, save_affine_weights, write_affine
from support.clients import wait_until
from support.numerics import assert_close

from hloserve._proto import hloserve_control as control
from hloserve.fleet.workers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serial]

COUNT = 10_000
DIE_WITH_TEST = ["setpriv", "--pdeathsig", "KILL", "--"]


def _named(name: str) -> Callable[[dict[str, Any]], None]:
    def rename(manifest: dict[str, Any]) -> None:
        manifest["name"] = name

    return rename


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in PARAMS.items()}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    """10,000 copies of one affine bundle; three of them with weights of their own."""
    repository = tmp_path_factory.mktemp("catalogue")
    first = write_affine(repository / "v0")
    for i in range(1, COUNT):
        shutil.copytree(first, repository / f"v{i}")
        edit_manifest(repository / f"v{i}", _named(f"v{i}"))
    chosen = {f"v{i}": _weights(i) for i in (7, 5000, COUNT - 1)}
    for name, params in chosen.items():
        save_affine_weights(repository / name, params)
    return repository, chosen


@pytest.fixture(scope="module")
def node(catalogue: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    repository, _ = catalogue
    log = tmp_path_factory.mktemp("node") / "node.log"
    ports = {name: free_port() for name in ("grpc", "http", "metrics")}
    env = {
        **os.environ,
        "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.5",
        "HLOSERVE_SERVER_RELOAD": "true",  # each worker watches the 10,000 bundles
        "HLOSERVE_SERVER_REPOSITORY_POLL_S": "2",
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*DIE_WITH_TEST, sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "2",
             "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]),
             "--metrics-port", str(ports["metrics"]), "--model-repository", str(repository)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    client = triton.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
    try:
        try:
            # ready: every model routed (the node's readiness needs a ready replica of each)
            wait_until(lambda: process.poll() is not None or client.is_server_ready(), 300, "the node")
            assert process.poll() is None, "the node exited"
        except AssertionError as e:
            raise AssertionError(f"{e}; the node said:\n{log.read_text()[-4000:]}") from None
        yield {"process": process, "log": log, **ports}
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def _envoy_directory(node: dict[str, Any]) -> Path:
    """Where the node's Envoy reads its routes and clusters (from Envoy's command line)."""
    pending = [node["process"].pid]
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                pending.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if Path(argv[0]).name == "envoy" and "-c" in argv:
            return Path(argv[argv.index("-c") + 1]).parent
    raise AssertionError("no Envoy among the node's processes")


def test_each_of_ten_thousand_variants_answers_through_envoy_with_its_own_weights(
    node: dict[str, Any], catalogue: tuple[Path, dict[str, dict[str, np.ndarray]]]
) -> None:
    _, chosen = catalogue
    grpc = triton.InferenceServerClient(f"127.0.0.1:{node['grpc']}")
    rest = triton_http.InferenceServerClient(f"127.0.0.1:{node['http']}")
    for name, params in {**chosen, "v3": PARAMS}.items():
        assert_close(affine_output(grpc, name), affine(params, X))  # no header: Envoy reads the body
        x = triton_http.InferInput("INPUT", list(X.shape), "FP32")
        x.set_data_from_numpy(X)
        assert_close(rest.infer(name, [x]).as_numpy("OUTPUT"), affine(params, X))
    assert grpc.is_model_ready(f"v{COUNT - 2}") and rest.is_model_ready(f"v{COUNT - 2}")
    assert not grpc.is_model_ready(f"v{COUNT}")  # no such model: the controller's NOT_FOUND
    grpc.close()
    rest.close()


def _scrape(node: dict[str, Any], kept: list[str]) -> str:
    text = urllib.request.urlopen(f"http://127.0.0.1:{node['metrics']}/metrics", timeout=60).read().decode()
    kept.append(text)
    return text


def test_envoy_holds_one_pool_for_the_models_on_the_same_workers_and_a_map_of_their_names(
    node: dict[str, Any],
) -> None:
    directory = _envoy_directory(node)
    (routes,) = json.loads((directory / "routes.json").read_text())["resources"]
    entries = routes["virtual_hosts"][0]["matcher"]["matcher_tree"]["exact_match_map"]["map"]
    assert len(entries) == COUNT
    routed = {r["route"]["cluster"] for e in entries.values() for r in e["action"]["typed_config"]["routes"]}
    assert len(routed - {"controller"}) == 1  # every model on both workers: one pool
    # Envoy holds that pool (gRPC and REST) and the controller's, and at most the pool of the
    # last update (worker1 alone, at start-up) for one more: its statistics, in the node's metrics
    # (a scrape leaves out a source that does not answer within node.probe_timeout_s, as Envoy's
    # admin did once in the long suite on a loaded machine)
    scraped: list[str] = []
    wait_until(lambda: "envoy_cluster_name=" in _scrape(node, scraped), 60, "Envoy's statistics in a scrape")
    text = scraped[-1]
    held = {
        line.split('envoy_cluster_name="')[1].split('"')[0]
        for line in text.splitlines()
        if "envoy_cluster_name=" in line
    }
    assert {"controller", "controller_http", *routed} <= held
    assert len(held) <= 6, held


def _control_status(node: dict[str, Any]) -> control.ModelControlStatusResponse:
    async def call() -> control.ModelControlStatusResponse:
        channel = Channel("127.0.0.1", node["grpc"])
        try:
            stub = control.ControlServiceStub(channel)
            return await stub.model_control_status(control.ModelControlStatusRequest(), timeout=60)
        finally:
            channel.close()

    return asyncio.run(call())


def test_the_control_status_of_ten_thousand_models_sums_both_workers_in_one_answer(
    node: dict[str, Any],
) -> None:
    grpc = triton.InferenceServerClient(f"127.0.0.1:{node['grpc']}")
    before = {m.name: m.requests_served for m in _control_status(node).models}
    for _ in range(3):
        affine_output(grpc, "v5000")
    grpc.close()
    status = _control_status(node)
    assert [m.name for m in status.models] == sorted(f"v{i}" for i in range(COUNT))
    served = {m.name: m.requests_served for m in status.models}
    assert served["v5000"] >= before["v5000"] + 3  # on whichever worker Envoy sent them


def test_one_bundle_changed_among_ten_thousand_is_reloaded_and_the_others_are_not(
    node: dict[str, Any], catalogue: tuple[Path, dict[str, dict[str, np.ndarray]]]
) -> None:
    repository, chosen = catalogue
    grpc = triton.InferenceServerClient(f"127.0.0.1:{node['grpc']}")
    changed = _weights(42)
    logged = len(node["log"].read_bytes())
    save_affine_weights(repository / "v42", changed)
    # both workers reload it (Envoy may send a request to either): several answers in a row agree
    wait_until(
        lambda: all(np.allclose(affine_output(grpc, "v42"), affine(changed, X), rtol=1e-5) for _ in range(6)),
        120,
        "v42's new weights through the node",
    )
    assert_close(affine_output(grpc, "v43"), affine(PARAMS, X))
    assert_close(affine_output(grpc, "v7"), affine(chosen["v7"], X))
    # the workers' lines reach the log through the node's loop, which copies them when it gets
    # to them: a worker may serve the new weights before its line is in the file
    loads: list[str] = []
    names_v42 = re.compile(r'(model=|"model": ")v42\b')

    def both_workers_said_so() -> bool:
        with node["log"].open("rb") as f:
            f.seek(logged)
            since = f.read().decode(errors="replace").splitlines()
        loads[:] = [line for line in since if "model loaded" in line]
        return sum(bool(names_v42.search(line)) for line in loads) >= 2

    wait_until(both_workers_said_so, 60, "both workers' 'model loaded' lines for v42")
    assert all(names_v42.search(line) for line in loads), loads[:4]
    grpc.close()
