"""grpc.health.v1.Health on a live worker, asked by grpcio's and grpclib's health clients: the
server, its gRPC services and each model by name; NOT_SERVING for a bundle that failed and
while draining; NOT_FOUND for a name it does not know; the bound on Watch streams.

grpclib's client runs in a subprocess: its `health_pb2` and grpcio's `grpc_health` register the
same messages under different file names in protobuf's global pool, so no process can import both.

The module's fixtures run with 0 and 2 frontends; the drain test stays one process (with frontends,
each drains its own connections, and which frontend holds the call and which the watch is the
kernel's choice), and the Watch bound is the frontend's own, the same code (suite time).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.bundles import edit_manifest, write_affine
from support.servers import ServerThread, make_config, start_worker

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HELD_PY = """
import os, time
from hloserve import register_model

def preprocess(inputs):  # a call in flight that a drain waits for, until the test releases it
    open({entered!r}, "w").close()
    deadline = time.monotonic() + 20
    while not os.path.exists({release!r}) and time.monotonic() < deadline:
        time.sleep(0.01)
    return inputs

register_model("held", preprocess=preprocess)
"""
GRPCLIB_CLIENT = """
import asyncio, json, sys
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

async def main(port, names):
    answers = {}
    async with Channel("127.0.0.1", port) as channel:
        stub = HealthStub(channel)
        for name in names:
            try:
                reply = await stub.Check(HealthCheckRequest(service=name), timeout=10)
                answers[name] = HealthCheckResponse.ServingStatus.Name(reply.status)
            except GRPCError as e:
                answers[name] = f"{e.status.name}: {e.message}"
            async with stub.Watch.open(timeout=10) as watch:
                await watch.send_message(HealthCheckRequest(service=name), end=True)
                first = await watch.recv_message()
                answers["watch " + name] = HealthCheckResponse.ServingStatus.Name(first.status)
                await watch.cancel()
    print(json.dumps(answers))

