"""The worker as a whole: embedded in a trio program, as the `hloserve` binary, and its metrics.

One process: it tests the worker's composition, embedding and signals; the engine with frontends
has its own in tests/frontends/test_processes.py.
"""

from __future__ import annotations

import gc
import signal
import socket
import sys
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio_asyncio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from support.clients import infer, wait_until
from support.numerics import assert_close
from support.servers import EXAMPLES, ServerThread, make_config, start_worker

from hloserve.allocator import settle_heap
from hloserve.client import Client
from hloserve.worker import serve

sys.path.insert(0, str(EXAMPLES.parent))
import export_examples


def test_embedded_in_a_trio_nursery_and_cancelled_cleanly() -> None:
    """`async with serve(config)` inside a caller's nursery; cancelling the scope stops it."""

    async def main() -> None:
        async with trio_asyncio.open_loop():
            with trio.fail_after(120):
                async with serve(make_config()) as worker:
                    assert worker.grpc_port > 0 and worker.metrics_port
                    client = Client("127.0.0.1", worker.grpc_port)
                    call = trio_asyncio.aio_as_trio
                    assert await call(client.is_server_live)()
                    assert await call(client.is_server_ready)()
                    assert await call(client.is_model_ready)("mlp")
                    assert (await call(client.server_metadata)()).name == "hloserve"
                    assert [t.shape for t in (await call(client.model_metadata)("cnn")).inputs] == [
                        [-1, 16, 16, 3]
                    ]
                    assert (await call(client.model_config)("mlp")).max_batch_size == 16
                    index = await call(client.repository_index)(True)
                    assert [m.name for m in index.models] == ["cnn", "mlp", "pool", "severity_grader"]
                    x = np.random.default_rng(1).random((5, 16), dtype=np.float32)
                    out = await call(client.infer)("mlp", {"INPUT0": x}, timeout=10)
                    assert_close(out["OUTPUT0"], export_examples.reference("mlp", x))
                    stats = await call(client.model_statistics)("mlp")
                    assert stats.model_stats[0].inference_count == 5
                    with pytest.raises(GRPCError) as raised:
                        await call(client.infer)("mlp", {"INPUT0": x.astype(np.float64)})
                    assert raised.value.status == Status.INVALID_ARGUMENT
                    client.close()

                    # Cancel the worker's scope from outside, as an embedding program would.
                    with trio.move_on_after(0.5) as scope:
                        await trio.sleep_forever()
                    assert scope.cancelled_caught
            port = worker.grpc_port
        # the port is free again: the worker is gone
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", port))

    trio.run(main)


def test_cancelling_the_scope_mid_request_answers_the_client() -> None:
    """Requests in flight when the embedding scope is cancelled get a status, never a hang."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    outcomes: list[str] = []

    def client_loop(port: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = grpcclient.InferInput("IMAGE", [4, 16, 16, 3], "FP32")
        tensor.set_data_from_numpy(np.zeros((4, 16, 16, 3), np.float32))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                client.infer("cnn", [tensor], client_timeout=20)
                outcomes.append("OK")
            except InferenceServerException as e:
                outcomes.append(str(e.status()))
                break
        client.close()

    async def main() -> None:
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            with trio.CancelScope() as worker_scope:
                async with serve(make_config()) as worker:
                    nursery.start_soon(trio.to_thread.run_sync, client_loop, worker.grpc_port)
                    with trio.fail_after(30):
                        while outcomes.count("OK") < 3:
                            await trio.sleep(0.05)
                    worker_scope.cancel()
                    await trio.sleep_forever()

    with_timeout = time.monotonic()
    trio.run(main)
    assert time.monotonic() - with_timeout < 90
    assert outcomes[-1] in ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"), outcomes[-3:]
    assert "StatusCode.DEADLINE_EXCEEDED" not in outcomes


def test_a_connection_its_client_keeps_open_is_closed_when_the_worker_stops() -> None:
    """A peer that never answers the shutdown's GOAWAY is hung up on when the worker stops, so
    that no connection outlives the worker's event loop."""
    with start_worker(make_config(EXAMPLES, http_port=-1, shutdown_grace_s=1.0)) as server:
        peer = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5)
        peer.sendall(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
        )  # preface, SETTINGS
        assert peer.recv(1 << 16)  # the server's SETTINGS: the connection is served
    with peer:
        received = b""
        for _ in range(100):  # bounded: GOAWAY and the server's end of the stream
            data = peer.recv(1 << 16)
            if not data:
                break
            received += data
        assert not data, "the server kept its side of the connection open after it stopped"


def test_metrics_endpoint_counts_requests(server: ServerThread, triton: Any) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
    tensor.set_data_from_numpy(np.zeros((2, 16), np.float32))
    triton.infer("mlp", [tensor])
    with pytest.raises(InferenceServerException, match="unknown model: 'nope'"):
        triton.infer("nope", [tensor])
    url = f"http://127.0.0.1:{server.worker.metrics_port}/metrics"
    refused = 'hloserve_requests_total{model="<unknown>",status="NOT_FOUND"}'

    def scrape() -> str:
        return urllib.request.urlopen(url, timeout=10).read().decode()

    # at K=2 the frontend that refused the call sends its counts to the engine a moment later
    wait_until(lambda: refused in scrape(), 10, "the refused call counted")
    text = scrape()
    assert 'hloserve_requests_total{model="mlp",status="OK"}' in text
    assert refused in text
    assert 'hloserve_request_duration_seconds_bucket{le="0.0005",model="mlp"}' in text
    assert 'hloserve_inference_rows_total{model="mlp"}' in text
    assert 'hloserve_queue_depth{model="mlp"} 0.0' in text
    for quantile in ("0.5", "0.99"):
        assert f'hloserve_queue_wait_seconds{{model="mlp",quantile="{quantile}"}}' in text
    assert "hloserve_models_loaded 4.0" in text
    assert 'hloserve_model_resident{model="mlp"} 1.0' in text
    assert 'hloserve_weight_loads_total{model="mlp"} 1.0' in text
    assert 'hloserve_weight_prefetches_total{model="mlp"} 0.0' in text
    assert 'hloserve_model_host_pinned{model="mlp"} 0.0' in text  # a CPU: pageable by default
    assert "hloserve_compactions_total 0.0" in text
    assert "hloserve_device_memory" not in text  # the CPU backend keeps no allocator statistics


