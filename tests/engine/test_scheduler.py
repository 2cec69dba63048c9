"""The scheduler on a live server: coalescing, fair shares, deadlines, admission, cancellation.

One process: the scheduler is the engine's, the same with frontends; max_inflight_requests and
admission across frontends are tested in tests/frontends/test_engine_calls.py and hostile/test_fairness.py.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import export_examples
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import write_heavy
from support.clients import infer
from support.numerics import assert_close
from support.servers import EXAMPLES, ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import ModelSettings

pytestmark = pytest.mark.serial  # asserts on timing, or floods the machine


def _outcome(call: Any) -> str:
    try:
        call()
        return "OK"
    except InferenceServerException as e:
        return str(e.status()).removeprefix("StatusCode.")


def _stats(client: Any, model: str) -> Any:
    return client.get_inference_statistics(model).model_stats[0]


@pytest.fixture(name="twins")
def _twins(tmp_path: Path) -> Path:
    """Two identical models, `a` and `b`, each a few milliseconds per execution."""
    for name in ("a", "b"):
        write_heavy(tmp_path / name, 6)
    return tmp_path


def test_concurrent_requests_coalesce_and_stay_correct() -> None:
    config = make_config(scheduler={"models": {"mlp": ModelSettings(max_queue_delay_us=20_000)}})
    with start_worker(config) as server:
        clients = [grpcclient.InferenceServerClient(server.url) for _ in range(12)]
        rng = np.random.default_rng(11)
        inputs = [rng.random((1 + i % 3, 16), dtype=np.float32) for i in range(48)]
        with ThreadPoolExecutor(12) as pool:
            results = list(
                pool.map(lambda i: infer(clients[i % 12], "mlp", {"INPUT0": inputs[i]}), range(len(inputs)))
            )
        for x, result in zip(inputs, results, strict=True):
            assert_close(result.as_numpy("OUTPUT0"), export_examples.reference("mlp", x))
        stats = _stats(clients[0], "mlp")
        assert stats.inference_count == sum(len(x) for x in inputs)
        assert stats.execution_count < len(inputs)  # requests were joined
        assert any(b.batch_size > 1 and b.compute_infer.count for b in stats.batch_stats)
        for client in clients:
            client.close()


def _saturate(url: str, models: dict[str, int], seconds: float) -> dict[str, int]:
    """Keep `threads` requests in flight per model for `seconds`; returns dispatches per model."""
    stop = time.monotonic() + seconds
    counted: Counter[str] = Counter()

    def loop(model: str) -> None:
        client = grpcclient.InferenceServerClient(url)
        x = np.ones((1, 256), np.float32)
        while time.monotonic() < stop:
            infer(client, model, {"INPUT0": x})
            counted[model] += 1
        client.close()

    threads = [threading.Thread(target=loop, args=(m,)) for m, n in models.items() for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return dict(counted)


def _compute_s(client: Any, model: str) -> float:
    """The model's compute seconds so far, as the scheduler counts them (input placement and
    execution, the `compute_input` and `compute_infer` of its statistics)."""
    stats = _stats(client, model).inference_stats
    return (stats.compute_input.ns + stats.compute_infer.ns) / 1e9


def _shares(url: str, client: Any, seconds: float) -> tuple[float, dict[str, int]]:
    """Both models saturated for `seconds`: b's share of the compute, and the dispatches of each."""
    before = {m: (_stats(client, m).execution_count, _compute_s(client, m)) for m in ("a", "b")}
    _saturate(url, {"a": 6, "b": 6}, seconds)
    counts = {m: _stats(client, m).execution_count - before[m][0] for m in ("a", "b")}
    compute = {m: _compute_s(client, m) - before[m][1] for m in ("a", "b")}
    return compute["b"] / (compute["a"] + compute["b"]), counts


@pytest.mark.slow
def test_weights_one_to_three_give_compute_shares_one_to_three(twins: Path) -> None:
    """Both models saturated: their compute seconds split 1:3 within 5%, as fair share promises.

    The shares are of measured compute, not of dispatches: the server runs in this process, beside
    12 client threads, and an execution's measured seconds include its wait for the GIL, so two
    identical models' learned costs can differ by half on a busy machine (CI once saw dispatches
    split 16:84 while compute split by the weights).
    """
    settings = {"a": ModelSettings(weight=1), "b": ModelSettings(weight=3)}
    with start_worker(make_config(twins, scheduler={"models": settings, "ema_halflife_s": 2.0})) as server:
        client = grpcclient.InferenceServerClient(server.url)
        _saturate(server.url, {"a": 6, "b": 6}, 2.0)  # reach the steady state first
        share_b, counts = _shares(server.url, client, 6.0)
        assert share_b == pytest.approx(0.75, abs=0.05), counts
        assert min(counts.values()) > 20, counts  # both ran throughout

        # Live policy: equal weights now give equal shares.
        server.call(server.worker.set_policy, "b", weight=1.0)
        _saturate(server.url, {"a": 6, "b": 6}, 2.0)
        share_b, counts = _shares(server.url, client, 5.0)
        assert share_b == pytest.approx(0.5, abs=0.05), counts
        assert min(counts.values()) > 20, counts
        client.close()


@pytest.fixture(name="held")
def _held() -> Any:
    """A server whose mlp queue holds a lone row for 300 ms waiting for more, and queues at most 3."""
    settings = {"mlp": ModelSettings(max_queue_delay_us=300_000, max_queue_depth=3)}
    with start_worker(make_config(scheduler={"models": settings})) as server:
        client = grpcclient.InferenceServerClient(server.url)
        yield server, client
        client.close()