asyncio.run(main(int(sys.argv[1]), sys.argv[2:]))
"""


def check(channel: grpc.Channel, name: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status


def watch(channel: grpc.Channel, name: str) -> Any:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)


@pytest.fixture(scope="module", name="mixed", params=[0, 2], ids=["frontends0", "frontends2"])
def _mixed(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerThread]:
    """A worker with one good bundle and one that fails to load."""
    repository = tmp_path_factory.mktemp("mixed")
    write_affine(repository / "good")
    edit_manifest(write_affine(repository / "bad"), lambda m: m.update(format_version="9.9"))
    with start_worker(make_config(repository), frontends=request.param) as server:
        yield server


def test_grpclib_health_client_checks_and_watches(server: ServerThread) -> None:
    names = ["", "inference.GRPCInferenceService", "hloserve_control.ControlService", "mlp", "x" * 500]
    run = subprocess.run(
        [sys.executable, "-c", GRPCLIB_CLIENT, str(server.worker.grpc_port), *names],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    answers = json.loads(run.stdout)
    for name in names[:4]:
        assert answers[name] == answers["watch " + name] == "SERVING", name
    unknown = answers["x" * 500]
    assert unknown.startswith("NOT_FOUND: no service or model 'xxx") and len(unknown) < 250  # bounded
    assert answers["watch " + "x" * 500] == "SERVICE_UNKNOWN"


def test_grpcio_health_client_checks_and_watches(server: ServerThread) -> None:
    with grpc.insecure_channel(server.url) as channel:
        assert check(channel, "") == SERVING
        assert check(channel, "mlp") == SERVING
        assert check(channel, "inference.GRPCInferenceService") == SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(channel, "nope")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no service or model 'nope'" in str(unknown.value.details())
        stream = watch(channel, "nope")
        assert next(stream).status == SERVICE_UNKNOWN
        stream.cancel()
        stream = watch(channel, "mlp")
        assert next(stream).status == SERVING
        stream.cancel()
        assert check(channel, "mlp") == SERVING  # still answering


def test_a_bundle_that_failed_is_not_serving_and_so_is_the_server_but_it_is_alive(
    mixed: ServerThread,
) -> None:
    """Readiness ("") follows ServerReady, which a failed bundle fails; the liveness name does
    not, so a kubelet keeps the pod out of the Service without restarting it."""
    with grpc.insecure_channel(mixed.url) as channel:
        assert check(channel, "bad") == NOT_SERVING
        assert check(channel, "") == NOT_SERVING
        assert check(channel, "good") == SERVING
        assert check(channel, "inference.GRPCInferenceService") == SERVING
    client = grpcclient.InferenceServerClient(mixed.url)
    assert not client.is_server_ready() and not client.is_model_ready("bad") and client.is_model_ready("good")
    client.close()


@pytest.mark.parametrize("frontends", [0, 2])
def test_watch_follows_a_model_loaded_later(tmp_path: Path, frontends: int) -> None:
    """A model loading for the first time is unknown (its bundle is not served yet); Watch
    reports SERVING once it is loaded (with frontends, once the engine pushed the change)."""
    write_affine(tmp_path / "repository" / "first")
    write_affine(tmp_path / "late")
    with start_worker(make_config(tmp_path / "repository"), frontends=frontends) as server:
        with grpc.insecure_channel(server.url) as channel:
            stream = watch(channel, "late")
            assert next(stream).status == SERVICE_UNKNOWN
            shutil.move(tmp_path / "late", tmp_path / "repository" / "late")
            client = grpcclient.InferenceServerClient(server.url)
            client.load_model("late")
            client.close()
            assert next(stream).status == SERVING
            stream.cancel()


def test_draining_answers_not_serving_and_ends_watches(tmp_path: Path) -> None:
    """SIGTERM's drain, for real: a call is in flight and the listener is closed; on a
    connection still open Check answers NOT_SERVING (not UNAVAILABLE), and Watch says so and
    ends while the drain still waits for that call, so it does not hold the shutdown."""
    entered, release = tmp_path / "entered", tmp_path / "release"
    held = HELD_PY.format(entered=str(entered), release=str(release))
    (write_affine(tmp_path / "repository" / "held") / "model.py").write_text(held)
    server = start_worker(make_config(tmp_path / "repository", shutdown_grace_s=30.0))
    tensor = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    client = grpcclient.InferenceServerClient(server.url)
    inflight: list[Any] = []
    caller = threading.Thread(target=lambda: inflight.append(client.infer("held", [tensor])))
    stopper = threading.Thread(target=server.stop)
    try:
        with grpc.insecure_channel(server.url) as channel:
            stream = watch(channel, "")
            watched = [next(stream).status]
            caller.start()
            deadline = time.monotonic() + 10
            while not entered.exists():  # the call is in its hook
                assert time.monotonic() < deadline, "the call did not arrive"
                time.sleep(0.01)
            stopper.start()
            checked = [check(channel, "held")]
            while checked[-1] == SERVING:
                assert time.monotonic() < deadline, "the drain did not start"
                time.sleep(0.02)
                checked.append(check(channel, "held"))
            checked.append(check(channel, ""))
            watched += [message.status for message in stream]  # it ends: no hang
            assert caller.is_alive() and stopper.is_alive()  # ...while the drain goes on
    finally:
        release.touch()
        caller.join(30)
        stopper.join(30)
        client.close()
    assert checked[-2:] == [NOT_SERVING, NOT_SERVING]
    assert watched == [SERVING, NOT_SERVING]
    assert inflight and inflight[0].as_numpy("OUTPUT").shape == (1, 3)  # the call in flight finished


def test_watch_streams_are_bounded(tmp_path: Path) -> None:
    write_affine(tmp_path / "one")
    with start_worker(make_config(tmp_path, max_health_watches=1)) as server:
        with grpc.insecure_channel(server.url) as channel:
            first = watch(channel, "one")
            assert next(first).status == SERVING
            with pytest.raises(grpc.RpcError) as refused:
                next(watch(channel, "one"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "server.max_health_watches" in str(refused.value.details())
            assert check(channel, "one") == SERVING  # Check is not counted
            first.cancel()
            deadline = time.monotonic() + 5
            while True:  # the server sees the cancel, and the slot is free again
                again = watch(channel, "one")
                try:
                    assert next(again).status == SERVING
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.05)
                finally:
                    again.cancel()