def test_metrics_carry_triton_s_names_and_agree_with_the_statistics(
    server: ServerThread, triton: Any
) -> None:
    """A dashboard written for Triton reads the same quantities under the same names and labels,
    equal to what the statistics extension reports (Triton derives both from one record)."""
    import tritonclient.grpc as grpcclient
    from prometheus_client.parser import text_string_to_metric_families

    tensor = grpcclient.InferInput("INPUT0", [3, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((3, 16), np.float32))
    for _ in range(3):
        triton.infer("mlp", [tensor])
    url = f"http://127.0.0.1:{server.worker.metrics_port}/metrics"

    def read() -> tuple[dict[str, float], dict[str, Any]]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        found = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("nv_") and sample.labels == {"model": "mlp", "version": "1"}
        }
        return found, triton.get_inference_statistics("mlp", as_json=True)["model_stats"][0]

    # at K=2 the frontends send their counts to the engine a moment after they answer
    wait_until(
        lambda: (
            (pair := read())[0].get("nv_inference_request_success")
            == int(pair[1]["inference_stats"]["success"]["count"])
        ),
        10,
        "the metrics and the statistics to agree",
    )
    metrics, stats = read()
    timed = stats["inference_stats"]
    assert metrics["nv_inference_request_success"] >= 3
    assert metrics["nv_inference_request_success"] == int(timed["success"]["count"])
    assert metrics["nv_inference_request_failure"] == int(timed["fail"].get("count", 0))
    assert metrics["nv_inference_count"] == int(stats["inference_count"]) >= 9
    assert metrics["nv_inference_exec_count"] == int(stats["execution_count"]) >= 1
    assert metrics["nv_inference_request_duration_us"] == int(timed["success"]["ns"]) // 1000 > 0
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert metrics[f"nv_inference_{phase}_duration_us"] == int(timed[phase].get("ns", 0)) // 1000
    assert metrics["nv_inference_compute_infer_duration_us"] > 0
    assert metrics["nv_inference_pending_request_count"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_binary_serves_and_shuts_down_on_signal(tmp_path: Path, signum: int) -> None:
    """`hloserve serve` starts on the example repository, answers, and exits 0 on a signal."""
    import tritonclient.grpc as grpcclient

    env = {"HLOSERVE_SERVER_SHUTDOWN_GRACE_S": "5", "HLOSERVE_LOGGING_FORMAT": "json"}
    with start_worker(process="subprocess", repository=None, env=env) as server:
        client = grpcclient.InferenceServerClient(server.url)
        result = infer(client, "mlp", {"INPUT0": np.ones((1, 16), np.float32)})
        assert result.as_numpy("OUTPUT0").shape == (1, 4)
        client.close()
        server.process.send_signal(signum)
        returncode = server.process.wait(30)
        output = server.output()
    assert returncode == 0, output
    assert '"event": "listening"' in output and '"event": "stopped"' in output


def test_client_from_plain_asyncio(server: ServerThread) -> None:
    """hloserve's client needs no trio: it runs on a plain asyncio loop."""
    import asyncio

    async def main() -> dict[str, np.ndarray]:
        async with Client("127.0.0.1", server.worker.grpc_port) as client:
            assert await client.is_server_ready()
            return await client.infer("mlp", {"INPUT0": np.ones((2, 16), np.float32)}, timeout=10)

    out = asyncio.run(main())
    assert_close(out["OUTPUT0"], export_examples.reference("mlp", np.ones((2, 16), np.float32)))


def test_device_memory_gauges_from_allocator_statistics() -> None:
    """GPU allocator statistics (which a CPU cannot produce, so they are stood in for here)
    become the in-use, limit, peak, pool and free gauges; -1 means not supported."""
    from prometheus_client.registry import CollectorRegistry

    from hloserve.engine.metrics import _DeviceMemoryCollector

    stats = {"bytes_in_use": 300, "bytes_limit": 1000, "peak_bytes_in_use": 700, "pool_bytes": -1}
    registry = CollectorRegistry()
    registry.register(_DeviceMemoryCollector(lambda: stats))
    value = registry.get_sample_value
    assert value("hloserve_device_memory_in_use_bytes") == 300
    assert value("hloserve_device_memory_limit_bytes") == 1000
    assert value("hloserve_device_memory_peak_in_use_bytes") == 700
    assert value("hloserve_device_memory_free_bytes") == 700
    assert value("hloserve_device_memory_pool_bytes") is None


def test_settle_heap_freezes_startup_objects_and_new_cycles_are_still_collected() -> None:
    class Node:
        peer: Any = None

    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        made_later = Node()
        made_later.peer = made_later
        alive = weakref.ref(made_later)
        del made_later
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
