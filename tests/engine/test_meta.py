"""Meta models on a live server: chaining with a branch, load, deadlines, the gate, scratch."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from support.bundles import PARAMS, affine, write_affine, write_total
from support.clients import infer, wait_until
from support.numerics import assert_close, close
from support.servers import ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.actors.messages import Batch, Infer, Take
from hloserve.actors.model_queue import ModelQueue, QueueSettings
from hloserve.engine.statistics import Statistics
from hloserve.errors import InvalidInput

CASCADE_PY = """
import numpy as np
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    x = inputs[0].data
    first = call("first", [NamedTensor("INPUT", x)])[0].data
    if first.mean() > 5.0:  # a data-dependent branch: only then is the second model worth it
        again = np.concatenate([first, first.sum(axis=1, keepdims=True)], axis=1)
        score = call("second", [NamedTensor("INPUT", again)], requested_outputs=["OUTPUT"])[0].data
        path = np.ones((x.shape[0], 1), np.int64)
    else:
        score, path = -first, np.zeros((x.shape[0], 1), np.int64)
    return [NamedTensor("score", score), NamedTensor("path", path)]

register_meta_model("cascade", run=run)
"""

SLOW_PY = """
import time
import numpy as np
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    x = inputs[0].data
    time.sleep(float(x[0, 0]))
    return [NamedTensor("score", call("first", [NamedTensor("INPUT", x)])[0].data)]

register_meta_model("slow", run=run)
"""

SCRATCH_PY = """
import numpy as np
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    x = inputs[0].data
    staged, spare = call.scratch([(x.shape, np.float32), ((16,), np.int64)])
    staged[...] = x * 2
    if x[0, 0] < 0:
        call.scratch((4,), np.float32)  # a second scratch in one request is refused
    if x[0, 0] > 100:
        call("second", [NamedTensor("INPUT", x)])  # not in meta.calls
    return [NamedTensor("score", call("first", [NamedTensor("INPUT", staged)])[0].data)]

register_meta_model("scratchy", run=run)
"""

TOTALS_PY = """
import numpy as np
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    x = inputs[0].data
    total = call("total", [NamedTensor("X", x)])[0].data  # no batch axis: at most 2 rows per call
    return [NamedTensor("score", np.tile(total, (len(x), 1)))]

