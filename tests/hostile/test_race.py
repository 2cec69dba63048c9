"""Loads, unloads and control calls for one model apply in the order they were issued.

The hostile client races RepositoryModelLoad and RepositoryModelUnload of one model while the
dispatcher is busy with slow batches of another (`pool`, 4.8 MB a batch), then names the model
in the control RPCs. The server must end each round consistent (ready if and only if a request
answers), answer control calls for a gone model NOT_FOUND, and never die or half-live.

One process: the races are in the engine's model table and dispatcher, the same with frontends.
"""

from __future__ import annotations

import math
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import outcome
import pytest
import structlog
import trio
import tritonclient.grpc as grpcclient
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.clients import assert_control_refused, assert_serves, control
from support.servers import EXAMPLES, ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve._proto import hloserve_control as hc
from hloserve.actors.messages import Compact, QueueSummary, SetPolicy, SetResidency
from hloserve.config import ModelSettings
from hloserve.errors import ModelNotFound

ROUNDS = 20


def _repository(root: Path) -> Path:
    for name in ("mlp", "pool"):
        shutil.copytree(EXAMPLES / name, root / name)
    return root


def _mlp(client: Any) -> str:
    """How a request for mlp ends: OK, or its status and message."""
    tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
    try:
        client.infer("mlp", [tensor], client_timeout=10)
    except InferenceServerException as e:
        return f"{e.status()} {e.message()}"
    return "OK"


