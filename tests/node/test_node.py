"""`hloserve node --cpu-workers 2` end to end: real workers, real Envoy, unmodified tritonclient
(gRPC and REST) and perf_analyzer on the public ports, the controller's RPCs, a meta model and
its part, a worker killed under load, an overloaded worker kept in its routes, and a clean stop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
import yaml
from grpclib.client import Channel
from grpclib.const import Status
from support.bundles import PARAMS, X, affine, write_affine
from support.clients import wait_until
from support.numerics import assert_close
from support.servers import EXAMPLES, ROOT
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm

from hloserve._proto import hloserve_control as control
from hloserve._proto import hloserve_gateway as gateway
from hloserve.fleet.controller import changed_workers
from hloserve.fleet.workers import free_port

sys.path.insert(0, str(ROOT / "benches"))
from openloop import generate
from perf_analyzer import run_perf_analyzer

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # Envoy and several workers: the machine

MODELS = ("cnn", "mlp", "pool", "severity_grader")
META, PART = "doubled", "part"
"""A meta model of the fixture's repository, and the model it calls (listed through it alone)."""

META_PY = """
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    out = call("part", [NamedTensor("INPUT", inputs[0].data)])[0].data
    return [NamedTensor("score", 2 * out)]

register_meta_model("doubled", run=run)
"""