register_meta_model("totals", run=run)
"""

NESTED_PY = """
from hloserve import register_meta_model
register_meta_model("nested", run=lambda inputs, call: call("cascade", inputs))
"""


def _meta(directory: Path, calls: list[str], source: str, outputs: dict[str, tuple[str, int]]) -> None:
    directory.mkdir()
    manifest = {
        "format_version": "2.0",
        "kind": "meta",
        "meta": {"calls": calls},
        "client_inputs": [{"name": "x", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
        "client_outputs": [
            {"name": name, "dtype": dtype, "shape": "kn", "dims": {"k": size}}
            for name, (dtype, size) in outputs.items()
        ],
    }
    (directory / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (directory / "model.py").write_text(source)


@pytest.fixture(scope="module", name="metas", params=[0, 2], ids=["frontends0", "frontends2"])
def _metas(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """The meta models on one process, and on an engine with two frontends (a meta model's calls
    go to the engine whole)."""
    repository = tmp_path_factory.mktemp("metas")
    write_affine(repository / "first", batch_sizes=(1, 2, 4))
    write_affine(repository / "second", batch_sizes=(1, 2, 4))
    write_affine(repository / "other")
    _meta(repository / "cascade", ["first", "second"], CASCADE_PY, {"score": ("f32", 3), "path": ("i64", 1)})
    _meta(repository / "slow", ["first"], SLOW_PY, {"score": ("f32", 3)})
    _meta(repository / "scratchy", ["first"], SCRATCH_PY, {"score": ("f32", 3)})
    _meta(repository / "nested", ["cascade"], NESTED_PY, {"score": ("f32", 3), "path": ("i64", 1)})
    write_total(repository / "total")
    _meta(repository / "totals", ["total"], TOTALS_PY, {"score": ("f32", 4)})
    config = make_config(repository, meta_concurrency=1, meta_scratch_bytes=1 << 16, meta_scratch_slots=4)
    with start_worker(config, frontends=request.param) as server:
        yield server


@pytest.fixture(name="client")
def _client(metas: ServerThread) -> Any:
    client = grpcclient.InferenceServerClient(metas.url)
    yield client
    client.close()


def cascade(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first = affine(PARAMS, x)
    if first.mean() > 5.0:
        second = affine(PARAMS, np.concatenate([first, first.sum(axis=1, keepdims=True)], axis=1))
        return second, np.ones((len(x), 1), np.int64)
    return -first, np.zeros((len(x), 1), np.int64)


def test_a_meta_model_chains_two_models_with_a_branch(client: Any) -> None:
    for x, path in ((np.full((2, 4), 3.0, np.float32), 1), (np.zeros((3, 4), np.float32), 0)):
        result = infer(client, "cascade", {"x": x})
        score, want_path = cascade(x)
        assert (result.as_numpy("path") == path).all()
        np.testing.assert_array_equal(result.as_numpy("path"), want_path)
        assert_close(result.as_numpy("score"), score)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_meta_model_answers_over_rest(metas: ServerThread, binary: bool) -> None:
    """A REST request's tensors are views of its body; forwarded whole to the engine (K=2) they
    go with it."""
    x = np.full((2, 4), 3.0, np.float32)
    with closing(httpclient.InferenceServerClient(metas.http_url)) as client:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        result = client.infer("cascade", [tensor])
    score, path = cascade(x)
    assert_close(result.as_numpy("score"), score)
    np.testing.assert_array_equal(result.as_numpy("path"), path)


def test_under_concurrent_load_every_answer_is_right(client: Any, metas: ServerThread) -> None:
    rng = np.random.RandomState(3)
    inputs = [rng.uniform(-2, 5, (int(rng.randint(1, 5)), 4)).astype(np.float32) for _ in range(60)]
    direct = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    direct.set_data_from_numpy(np.ones((1, 4), np.float32))
    stop = threading.Event()
    direct_calls = []

    def hammer_first() -> None:  # the sub-models serve their own traffic meanwhile
        own = grpcclient.InferenceServerClient(metas.url)
        for _ in range(500):
            if stop.is_set():
                break
            direct_calls.append(own.infer("first", [direct]).as_numpy("OUTPUT"))
        own.close()

    def one(x: np.ndarray) -> None:
        own = grpcclient.InferenceServerClient(metas.url)
        result = infer(own, "cascade", {"x": x})
        own.close()
        score, path = cascade(x)
        np.testing.assert_array_equal(result.as_numpy("path"), path)
        assert_close(result.as_numpy("score"), score)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        background = pool.submit(hammer_first)
        for future in [pool.submit(one, x) for x in inputs]:
            future.result()
        stop.set()
        background.result()
    assert direct_calls and all(close(o, affine(PARAMS, np.ones((1, 4)))) for o in direct_calls)


def test_a_deadline_propagates_into_the_sub_calls(client: Any) -> None:
    x = np.full((1, 4), 0.4, np.float32)  # run sleeps 0.4 s, past the 0.2 s budget, then calls
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "slow", {"x": x}, timeout=200_000)  # Triton's timeout parameter, microseconds
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline" in raised.value.message()
    quick = np.full((1, 4), 0.0, np.float32)
    assert_close(infer(client, "slow", {"x": quick}).as_numpy("score"), affine(PARAMS, quick))


def _cascade_waits(client: Any) -> InferenceServerException | None:
    """A cascade request with a 0.15 s deadline: the error it ended with; None if it was served
    (the gate was free: the holder had not reached it yet)."""
    try:
        infer(client, "cascade", {"x": np.zeros((1, 4), np.float32)}, timeout=150_000)
    except InferenceServerException as e:
        return e
    return None


def test_the_gate_bounds_metas_in_flight_and_a_waiter_times_out(client: Any, metas: ServerThread) -> None:
    holder = np.full((1, 4), 2.0, np.float32)  # holds the only gate slot for 2 s
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(infer, grpcclient.InferenceServerClient(metas.url), "slow", {"x": holder})
        # served until the holder is through the gate (a loaded machine can take a while to
        # send it there), then every waiter times out
        started = time.monotonic()
        while (raised := _cascade_waits(client)) is None and time.monotonic() - started < 1.0:
            time.sleep(0.05)
        assert raised is not None, "no cascade request waited at the gate while the holder held it"
        assert raised.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "'cascade'" in raised.message()
        assert_close(held.result().as_numpy("score"), affine(PARAMS, holder))
    assert infer(client, "cascade", {"x": np.zeros((1, 4), np.float32)}).as_numpy("path")[0, 0] == 0


def test_scratch_is_carved_once_per_request_from_the_pool(client: Any) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert_close(infer(client, "scratchy", {"x": x}).as_numpy("score"), affine(PARAMS, x * 2))
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "scratchy", {"x": -np.ones((1, 4), np.float32)})
    assert raised.value.status() == "StatusCode.INTERNAL"
    assert "once per request" in raised.value.message()
    for _ in range(6):  # more requests than the pool's 4 slots: every slot came back
        assert_close(infer(client, "scratchy", {"x": x}).as_numpy("score"), affine(PARAMS, x * 2))


def test_an_undeclared_call_is_refused_with_the_fix(client: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "scratchy", {"x": np.full((1, 4), 200.0, np.float32)})
    assert raised.value.status() == "StatusCode.INTERNAL"
    assert "called undeclared model 'second'; add it to meta.calls of 'scratchy'" in raised.value.message()


def test_a_meta_may_not_call_a_meta_and_its_parts_are_not_listed(client: Any) -> None:
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["nested"].state == "UNAVAILABLE"
    assert "'cascade' is a meta model; a meta may not call a meta" in index["nested"].reason
    assert {"cascade", "slow", "scratchy", "other"} <= set(index)
    assert "first" not in index and "second" not in index  # parts of metas, as upstream
    assert client.is_model_ready("first")  # still addressable by name
    metadata = client.get_model_metadata("cascade")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("score", "FP32", [-1, 3]),
        ("path", "INT64", [-1, 1]),
    ]
    assert client.get_model_config("cascade").config.backend == "python"


def test_a_call_with_more_rows_than_the_model_can_run_is_refused_and_serving_goes_on(client: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "totals", {"x": np.ones((3, 4), np.float32)})
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = raised.value.message()
    assert "'total'" in message and "meta model 'totals' made 3 rows" in message
    assert "largest compiled batch size is 2" in message
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(
        infer(client, "totals", {"x": x}).as_numpy("score"), np.tile(x.sum(axis=0), (2, 1))
    )


def test_policy_and_residency_name_the_called_models_not_the_meta(metas: ServerThread, client: Any) -> None:
    with pytest.raises(InvalidInput, match="'cascade': it is a meta model; set the policy or residency"):
        metas.call(metas.worker.set_policy, "cascade", weight=2.0)
    metas.call(metas.worker.set_policy, "first", weight=2.0)  # its parts take a policy
    assert infer(client, "cascade", {"x": np.zeros((1, 4), np.float32)}).as_numpy("path")[0, 0] == 0


def test_meta_statistics_count_requests_and_learn_its_cost(client: Any, metas: ServerThread) -> None:
    before = client.get_inference_statistics("cascade").model_stats[0]
    infer(client, "cascade", {"x": np.zeros((2, 4), np.float32)})
    after = client.get_inference_statistics("cascade").model_stats[0]
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_count == before.inference_count + 2
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    cost = metas.call(lambda: dict(metas.worker.statistics["cascade"].cost))
    assert set(cost) == {0} and 0 < cost[0] < 10, cost  # upstream keeps a meta's cost at size 0


def test_sub_calls_go_ahead_of_waiting_requests_in_their_own_order() -> None:
    async def main() -> list[str]:
        dispatcher_send, dispatcher_receive = trio.open_memory_channel[object](100)
        queue = ModelQueue("m", QueueSettings((1,), True, 16), dispatcher_send, Statistics())
        batches_send, batches_receive = trio.open_memory_channel[Batch](1)
        order = []
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(queue.run)
            for name, committed in (("a", False), ("b", False), ("c", True), ("d", True), ("e", False)):
                request = Infer(
                    "m", [np.zeros((1, 4))], 1, [0], concurrent.futures.Future(), time.monotonic()
                )
                request.committed = committed
                request.model = name  # labels the request in this test
                handle.submit_nowait(request)
            for _ in range(5):
                await handle.take(Take(batches_send))
                batch = await batches_receive.receive()
                order.extend(r.model for r in batch.requests)
            nursery.cancel_scope.cancel()
        dispatcher_receive.close()
        return order

    assert trio.run(main) == ["c", "d", "a", "b", "e"]


DOZY_PY = """
import time
from hloserve import NamedTensor, register_meta_model