@pytest.fixture(name="busy")
def _busy(tmp_path: Path, worker_factory: Any) -> Iterator[ServerThread]:
    """A server whose dispatcher is kept busy by 3 clients sending 8-image batches of pool."""
    server = worker_factory(make_config(_repository(tmp_path)))
    stop = threading.Event()
    failures: list[str] = []

    def pool() -> None:
        client = grpcclient.InferenceServerClient(server.url)
        images = grpcclient.InferInput("IMAGE", [8, 224, 224, 3], "FP32")
        images.set_data_from_numpy(np.ones((8, 224, 224, 3), np.float32))
        while not stop.is_set():
            try:
                client.infer("pool", [images], client_timeout=30)
            except InferenceServerException as e:
                failures.append(str(e))
                return
        client.close()

    threads = [threading.Thread(target=pool) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        yield server
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert failures == []  # the other model served throughout


def _policy(server: ServerThread, model: str) -> Status:
    request = hc.SetModelPolicyRequest(name=model, has_weight=True, weight=1.5)
    try:
        control(server, lambda s: s.set_model_policy(request))
    except GRPCError as e:
        return e.status
    return Status.OK


def test_racing_load_and_unload_apply_in_order(busy: ServerThread) -> None:
    """An unload issued 5 ms after a load waits for it, whatever the dispatcher is doing: the
    model ends as the change the worker applied last left it (its log says which), ready if
    and only if a request answers, and the control service agrees."""
    client = grpcclient.InferenceServerClient(busy.url)
    last_applied = []
    for _ in range(ROUNDS):
        results: list[str] = []
        with structlog.testing.capture_logs() as logs:
            load = threading.Thread(target=_call, args=(client.load_model, results))
            load.start()
            time.sleep(0.005)
            _call(client.unload_model, results)
            load.join(30)
        assert results == ["OK", "OK"], results
        applied = [e["event"] for e in logs if e.get("model") == "mlp" and e["event"] in _CHANGES]
        ready = client.is_model_ready("mlp")
        answer = _mlp(client)
        assert ready == (applied[-1] == "model loaded"), (applied, ready)
        assert (answer == "OK") == ready, answer
        if not ready:
            assert answer.startswith("StatusCode.NOT_FOUND Request for unknown model: 'mlp'"), answer
        assert _policy(busy, "mlp") == (Status.OK if ready else Status.NOT_FOUND)
        last_applied.append(applied[-1])
        if not ready:
            client.load_model("mlp")
    client.close()
    # Issued last, the unload is applied last unless it overtook the load on its way in.
    assert last_applied.count("model unloaded") >= ROUNDS // 2, last_applied
    assert_serves(busy.url)


_CHANGES = ("model loaded", "model unloaded")


def _call(method: Any, results: list[str]) -> None:
    try:
        method("mlp")
        results.append("OK")
    except InferenceServerException as e:
        results.append(f"{e.status()} {e.message()}")


def test_control_naming_an_unloaded_model_is_not_found(busy: ServerThread) -> None:
    client = grpcclient.InferenceServerClient(busy.url)
    client.unload_model("mlp")
    calls = (
        lambda s: s.set_model_policy(hc.SetModelPolicyRequest(name="mlp", has_weight=True, weight=2)),
        lambda s: s.set_model_residency(hc.SetModelResidencyRequest(name="mlp", target=hc.Residency.DEVICE)),
        lambda s: s.compact_memory(hc.CompactMemoryRequest(reload_models=["pool", "mlp"])),
    )
    assert_control_refused(busy, calls, Status.NOT_FOUND, "unknown model: 'mlp'")
    client.load_model("mlp")
    client.close()
    assert_serves(busy.url)


def test_the_actors_answer_control_that_raced_past_the_check(busy: ServerThread) -> None:
    """A control message naming a model the dispatcher and the weight cache no longer hold (it
    was unloaded after `Worker` checked) is answered NOT_FOUND by the actor, which serves on.
    The messages are put straight into the dispatcher's inbox: through the RPCs the per-model
    order makes this race impossible."""

    async def ask(message: Any) -> object:
        send, receive = trio.open_memory_channel[outcome.Outcome[object]](1)
        busy.worker._dispatcher.send_nowait(message(send))
        with trio.fail_after(10):
            reply = await receive.receive()
        return reply.error if isinstance(reply, outcome.Error) else reply

    for message in (
        lambda reply: SetPolicy("gone", 2.0, None, reply),
        lambda reply: SetResidency("gone", "device", reply),
        lambda reply: Compact(("pool", "gone"), reply),
    ):
        reply = busy.call(ask, message)
        assert isinstance(reply, ModelNotFound), reply
        assert str(reply) == "Request for unknown model: 'gone' is not found: it was unloaded"
    assert_serves(busy.url)


def test_the_last_words_of_a_replaced_queue_do_not_strand_its_successor(tmp_path: Path) -> None:
    """After a reload the old queue may still report (a client of one of its requests went
    away before it was retired): its 'I am empty' must not make the dispatcher forget the
    request waiting in the new queue, which would then wait for its deadline. The old queue's
    report is put straight into the dispatcher's inbox, as the race would deliver it."""
    settings = {"mlp": ModelSettings(max_queue_delay_us=100_000)}  # holds a partial batch 0.1 s
    with start_worker(make_config(_repository(tmp_path), scheduler={"models": settings})) as server:
        client = grpcclient.InferenceServerClient(server.url)
        old = server.call(lambda: server.worker.models["mlp"].queue)
        client.load_model("mlp")  # a new queue takes the name
        results: list[str] = []
        waiting = threading.Thread(target=lambda: results.append(_mlp(client)))
        waiting.start()
        deadline = time.monotonic() + 10
        while server.call(lambda: server.worker.statistics["mlp"].queue_depth) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        empty = QueueSummary("mlp", 0, 0, 0, math.inf, None, math.inf, queue=old)
        server.call(server.worker._dispatcher.send_nowait, empty)
        waiting.join(3)
        assert results == ["OK"]
        client.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point
def test_an_actor_that_fails_ends_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor bug cannot be produced from outside (each message that fails is answered and
    the actor carries on), so one is injected: the dispatcher's selection raises once a pool
    request waits. The worker must stop, saying why, and close its port, instead of serving on
    with nobody dispatching (requests would queue forever behind a port that still answers)."""

    def broken(*args: Any) -> str | None:
        raise RuntimeError("injected dispatcher bug")

    config = make_config(_repository(tmp_path), shutdown_grace_s=1.0)
    server = start_worker(config)
    port = server.worker.grpc_port
    assert_serves(server.url)
    monkeypatch.setattr("hloserve.actors.dispatcher.select", broken)
    with structlog.testing.capture_logs() as logs:
        client = grpcclient.InferenceServerClient(server.url)
        images = grpcclient.InferInput("IMAGE", [1, 224, 224, 3], "FP32")
        images.set_data_from_numpy(np.ones((1, 224, 224, 3), np.float32))
        with pytest.raises(InferenceServerException) as raised:
            client.infer("pool", [images], client_timeout=20)
        client.close()
        server._thread.join(20)  # by itself: nobody asked it to stop
    assert not server._thread.is_alive(), "the worker serves on with a dead dispatcher"
    ended = server._started.get_nowait()  # what `serve` raised: `hloserve serve` exits with it
    assert isinstance(ended, BaseExceptionGroup), ended
    assert ended.subgroup(lambda e: str(e) == "injected dispatcher bug") is not None, ended
    assert raised.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"), raised.value
    failed = [e for e in logs if e["event"] == "actor failed; the worker stops"]
    assert [e["actor"] for e in failed] == ["dispatcher"]
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