def _repository(directory: Path) -> Path:
    """The example repository, plus `part` (an affine bundle) and `doubled`, a meta calling it."""
    shutil.copytree(EXAMPLES, directory, ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
    write_affine(directory / PART)
    (directory / META).mkdir()
    manifest = {
        "format_version": "2.0",
        "kind": "meta",
        "meta": {"calls": [PART]},
        "client_inputs": [{"name": "x", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
        "client_outputs": [{"name": "score", "dtype": "f32", "shape": "kn", "dims": {"k": 3}}],
    }
    (directory / META / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (directory / META / "model.py").write_text(META_PY)
    return directory


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int
    log: Path
    http_port: int = -1

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(self.url)

    def http(self) -> triton_http.InferenceServerClient:
        return triton_http.InferenceServerClient(f"127.0.0.1:{self.http_port}")

    def worker_http(self, grpc_address: str) -> str:
        """The REST address of the worker serving gRPC at `grpc_address` (from its command line)."""
        pid = self.worker_pid(int(grpc_address.rpartition(":")[2]))
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return f"127.0.0.1:{argv[argv.index('--http-port') + 1]}"

    def descendants(self) -> set[int]:
        found, pending = set(), [self.process.pid]
        while pending:
            pid = pending.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    children = [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    continue
                found.update(children)
                pending.extend(children)
        return found

    def worker_pid(self, port: int) -> int:
        for pid in self.descendants():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and str(port).encode() in argv:
                return pid
        raise AssertionError(f"no worker on port {port}")

    def gateway(self, method: str, request: Any) -> Any:
        async def call() -> Any:
            channel = Channel("127.0.0.1", self.grpc_port)
            try:
                return await getattr(gateway.GatewayControlServiceStub(channel), method)(request, timeout=60)
            finally:
                channel.close()

        return asyncio.run(call())

    def status(self) -> gateway.GetSchedulingStatusResponse:
        return self.gateway("get_scheduling_status", gateway.GetSchedulingStatusRequest())

    def workers(self) -> dict[str, str]:
        return {w.name: w.address for w in self.status().workers}


DIE_WITH_TEST = ["setpriv", "--pdeathsig", "KILL", "--"]
"""Run a command so it dies with this test process (a `preexec_fn` doing the same would fork a
process that runs JAX's threads, which JAX warns about and the suite turns into an error)."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    log = tmp_path_factory.mktemp("node") / "node.log"
    repository = _repository(tmp_path_factory.mktemp("repository") / "models")
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "HLOSERVE_NODE_DISCOVERY_INTERVAL_S": "0.3",
        "HLOSERVE_NODE_REBALANCE_COMPUTE_S": "1000000",  # repacks only when the tests ask
        "HLOSERVE_NODE_FIRST_REBALANCE_COMPUTE_S": "0",
        "HLOSERVE_NODE_EMA_HALFLIFE_COMPUTE_S": "0.05",
        "HLOSERVE_NODE_RESTART_BACKOFF_MAX_S": "0.5",
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*DIE_WITH_TEST, sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "2",
             "--scheduling", "lpt_packing", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
             "--metrics-port", str(metrics_port), "--allow-client-shm",
             "--model-repository", str(repository)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    started = Node(process, grpc_port, metrics_port, log, http_port)
    try:
        try:
            wait_until(
                lambda: process.poll() is not None or started.client().is_server_ready(), 90, "the node"
            )
            assert process.poll() is None, "the node exited"
            wait_until(lambda: started.status().repack.count >= 1, 30, "the startup placement")
        except AssertionError as e:
            raise AssertionError(f"{e}; the node said:\n{log.read_text()[-4000:]}") from None
        yield started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _inputs(client: triton.InferenceServerClient, model: str, seed: int = 0) -> list[triton.InferInput]:
    rng = np.random.default_rng(seed)
    inputs = []
    for tensor in client.get_model_metadata(model).inputs:
        shape = [2 if s == -1 else s for s in tensor.shape]
        value = rng.integers(0, 255, shape) if tensor.datatype == "UINT8" else rng.standard_normal(shape)
        x = triton.InferInput(tensor.name, shape, tensor.datatype)
        x.set_data_from_numpy(value.astype(triton.triton_to_np_dtype(tensor.datatype)))
        inputs.append(x)
    return inputs


def _outputs(client: triton.InferenceServerClient, model: str, seed: int = 0) -> dict[str, np.ndarray]:
    result = client.infer(model, _inputs(client, model, seed))
    return {t.name: result.as_numpy(t.name) for t in client.get_model_metadata(model).outputs}


def _served(address: str) -> dict[str, int]:
    stats = triton.InferenceServerClient(address).get_inference_statistics()
    return {s.name: s.inference_stats.success.count for s in stats.model_stats}


def test_grpc_health_says_serving_while_the_node_is_ready(node: Node) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=10)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_every_example_model_answers_through_the_node_as_a_worker_does(node: Node) -> None:
    direct = triton.InferenceServerClient(node.workers()["worker0"])
    public = node.client()
    assert public.is_server_live() and public.is_server_ready()
    assert {m.name: m.state for m in public.get_model_repository_index().models} == dict.fromkeys(
        (*MODELS, META), "READY"
    )  # the meta's part is listed through it, as a worker lists it
    for model in MODELS:
        assert public.is_model_ready(model)
        assert public.get_model_metadata(model) == direct.get_model_metadata(model)
        assert public.get_model_config(model) == direct.get_model_config(model)
        ours, theirs = _outputs(public, model), _outputs(direct, model)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert_close(ours[name], theirs[name])


def _http_outputs(
    client: triton_http.InferenceServerClient, model: str, binary: bool
) -> dict[str, np.ndarray]:
    """What `client` answers for `model` on fixed inputs (JSON or binary tensors)."""
    rng = np.random.default_rng(0)
    metadata = client.get_model_metadata(model)
    inputs = []
    for tensor in metadata["inputs"]:
        shape = [2 if s == -1 else s for s in tensor["shape"]]
        value = rng.integers(0, 255, shape) if tensor["datatype"] == "UINT8" else rng.standard_normal(shape)
        x = triton_http.InferInput(tensor["name"], shape, tensor["datatype"])
        x.set_data_from_numpy(
            value.astype(triton_http.triton_to_np_dtype(tensor["datatype"])), binary_data=binary
        )
        inputs.append(x)
    result = client.infer(model, inputs)
    return {t["name"]: result.as_numpy(t["name"]) for t in metadata["outputs"]}


def test_rest_through_the_node_answers_as_a_worker_does(node: Node) -> None:
    public = node.http()
    direct = triton_http.InferenceServerClient(node.worker_http(node.workers()["worker0"]))
    assert public.is_server_live() and public.is_server_ready()
    assert public.get_server_metadata()["name"] == "hloserve"
    index = {m["name"]: m["state"] for m in public.get_model_repository_index()}
    assert index == dict.fromkeys((*MODELS, META), "READY")  # the union, the meta's part through it
    for model in (*MODELS, META):
        assert public.is_model_ready(model)
        assert public.get_model_metadata(model) == direct.get_model_metadata(model)
        assert public.get_model_config(model) == direct.get_model_config(model)
        for binary in (False, True):
            ours, theirs = _http_outputs(public, model, binary), _http_outputs(direct, model, binary)
            assert ours.keys() == theirs.keys()
            for name in ours:
                assert_close(ours[name], theirs[name])
    assert_close(
        _http_outputs(public, META, True)["score"],
        2 * affine(PARAMS, np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)),
    )
    stats = public.get_inference_statistics("mlp")["model_stats"]  # summed by the controller
    assert stats[0]["name"] == "mlp" and int(stats[0]["inference_stats"]["success"]["count"]) >= 4
    assert not public.is_model_ready("nosuch")


def _http_status(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_bad_rest_requests_get_the_same_status_through_envoy_as_direct(node: Node) -> None:
    public = f"http://127.0.0.1:{node.http_port}"
    direct = f"http://{node.worker_http(node.workers()['worker0'])}"
    wrong_dtype = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}]}
    cases = [  # (method, path, body, whether the controller's message is the worker's own)
        ("POST", "/v2/models/mlp/infer", b"{not json", True),
        ("POST", "/v2/models/mlp/infer", json.dumps(wrong_dtype).encode(), True),
        (
            "POST",
            "/v2/cudasharedmemory/region/r/register",
            b'{"raw_handle": {"b64": ""}, "byte_size": 4}',
            True,
        ),
        ("GET", "/v2/nowhere", None, True),
        ("POST", "/v2/models/nosuch/infer", json.dumps(wrong_dtype).encode(), False),  # no worker has it
        ("GET", "/v2/models/nosuch", None, False),
        ("GET", "/v2/models/nosuch/config", None, False),
        ("POST", "/v2/repository/models/no..such/load", b"", False),  # named by the worker that refused
    ]
    for method, path, body, same_message in cases:
        (through, said), (alone, direct_said) = (
            _http_status(public + path, method, body),
            _http_status(direct + path, method, body),
        )
        assert through == alone and through >= 400, (path, through, alone, said)
        assert (said == direct_said) == same_message, (path, said, direct_said)
        assert "error" in json.loads(said), said
    assert _http_outputs(node.http(), "mlp", binary=True)  # still serving


def test_rest_shared_memory_goes_to_every_worker(node: Node) -> None:
    public = node.http()
    handle = shm.create_shared_memory_region("rest_in", "/hloserve_node_test_rest", 4096)
    try:
        public.register_system_shared_memory("rest_in", "/hloserve_node_test_rest", 4096)
        for address in node.workers().values():
            assert "rest_in" in str(triton.InferenceServerClient(address).get_system_shared_memory_status())
        public.unregister_system_shared_memory("rest_in")
        for address in node.workers().values():
            assert "rest_in" not in str(
                triton.InferenceServerClient(address).get_system_shared_memory_status()
            )
    finally:
        shm.destroy_shared_memory_region(handle)


def test_rest_load_and_unload_go_through_the_controller(node: Node) -> None:
    public = node.http()
    workers = node.workers()
    try:
        public.unload_model("pool")  # from every worker that lists it
        body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.0]}]})
        url = f"http://127.0.0.1:{node.http_port}/v2/models/pool/infer"
        # Until Envoy has the new routes, a worker answers (404: it unloaded pool); then the controller.
        wait_until(
            lambda: "not served by any worker" in _http_status(url, "POST", body.encode())[1],
            10,
            "pool's REST route to go to the controller",
        )
        assert not public.is_model_ready("pool")
        index = {m["name"]: m for m in public.get_model_repository_index()}
        assert index["pool"]["state"] == "UNAVAILABLE" and "no ready replica" in index["pool"]["reason"]
        assert _http_status(url, "POST", body.encode())[0] == 404
        public.load_model("pool")  # on the workers it is placed on
        wait_until(lambda: public.is_model_ready("pool"), 10, "pool routable again")
        assert _http_outputs(public, "pool", binary=True)
    finally:
        _pool_back_on_every_worker(node, workers)


def _pool_back_on_every_worker(node: Node, workers: dict[str, str]) -> None:
    """Load `pool` on every worker again, for the tests after one that moved it."""
    for address in workers.values():
        triton.InferenceServerClient(address).load_model("pool")
    wait_until(
        lambda: len(next(m for m in node.status().models if m.name == "pool").serving_workers) == 2,
        10,
        "pool on both workers",
    )


def _control(address: str, method: str, request: Any) -> Any:
    async def call() -> Any:
        host, _, port = address.rpartition(":")
        channel = Channel(host, int(port))
        try:
            return await getattr(control.ControlServiceStub(channel), method)(request, timeout=60)
        finally:
            channel.close()

    return asyncio.run(call())


def test_control_calls_naming_a_model_reach_its_workers_and_the_others_every_worker(node: Node) -> None:
    workers = node.workers()
    public = node.url
    serving = next(m for m in node.status().models if m.name == "cnn").serving_workers
    try:
        _control(
            public, "set_model_policy", control.SetModelPolicyRequest("cnn", has_weight=True, weight=3.0)
        )
        for worker, address in workers.items():
            weights = {
                m.name: m.weight
                for m in _control(address, "model_control_status", control.ModelControlStatusRequest()).models
            }
            assert (weights["cnn"] == 3.0) == (worker in serving), (worker, weights)
    finally:
        _control(
            public, "set_model_policy", control.SetModelPolicyRequest("cnn", has_weight=True, weight=1.0)
        )
    with pytest.raises(grpclib.GRPCError) as raised:
        _control(
            public, "set_model_policy", control.SetModelPolicyRequest("nosuch", has_weight=True, weight=2.0)
        )
    assert raised.value.status == Status.NOT_FOUND
    # whole-server: every worker's status, summed per model
    each = [
        _control(a, "model_control_status", control.ModelControlStatusRequest()) for a in workers.values()
    ]
    merged = _control(public, "model_control_status", control.ModelControlStatusRequest())
    served = {m.name: m.requests_served for m in merged.models}
    assert served["mlp"] >= sum(m.requests_served for s in each for m in s.models if m.name == "mlp")
    assert {m.name for m in merged.models} == {*MODELS, META}


def test_a_meta_goes_only_to_workers_that_serve_its_part(node: Node) -> None:
    workers = node.workers()
    public = node.client()
    x = triton.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(X)
    assert_close(public.infer(META, [x]).as_numpy("score"), 2 * affine(PARAMS, X))
    assert public.is_model_ready(PART)  # listed through the meta, routable by its own name
    rows = {m.name: m for m in node.status().models}
    assert [r.worker for r in rows[PART].replicas] == [
        r.worker for r in rows[META].replicas
    ]  # placed together
    lone = triton.InferenceServerClient(workers["worker1"])
    try:
        lone.unload_model(PART)  # worker1 can no longer run the meta
        wait_until(
            lambda: (
                [r.worker for r in next(m for m in node.status().models if m.name == META).replicas]
                == ["worker0"]
            ),
            10,
            "the meta's route to leave worker1",
        )
        before = _served(workers["worker0"])[META]
        for _ in range(4):
            assert_close(public.infer(META, [x]).as_numpy("score"), 2 * affine(PARAMS, X))
        assert _served(workers["worker0"])[META] == before + 4
    finally:
        lone.load_model(PART)
        wait_until(
            lambda: PART in {m.name for m in node.status().models if len(m.serving_workers) == 2},
            10,
            "part back",
        )


def test_requests_reach_the_worker_the_model_is_placed_on(node: Node) -> None:
    status = node.status()
    placed = {m.name: [r.worker for r in m.replicas] for m in status.models}
    assert all(len(ws) == 1 for ws in placed.values()), placed
    workers = node.workers()
    before = {w: _served(a) for w, a in workers.items()}
    public = node.client()
    for model in MODELS:
        for _ in range(2):
            public.infer(model, _inputs(public, model))
        public.infer(model, _inputs(public, model), headers={"x-model-name": model})  # routed on it
    after = {w: _served(a) for w, a in workers.items()}
    for model in MODELS:
        (home,) = placed[model]
        for worker in workers:
            assert after[worker][model] - before[worker][model] == (3 if worker == home else 0), (
                model,
                worker,
            )
    merged = {s.name: s.inference_stats.success.count for s in public.get_inference_statistics().model_stats}
    assert {m: merged[m] for m in MODELS} == {m: sum(after[w][m] for w in workers) for m in MODELS}


def _status_of(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except InferenceServerException as e:
        return str(e.status()), str(e.message())
    return "OK", ""


def test_bad_input_gets_the_same_status_through_envoy_as_direct(node: Node) -> None:
    direct = triton.InferenceServerClient(node.workers()["worker0"])
    public = node.client()

    def wrong_shape(client: triton.InferenceServerClient) -> Any:
        x = triton.InferInput("INPUT0", [1, 3], "FP32")
        x.set_data_from_numpy(np.zeros((1, 3), np.float32))
        return client.infer("mlp", [x])

    def wrong_dtype(client: triton.InferenceServerClient) -> Any:
        x = triton.InferInput("INPUT0", [1, 16], "INT32")
        x.set_data_from_numpy(np.zeros((1, 16), np.int32))
        return client.infer("mlp", [x])

    def unknown_input(client: triton.InferenceServerClient) -> Any:
        x = triton.InferInput("NOPE", [1, 16], "FP32")
        x.set_data_from_numpy(np.zeros((1, 16), np.float32))
        return client.infer("mlp", [x])

    for case in (wrong_shape, wrong_dtype, unknown_input):
        through, alone = _status_of(lambda c=case: c(public)), _status_of(lambda c=case: c(direct))
        assert through == alone and through[0] == "StatusCode.INVALID_ARGUMENT", case.__name__
    for call in (
        lambda c: c.infer("nosuch", _inputs(public, "mlp")),
        lambda c: c.get_model_metadata("nosuch"),
        lambda c: c.get_model_config("nosuch"),
    ):
        assert (
            _status_of(lambda c=call: c(public))[0]
            == _status_of(lambda c=call: c(direct))[0]
            == "StatusCode.NOT_FOUND"
        )
    assert not public.is_model_ready("nosuch")
    assert _outputs(public, "mlp")  # still serving


def test_shared_memory_registered_through_the_node_serves_every_worker(node: Node) -> None:
    public = node.client()
    status = node.status()
    by_worker = {w.name: w.models_placed for w in status.workers}
    models = [ms[0] for ms in by_worker.values() if ms and ms[0] in ("mlp", "cnn", "pool")]
    handle = shm.create_shared_memory_region("node_in", "/hloserve_node_test_in", 1 << 20)
    try:
        public.register_system_shared_memory("node_in", "/hloserve_node_test_in", 1 << 20)
        assert "node_in" in str(public.get_system_shared_memory_status())
        for worker in status.workers:  # every worker holds it
            direct = triton.InferenceServerClient(worker.address)
            assert "node_in" in str(direct.get_system_shared_memory_status())
        for model in models or ["mlp"]:
            x = _inputs(public, model)[0]
            value = _inputs(public, model)[0]
            array = np.random.default_rng(1).standard_normal(x.shape()).astype(np.float32)
            shm.set_shared_memory_region(handle, [array])
            x.set_shared_memory("node_in", array.nbytes)
            expected = value.set_data_from_numpy(array)
            got = public.infer(model, [x])
            want = public.infer(model, [expected])
            name = public.get_model_metadata(model).outputs[0].name
            assert_close(got.as_numpy(name), want.as_numpy(name))
        public.unregister_system_shared_memory("node_in")
        for worker in status.workers:
            assert "node_in" not in str(
                triton.InferenceServerClient(worker.address).get_system_shared_memory_status()
            )
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_partial_registration_is_rolled_back(node: Node) -> None:
    public = node.client()
    workers = node.workers()
    handle = shm.create_shared_memory_region("clash", "/hloserve_node_test_clash", 4096)
    try:
        triton.InferenceServerClient(workers["worker1"]).register_system_shared_memory(
            "clash", "/hloserve_node_test_clash", 4096
        )
        code, message = _status_of(
            lambda: public.register_system_shared_memory("clash", "/hloserve_node_test_clash", 4096)
        )
        assert code == "StatusCode.ALREADY_EXISTS" and "worker1" in message, message
        assert "clash" not in str(
            triton.InferenceServerClient(workers["worker0"]).get_system_shared_memory_status()
        )
        assert _outputs(public, "mlp")
    finally:
        triton.InferenceServerClient(workers["worker1"]).unregister_system_shared_memory("clash")
        shm.destroy_shared_memory_region(handle)


def test_a_model_loaded_on_one_worker_joins_the_union_and_becomes_routable(node: Node) -> None:
    public = node.client()
    workers = node.workers()
    try:
        public.unload_model("pool")  # through the node: from every worker
        index = {m.name: m for m in public.get_model_repository_index().models}
        assert index["pool"].state == "UNAVAILABLE" and "no ready replica" in index["pool"].reason
        # Envoy takes the new routes within a second or so; then pool's requests reach the controller
        wait_until(
            lambda: (
                _status_of(lambda: public.infer("pool", _inputs(public, "cnn")))[0] == "StatusCode.NOT_FOUND"
            ),
            5,
            "pool's route to go",
        )
        assert not public.is_model_ready("pool")
        assert public.is_server_ready()  # unloaded on purpose: no longer a model the node must serve
        triton.InferenceServerClient(workers["worker1"]).load_model("pool")  # directly, on one worker
        wait_until(lambda: public.is_model_ready("pool"), 10, "pool to be routable")
        before = _served(workers["worker1"])["pool"]
        assert _outputs(public, "pool")
        assert _served(workers["worker1"])["pool"] == before + 1
        assert public.is_server_ready()
        public.load_model("pool")  # through the node: on the workers it is placed on
        placed = next(w.name for w in node.status().workers if "pool" in w.models_placed)
        assert placed in next(m for m in node.status().models if m.name == "pool").serving_workers
    finally:
        _pool_back_on_every_worker(node, workers)


def _compactions(address: str) -> int:
    async def call() -> int:
        host, _, port = address.rpartition(":")
        channel = Channel(host, int(port))
        try:
            status = await control.ControlServiceStub(channel).model_control_status(
                control.ModelControlStatusRequest()
            )
            return int(status.compactions)
        finally:
            channel.close()

    return asyncio.run(call())


def _load(node: Node, model: str, seconds: float, errors: list[str], count: list[int]) -> None:
    client = node.client()
    inputs = _inputs(client, model)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client.infer(model, inputs)
            count.append(1)
        except InferenceServerException as e:
            errors.append(f"{e.status()}: {e.message()}")


def test_a_repack_separates_a_skewed_load_and_compacts_only_the_workers_that_changed(node: Node) -> None:
    workers = node.workers()
    # mlp on every worker: at least one worker's placement changes at this repack
    node.gateway("set_model_replicas", gateway.SetModelReplicasRequest(name="mlp", replicas=-1))
    errors: list[str] = []
    threads = [
        threading.Thread(target=_load, args=(node, model, 3.0, errors, []))
        for model in ("pool", "severity_grader")
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    before = {m.name: [r.worker for r in m.replicas] for m in node.status().models}
    compactions = {w: _compactions(a) for w, a in workers.items()}
    answer = node.gateway("repack", gateway.RepackRequest(wait_seconds=30))
    assert answer.completed and answer.status.trigger == "operator"
    status = node.status()
    after = {m.name: [r.worker for r in m.replicas] for m in status.models}
    rows = {m.name: m for m in status.models}
    for hot in ("pool", "severity_grader"):
        assert rows[hot].utilization > max(rows["cnn"].utilization, rows["mlp"].utilization), rows
    assert len(after["pool"]) == len(after["severity_grader"]) == 1
    assert after["pool"] != after["severity_grader"]  # the two busy models on separate workers
    assert sorted(after["mlp"]) == ["worker0", "worker1"]
    changed = changed_workers(before, after)
    assert changed
    for worker, address in workers.items():
        assert (_compactions(address) > compactions[worker]) == (worker in changed), (worker, changed)
    # and each worker that changed warmed what it was given (compaction `scheduled`, the default)
    for worker in changed:
        status = _control(workers[worker], "model_control_status", control.ModelControlStatusRequest())
        resident = {m.name: m.device_resident for m in status.models if m.weight_nbytes}
        assert resident == {m: worker in after[m] for m in resident}, (worker, after)
    # the same load again: the placement stays, and nothing is compacted
    again = node.gateway("repack", gateway.RepackRequest(wait_seconds=30))
    assert again.completed and again.status.models_moved == 0
    assert {m.name: [r.worker for r in m.replicas] for m in node.status().models} == after
    assert again.status.compactions_sent == answer.status.compactions_sent


def test_a_worker_killed_under_load_costs_no_request_and_comes_back(node: Node) -> None:
    node.gateway("set_model_replicas", gateway.SetModelReplicasRequest(name="mlp", replicas=-1))
    assert node.gateway("repack", gateway.RepackRequest(wait_seconds=30)).completed
    wait_until(
        lambda: len(next(m for m in node.status().models if m.name == "mlp").replicas) == 2, 10, "mlp x2"
    )
    workers = node.workers()
    victim = node.worker_pid(int(workers["worker0"].rpartition(":")[2]))
    region = shm.create_shared_memory_region("kept", "/hloserve_node_test_kept", 4096)
    node.client().register_system_shared_memory("kept", "/hloserve_node_test_kept", 4096)
    errors: list[str] = []
    count: list[int] = []
    threads = [threading.Thread(target=_load, args=(node, "mlp", 4.0, errors, count)) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert len(count) > 100
    wait_until(lambda: node.worker_pid(int(workers["worker0"].rpartition(":")[2])) != victim, 10, "a restart")
    wait_until(
        lambda: len(next(m for m in node.status().models if m.name == "mlp").replicas) == 2,
        60,
        "worker0 back in mlp's route",
    )
    before = _served(workers["worker0"]).get("mlp", 0)
    public = node.client()
    for _ in range(8):
        public.infer("mlp", _inputs(public, "mlp"))
    assert _served(workers["worker0"])["mlp"] > before
    # what was registered through the node is registered again on the restarted worker
    assert "kept" in str(triton.InferenceServerClient(workers["worker0"]).get_system_shared_memory_status())
    public.unregister_system_shared_memory("kept")
    shm.destroy_shared_memory_region(region)


def _refusals_that_eject(node: Node) -> dict[str, float]:
    """Envoy's ejections of the workers of every gRPC pool (mlp's among them) for consecutive
    5xx or gateway failures (how it counts gRPC UNAVAILABLE, 503, and DEADLINE_EXCEEDED, 504),
    summed, from the node's metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
    found = re.findall(
        r"^envoy_cluster_outlier_detection_ejections_enforced_(consecutive_5xx|consecutive_gateway_failure)"
        r'\{[^}]*envoy_cluster_name="pool_[0-9a-f]+"[^}]*\} (\S+)$',
        text,
        re.MULTILINE,
    )
    assert found, "no pool's outlier counters in the node's metrics"
    ejections: dict[str, float] = {}
    for kind, value in found:
        ejections[kind] = ejections.get(kind, 0.0) + float(value)
    return ejections


def test_an_overloaded_worker_that_refuses_is_not_ejected(node: Node) -> None:
    """Past its capacity a worker refuses what it cannot answer within the deadline (UNAVAILABLE,
    DEADLINE_EXCEEDED); it is busy, not gone, and Envoy keeps sending to it (issue 25: it was
    ejected, and every model it held answered "no healthy upstream"). With Envoy's gateway-failure
    ejection enforced (threshold 5), this overload ejects it twice."""
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    public = node.client()
    for _ in range(8):  # warm
        public.infer("mlp", _inputs(public, "mlp"), client_timeout=30)
    # one and a half times what the workers answer here, each request with a 1 s deadline: they refuse
    # (UNAVAILABLE) what they would not answer in time
    message = request.SerializeToString()
    closed = generate(node.url, message, seconds=2.0, concurrency=64, connections=8)
    rate = 1.5 * closed["outcomes"]["OK"] / closed["elapsed"]
    load = generate(node.url, message, seconds=4.0, rate=rate, deadline_s=1.0, connections=8)
    outcomes, messages = load["outcomes"], load["messages"]
    assert outcomes.get("UNAVAILABLE", 0) > 0 and outcomes.get("OK", 0) > 0, (rate, outcomes, messages)
    assert not any("no healthy upstream" in m for m in messages.get("UNAVAILABLE", [])), messages
    assert _refusals_that_eject(node) == {"consecutive_5xx": 0, "consecutive_gateway_failure": 0}
    # and it is answered at once after, not after an ejection's time out
    before = sum(_served(address).get("mlp", 0) for address in node.workers().values())
    for _ in range(8):
        public.infer("mlp", _inputs(public, "mlp"), client_timeout=5)
    assert sum(_served(address).get("mlp", 0) for address in node.workers().values()) >= before + 8


def test_one_worker_serves_the_public_port_itself(tmp_path: Path) -> None:
    grpc_port = free_port()
    with (tmp_path / "node.log").open("wb") as out:
        process = subprocess.Popen(
            [*DIE_WITH_TEST, sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "1",
             "--grpc-port", str(grpc_port), "--metrics-port", "-1"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    alone = Node(process, grpc_port, -1, tmp_path / "node.log")
    try:
        wait_until(lambda: alone.client().is_server_ready(), 90, "the worker")
        (child,) = alone.descendants()  # no Envoy, no controller port: the worker itself
        assert alone.worker_pid(grpc_port) == child
        assert _outputs(alone.client(), "mlp")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert not Path(f"/proc/{child}").exists()
        assert b"[worker0]" in (tmp_path / "node.log").read_bytes()
    finally:
        process.kill()
        process.wait()


def test_metrics_merge_every_worker_with_a_worker_label(node: Node) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read().decode()
    for worker in ("worker0", "worker1"):
        assert f'hloserve_requests_served_total{{model="mlp",worker="{worker}"}}' in text
        assert f'hloserve_node_worker_ready{{worker="{worker}"}} 1.0' in text
    assert text.count("# TYPE hloserve_requests_served_total counter") == 1
    assert 'hloserve_node_worker_starts_total{worker="worker1"} 1.0' in text
    assert "envoy_cluster_upstream_rq_retry" in text and 'envoy_cluster_name="pool_' in text  # Envoy's
    assert urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/healthz").read() == b"ok\n"


@pytest.mark.parametrize(("model", "protocol"), [*((m, "grpc") for m in MODELS), ("mlp", "http")])
def test_perf_analyzer_runs_clean_through_the_node(node: Node, model: str, protocol: str) -> None:
    url = node.url if protocol == "grpc" else f"127.0.0.1:{node.http_port}"
    result = run_perf_analyzer(
        ["-m", model, "-u", url, "-i", protocol, "--concurrency-range", "2",
         "--measurement-interval", "500", "-s", "1000", "--max-trials", "5"],  # runs clean, not steady
        timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "error" not in output.lower(), output
    assert "Server:" in output and "compute infer" in output  # statistics summed by the controller


def test_sigterm_stops_the_node_and_every_child(node: Node) -> None:
    children = node.descendants()
    assert len(children) >= 3  # two workers and Envoy
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(60) == 0
    time.sleep(0.2)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "orphans left behind"