def _executing_slow(server: ServerThread, pool: ThreadPoolExecutor) -> Any:
    """A request to the `slow` model, from `pool`, returned once it has left its queue (it is
    executing)."""
    slow = pool.submit(
        infer, grpcclient.InferenceServerClient(server.url), "slow", {"INPUT0": np.ones((1, 256), np.float32)}
    )
    deadline = time.monotonic() + 10
    while server.call(lambda: server.worker.statistics["slow"].queue.count) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return slow


def test_a_deadline_that_expires_in_the_queue(tmp_path: Path) -> None:
    """While a slow execution holds the dispatcher, a queued request's deadline passes: dropped."""
    write_heavy(tmp_path / "slow", 150)
    shutil.copytree(EXAMPLES / "mlp", tmp_path / "mlp")
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        before = _stats(client, "mlp")
        with ThreadPoolExecutor(1) as pool:
            slow = _executing_slow(server, pool)
            x = np.ones((1, 16), np.float32)
            with pytest.raises(InferenceServerException) as raised:
                infer(
                    client, "mlp", {"INPUT0": x}, timeout=5_000
                )  # Triton's `timeout` parameter, microseconds
            assert slow.result().as_numpy("output_0").shape == (1, 256)
        assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "model 'mlp': deadline passed" in raised.value.message()
        assert "request dropped" in raised.value.message()
        assert _stats(client, "mlp").execution_count == before.execution_count
        drops = server.call(lambda: dict(server.worker.statistics["mlp"].drops))
        assert drops == {"deadline": 1}
        assert_close(
            infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0"), export_examples.reference("mlp", x)
        )
        client.close()


def test_an_expensive_execution_runs_off_the_event_loop(tmp_path: Path) -> None:
    """A batch expected to cost more than the dispatcher's inline limit runs in a worker thread:
    while it runs, the front end keeps answering (a cheap one runs on the loop's own thread)."""
    write_heavy(tmp_path / "slow", 4000)  # about 0.6 s
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        with ThreadPoolExecutor(1) as pool:
            slow = _executing_slow(server, pool)
            assert client.is_server_live()
            assert client.get_model_metadata("slow").name == "slow"
            assert not slow.done(), "the front end waited for the execution"
            assert slow.result().as_numpy("output_0").shape == (1, 256)
        client.close()


def test_queue_full_is_unavailable_and_names_the_limit(held: Any) -> None:
    _, client = held
    clients = [grpcclient.InferenceServerClient(held[0].url) for _ in range(6)]
    x = np.ones((1, 16), np.float32)
    with ThreadPoolExecutor(6) as pool:
        futures = []
        for c in clients:
            futures.append(pool.submit(_outcome, lambda c=c: infer(c, "mlp", {"INPUT0": x})))
            time.sleep(0.02)
        outcomes = Counter(f.result() for f in futures)
    assert outcomes["UNAVAILABLE"] >= 1 and outcomes["OK"] >= 3, outcomes
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}
    with pytest.raises(InferenceServerException, match="max_queue_depth"):
        with ThreadPoolExecutor(5) as pool:
            list(pool.map(lambda c: infer(c, "mlp", {"INPUT0": x}), clients[:5]))
    for c in clients:
        c.close()
    assert_close(infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0"), export_examples.reference("mlp", x))


def test_a_cancelled_request_never_executes(held: Any) -> None:
    server, client = held
    before = _stats(client, "mlp")
    x = np.ones((1, 16), np.float32)
    with pytest.raises(InferenceServerException) as raised:
        infer(client, "mlp", {"INPUT0": x}, client_timeout=0.1)  # the client gives up while it is queued
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    time.sleep(0.5)  # past the 300 ms hold: it would have run by now
    after = _stats(client, "mlp")
    assert after.execution_count == before.execution_count
    assert after.inference_count == before.inference_count
    drops = server.call(lambda: dict(server.worker.statistics["mlp"].drops))
    assert drops.get("cancelled", 0) + drops.get("deadline", 0) >= 1
    assert_close(infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0"), export_examples.reference("mlp", x))


@pytest.mark.slow
def test_ten_times_overload_answers_everyone_and_stays_responsive() -> None:
    """40 clients against a cap of 4 in flight: every call gets OK or UNAVAILABLE; health stays up."""
    with start_worker(make_config(max_inflight_requests=4)) as server:
        clients = [grpcclient.InferenceServerClient(server.url) for _ in range(40)]
        x = np.ones((2, 16), np.float32)

        def burst(c: Any) -> list[str]:
            return [
                _outcome(lambda: infer(c, "cnn", {"IMAGE": np.ones((4, 16, 16, 3), np.float32)}))
                for _ in range(10)
            ]

        with ThreadPoolExecutor(40) as pool:
            outcomes = Counter(o for result in pool.map(burst, clients) for o in result)
        assert sum(outcomes.values()) == 400
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
        assert outcomes["OK"] > 0 and outcomes["UNAVAILABLE"] > 0, outcomes
        assert clients[0].is_server_live()
        assert_close(
            infer(clients[0], "mlp", {"INPUT0": x}).as_numpy("OUTPUT0"), export_examples.reference("mlp", x)
        )
        for c in clients:
            c.close()
