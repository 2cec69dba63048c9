"""Triton's system shared memory: tritonclient's own shared-memory utilities against the server."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

import export_examples
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from support.clients import assert_good_request_served
from support.numerics import assert_close
from support.servers import ServerThread
from tritonclient.utils import InferenceServerException

from hloserve.api.shm_registry import ShmRegistry
from hloserve.errors import ShmRegionError

X = np.random.default_rng(5).random((4, 16), dtype=np.float32)
IN_BYTES, OUT_BYTES = X.nbytes, 4 * 4 * 4


@pytest.fixture(name="client")
def _client(shm_server: ServerThread) -> Iterator[Any]:
    with closing(grpcclient.InferenceServerClient(shm_server.url)) as client:
        yield client
        client.unregister_system_shared_memory()


@pytest.fixture(name="regions")
def _regions() -> Iterator[dict[str, Any]]:
    key = f"/hloserve_test_{os.getpid()}"
    handles = {
        "in": shm.create_shared_memory_region("in", f"{key}_in", IN_BYTES + 64),
        "out": shm.create_shared_memory_region("out", f"{key}_out", OUT_BYTES + 64),
    }
    shm.set_shared_memory_region(handles["in"], [X])
    yield {"handles": handles, "in_key": f"{key}_in", "out_key": f"{key}_out"}
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def _request(*, input_in_shm: bool, output_in_shm: bool) -> tuple[list[Any], list[Any]]:
    tensor = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
    if input_in_shm:
        tensor.set_shared_memory("in", IN_BYTES)
    else:
        tensor.set_data_from_numpy(X)
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    if output_in_shm:
        output.set_shared_memory("out", OUT_BYTES)
    return [tensor], [output]


@pytest.mark.parametrize(("input_in_shm", "output_in_shm"), [(True, False), (False, True), (True, True)])
def test_shared_memory_results_equal_inline(
    client: Any, regions: Any, input_in_shm: bool, output_in_shm: bool
) -> None:
    client.register_system_shared_memory("in", regions["in_key"], IN_BYTES + 64)
    client.register_system_shared_memory("out", regions["out_key"], OUT_BYTES + 64)
    inputs, outputs = _request(input_in_shm=input_in_shm, output_in_shm=output_in_shm)
    result = client.infer("mlp", inputs, outputs=outputs)
    if output_in_shm:
        got = shm.get_contents_as_numpy(regions["handles"]["out"], np.float32, [4, 4])
        assert result.get_output("OUTPUT0").parameters["shared_memory_byte_size"].int64_param == OUT_BYTES
    else:
        got = result.as_numpy("OUTPUT0")
    assert_close(got, export_examples.reference("mlp", X))


def test_status_unregister_and_re_register(client: Any, regions: Any) -> None:
    client.register_system_shared_memory("in", regions["in_key"], IN_BYTES, offset=16)
    client.register_system_shared_memory("out", regions["out_key"], OUT_BYTES)
    status = client.get_system_shared_memory_status()
    assert {name: (r.key, r.offset, r.byte_size) for name, r in status.regions.items()} == {
        "in": (regions["in_key"], 16, IN_BYTES),
        "out": (regions["out_key"], 0, OUT_BYTES),
    }
    assert list(client.get_system_shared_memory_status("out").regions) == ["out"]
    _expect(  # as Triton: a registered name stays until unregistered
        lambda: client.register_system_shared_memory("in", regions["in_key"], IN_BYTES),
        "ALREADY_EXISTS",
        "region 'in': is already registered",
    )
    assert client.get_system_shared_memory_status("in").regions["in"].offset == 16
    client.unregister_system_shared_memory("in")
    assert list(client.get_system_shared_memory_status().regions) == ["out"]
    client.unregister_system_shared_memory("never-registered")  # unknown: fine, as Triton
    client.unregister_system_shared_memory()
    assert not client.get_system_shared_memory_status().regions


def _expect(call: Any, status: str, says: str) -> None:
    with pytest.raises(InferenceServerException) as raised:
        call()
    assert raised.value.status() == f"StatusCode.{status}", raised.value.message()
    assert says in raised.value.message()


def test_bad_registrations(client: Any, regions: Any) -> None:
    _expect(
        lambda: client.register_system_shared_memory("r", "/hloserve_no_such_key", 64),
        "INVALID_ARGUMENT",
        "cannot open shared-memory object '/hloserve_no_such_key'",
    )
    _expect(
        lambda: client.register_system_shared_memory("r", regions["in_key"], IN_BYTES + 65),
        "INVALID_ARGUMENT",
        f"offset 0 + byte_size {IN_BYTES + 65} exceeds the object's {IN_BYTES + 64} bytes",
    )
    _expect(
        lambda: client.register_system_shared_memory("r", regions["in_key"], 0),
        "INVALID_ARGUMENT",
        "byte_size 0",
    )
    _expect(  # as Triton
        lambda: client.get_system_shared_memory_status("nope"),
        "NOT_FOUND",
        "region 'nope': is not registered",
    )
    assert not client.get_system_shared_memory_status().regions


@pytest.mark.parametrize(
    ("region", "offset", "size", "says"),
    [
        ("nope", 0, IN_BYTES, "shared memory region 'nope': is not registered"),
        (
            "in",
            128,
            IN_BYTES,
            f"offset 128 + byte_size {IN_BYTES} exceeds the region's {IN_BYTES + 64} bytes",
        ),
        (
            "in",
            0,
            IN_BYTES - 4,
            f"shared_memory_byte_size is {IN_BYTES - 4}, shape [4, 16] of FP32 needs {IN_BYTES}",
        ),
    ],
)
def test_bad_input_references_touch_nothing(
    client: Any, regions: Any, region: str, offset: int, size: int, says: str
) -> None:
    client.register_system_shared_memory("in", regions["in_key"], IN_BYTES + 64)
    client.register_system_shared_memory("out", regions["out_key"], OUT_BYTES + 64)
    marker = np.full(4 * 4, 7.0, np.float32)
    shm.set_shared_memory_region(regions["handles"]["out"], [marker])
    tensor = grpcclient.InferInput("INPUT0", list(X.shape), "FP32")
    tensor.set_shared_memory(region, size, offset=offset)
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("out", OUT_BYTES)
    _expect(lambda: client.infer("mlp", [tensor], outputs=[output]), "INVALID_ARGUMENT", says)
    untouched = shm.get_contents_as_numpy(regions["handles"]["out"], np.float32, [16])
    np.testing.assert_array_equal(untouched, marker)
    assert_good_request_served(client)


def test_output_region_too_small_is_refused_before_running(client: Any, regions: Any) -> None:
    client.register_system_shared_memory("out", regions["out_key"], 32)
    before = client.get_inference_statistics("mlp").model_stats[0].execution_count
    inputs, outputs = _request(input_in_shm=False, output_in_shm=True)
    outputs[0].set_shared_memory("out", 32)
    _expect(
        lambda: client.infer("mlp", inputs, outputs=outputs),
        "INVALID_ARGUMENT",
        f"shared_memory_byte_size is 32, the output needs {OUT_BYTES} bytes",
    )
    assert client.get_inference_statistics("mlp").model_stats[0].execution_count == before
    assert_good_request_served(client)


def test_shared_memory_while_disabled(triton: Any, regions: Any) -> None:
    """The default server refuses client regions and says how to allow them."""
    _expect(
        lambda: triton.register_system_shared_memory("in", regions["in_key"], IN_BYTES),
        "FAILED_PRECONDITION",
        "--allow-client-shm",
    )
    inputs, _ = _request(input_in_shm=True, output_in_shm=False)
    _expect(lambda: triton.infer("mlp", inputs), "FAILED_PRECONDITION", "system shared memory is disabled")
    assert_good_request_served(triton)


def test_cuda_shared_memory_answers_as_triton_without_a_gpu(client: Any) -> None:
    """Status and unregister answer OK with nothing registered (clients clean up first);
    registering is refused, saying to use system shared memory."""
    assert not client.get_cuda_shared_memory_status().regions
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("never")
    _expect(lambda: client.get_cuda_shared_memory_status("never"), "NOT_FOUND", "not registered")
    _expect(
        lambda: client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64),
        "UNIMPLEMENTED",
        "use system shared memory",
    )
    assert_good_request_served(client)


def test_unregister_while_requests_are_in_flight(shm_server: ServerThread, regions: Any) -> None:
    """Unregistering and re-registering under load never crashes: calls succeed or are refused."""
    admin = grpcclient.InferenceServerClient(shm_server.url)
    admin.register_system_shared_memory("in", regions["in_key"], IN_BYTES + 64)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            admin.unregister_system_shared_memory("in")
            admin.register_system_shared_memory("in", regions["in_key"], IN_BYTES + 64)

    def call(_: int) -> str:
        client = grpcclient.InferenceServerClient(shm_server.url)
        outcomes = []
        for _ in range(25):
            inputs, _outputs = _request(input_in_shm=True, output_in_shm=False)
            try:
                result = client.infer("mlp", inputs)
                assert_close(result.as_numpy("OUTPUT0"), export_examples.reference("mlp", X))
                outcomes.append("OK")
            except InferenceServerException as e:
                assert e.status() == "StatusCode.INVALID_ARGUMENT", e.message()
                outcomes.append("INVALID_ARGUMENT")
        client.close()
        return ",".join(outcomes)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            outcomes = ",".join(pool.map(call, range(4))).split(",")
    finally:
        stop.set()
        churner.join(30)
    assert len(outcomes) == 100 and "OK" in outcomes
    admin.unregister_system_shared_memory()
    admin.close()
    assert_good_request_served(grpcclient.InferenceServerClient(shm_server.url))


def test_registry_bounds_are_checked_before_touching_memory(regions: Any) -> None:
    registry = ShmRegistry()
    region = registry.register("r", regions["in_key"], 64, IN_BYTES)
    # the region starts 64 bytes into the object, which holds X from its start
    np.testing.assert_array_equal(region.read(0, 64).view(np.float32), X.ravel()[16:32])
    region.write(0, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(region.read(0, 16).view(np.float32), np.arange(4))
    with pytest.raises(
        ShmRegionError, match=f"offset 8 \\+ byte_size {IN_BYTES} exceeds the region's {IN_BYTES} bytes"
    ):
        region.read(8, IN_BYTES)
    with pytest.raises(ShmRegionError, match="must not be negative"):
        region.write(-1, np.zeros(1, np.uint8))
    registry.close()
    with pytest.raises(ShmRegionError, match="was unregistered while in use"):
        region.read(0, 4)


def test_hloserve_client_through_a_staging_pool(shm_server: ServerThread) -> None:
    """hloserve's client stages inputs and outputs in a pool slot; results equal inline."""
    import trio
    import trio_asyncio

    from hloserve.client import Client, deadline_params, encode_request_shm
    from hloserve.engine.buffer_pool import BufferPool

    assert deadline_params(0) == {} and deadline_params(0.5) == {"hloserve_timeout_ns": 500_000_000}

    async def main() -> None:
        async with trio_asyncio.open_loop():
            client = Client("127.0.0.1", shm_server.worker.grpc_port)
            call = trio_asyncio.aio_as_trio
            with BufferPool(1 << 20, n_slots=4) as pool:
                await call(client.register_pool)(pool, "staging")
                assert (await call(client.system_shared_memory_status)("staging"))["staging"][
                    2
                ] == pool.n_bytes
                slot = await pool.acquire_slot()
                x, y = pool.scratch(slot, [(X.shape, np.float32), ((4, 4), np.float32)])
                x[:] = X
                request = encode_request_shm(
                    "mlp", pool, "staging", {"INPUT0": x}, outputs={"OUTPUT0": y}, timeout=5
                )
                response = await call(client.infer_message)(request, 5)
                assert [o.name for o in response.outputs] == ["OUTPUT0"]
                assert_close(y, export_examples.reference("mlp", X))
                inline = await call(client.infer)("mlp", {"INPUT0": X})
                np.testing.assert_array_equal(inline["OUTPUT0"], y)
                pool.release(slot)
                await call(client.unregister_system_shared_memory)("staging")
                del x, y
            client.close()

    trio.run(main)