def run(inputs, call):
    time.sleep(float(inputs[0].data[0, 0]))  # calls nothing: it bypasses the gate, not meta_threads
    return [NamedTensor("score", inputs[0].data)]

register_meta_model("dozy", run=run)
"""

DOZE_S = 6.0
"""Long enough that a loaded machine (the long suite on two cores) holds the request within half
of it; a run given up answers in far less."""
ONES = np.ones((1, 4), np.float32)


@pytest.fixture(name="dozy", params=[0, 2], ids=["frontends0", "frontends2"])
def _dozy(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """One request in flight at a time, one meta thread: a run the server did not let go of
    would hold the one, a run it abandoned holds the other."""
    write_affine(tmp_path / "first")
    _meta(tmp_path / "dozy", [], DOZY_PY, {"score": ("f32", 4)})
    config = make_config(tmp_path, max_inflight_requests=1, meta_threads=1)
    with start_worker(config, frontends=request.param) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield client
        client.close()


def _doze(client: Any, seconds: float, **kwargs: Any) -> Any:
    return infer(client, "dozy", {"x": np.full((1, 4), seconds, np.float32)}, **kwargs)


def _held(client: Any) -> bool:
    """Whether the server holds a request (max_inflight_requests is 1: the next is refused)."""
    try:
        infer(client, "first", {"INPUT": ONES})
    except InferenceServerException as e:
        return e.status() == "StatusCode.UNAVAILABLE"
    return False


def _cancelled_once(client: Any) -> str | None:
    """A dozy request cancelled by its client once the server holds it: the status it ends with;
    None where the probe asking whether it is held reached the server first and the dozy request
    was refused (max_inflight_requests is 1)."""
    tensor = grpcclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), DOZE_S, np.float32))
    ended: queue.Queue[Any] = queue.Queue()
    context = client.async_infer("dozy", [tensor], lambda result, error: ended.put(error))
    wait_until(lambda: not ended.empty() or _held(client), DOZE_S / 2, "the server to hold the dozy request")
    if not ended.empty():
        refused = ended.get()
        assert refused is not None and refused.status() == "StatusCode.UNAVAILABLE", refused
        return None
    context.cancel()
    return str(ended.get(timeout=DOZE_S).status())


def _cancelled(client: Any, tries: int = 5) -> str:
    for _ in range(tries):
        if (status := _cancelled_once(client)) is not None:
            return status
    raise AssertionError(f"the dozy request was refused {tries} times in a row")


GIVE_UP = {
    "Triton's timeout, the server's deadline": lambda client: _doze(client, DOZE_S, timeout=300_000),
    "the client's gRPC deadline": lambda client: _doze(client, DOZE_S, client_timeout=0.3),
    "the client's cancel": _cancelled,
}


@pytest.mark.slow
@pytest.mark.serial  # waits for a held run with a timeout: alone
def test_a_meta_request_given_up_answers_at_once_and_its_run_finishes_in_a_held_thread(dozy: Any) -> None:
    for way, give_up in GIVE_UP.items():
        started = time.monotonic()
        try:
            status = give_up(dozy)
        except InferenceServerException as e:
            status = e.status()
        expected = "StatusCode.CANCELLED" if way == "the client's cancel" else "StatusCode.DEADLINE_EXCEEDED"
        assert status == expected, way
        assert time.monotonic() - started < DOZE_S / 2, way
        # the handler let go (max_inflight_requests is 1): the next request is served long
        # before the run ends (a cancelled handler lets go a moment after the client leaves)
        wait_until(
            lambda: close(infer(dozy, "first", {"INPUT": ONES}).as_numpy("OUTPUT"), affine(PARAMS, ONES)),
            DOZE_S / 2,
            f"the next request served after {way}",
        )
        # the abandoned run still holds the one meta thread (server.meta_threads)
        with pytest.raises(InferenceServerException) as raised:
            _doze(dozy, 0.0, timeout=200_000)
        assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED", way
        assert "'dozy'" in raised.value.message()
        wait_until(lambda: _doze(dozy, 0.0, timeout=1_000_000), 2 * DOZE_S, "the abandoned run's thread back")
