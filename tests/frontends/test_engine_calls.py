"""With `frontends: 2`, what only the engine holds answers the same from either frontend: a model
loaded, unloaded or hot-reloaded through one connection is served (or gone) on fresh connections
to both frontends at once; a shared-memory region registered on one frontend is used from the
other; REST is served by the frontends; `server.max_inflight_requests` holds for the worker.

Which frontend a connection landed on is read from /proc: the server's end of the new TCP
connection is a socket that exactly one frontend holds.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog.testing
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from export_examples import reference
from support.bundles import PARAMS, X, affine, assert_affine_answers, save_affine_weights, write_affine
from support.clients import infer, wait_until
from support.numerics import assert_close, close
from support.servers import EXAMPLES, ServerThread, make_config, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import ModelSettings
from hloserve.errors import ConfigError
from hloserve.models import _xla

pytestmark = pytest.mark.slow


def connect(url: str) -> grpcclient.InferenceServerClient:
    """A client on its own TCP connection (grpcio otherwise shares one per address)."""
    return grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def _accepted(port: int) -> set[int]:
    """The inodes of established TCP sockets whose local port is `port` (the server's ends)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(int(fields[9]))
    return inodes


def _holder(inodes: set[int], pids: list[int]) -> int | None:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return pid
            except OSError:
                continue
    return None


def frontend_pids(server: ServerThread) -> list[int]:
    return sorted(server.worker.frontends.pids)


def landed(server: ServerThread) -> tuple[grpcclient.InferenceServerClient, int]:
    """A client on a fresh connection, and the frontend it landed on."""
    before = _accepted(server.grpc_port)
    client = connect(server.url)
    assert client.is_server_live()
    pid = _holder(_accepted(server.grpc_port) - before, frontend_pids(server))
    assert pid is not None, "no frontend holds the new connection"
    return client, pid


def fresh_clients(
    server: ServerThread, rounds: int = 40
) -> Iterator[tuple[grpcclient.InferenceServerClient, int]]:
    """Clients on fresh connections with the frontend each landed on, until both frontends have
    had one (the kernel hashes connections; 40 rounds miss one with chance 2**-39)."""
    seen: set[int] = set()
    for _ in range(rounds):
        client, pid = landed(server)
        with closing(client):
            seen.add(pid)
            yield client, pid
        if seen == set(frontend_pids(server)):
            return
    raise AssertionError(f"{rounds} fresh connections hit only frontends {seen}")


def on_other_frontend(server: ServerThread, pid: int) -> Iterator[grpcclient.InferenceServerClient]:
    """One client on a fresh connection that landed on a frontend other than `pid`."""
    for client, landed in fresh_clients(server):
        if landed != pid:
            yield client
            return


@pytest.fixture(scope="module", name="engine")
def _engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repository = tmp_path_factory.mktemp("repository")
    write_affine(repository / "first")
    config = make_config(repository, allow_client_shm=True, frontends=2)
    with start_worker(config) as server:
        yield server


def test_a_load_on_one_connection_is_served_by_every_frontend_at_once_and_an_unload_too(
    engine: ServerThread,
) -> None:
    write_affine(Path(engine.config.server.model_repository) / "late")
    with closing(connect(engine.url)) as client:
        client.load_model("late")
    for client, _ in fresh_clients(engine):  # no waiting: both frontends applied it already
        assert client.is_model_ready("late")
        assert_affine_answers(client, "late")
        assert client.get_model_config("late").config.max_batch_size == 2
    with closing(connect(engine.url)) as client:
        client.unload_model("late")
    for client, _ in fresh_clients(engine):
        assert not client.is_model_ready("late")
        with pytest.raises(InferenceServerException) as raised:
            assert_affine_answers(client, "late")
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert_affine_answers(client, "first")  # the next good request is served


def test_frontends_never_initialise_a_device_and_report_the_engines_platform(engine: ServerThread) -> None:
    for pid in frontend_pids(engine):
        assert b"JAX_PLATFORMS=cpu" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    platform = engine.call(lambda: _xla.device().platform)
    for client, _ in fresh_clients(engine):
        assert client.get_model_metadata("first").platform == f"stablehlo_{platform}"
        assert client.get_model_config("first").config.platform == f"stablehlo_{platform}"


def test_a_frontend_serves_without_importing_jax(engine: ServerThread) -> None:
    """A frontend decodes, checks and forwards; only the engine runs models. JAX in a frontend
    cost each about 120 MB of memory and a second of start-up."""
    write_affine(Path(engine.config.server.model_repository) / "jaxless")
    with closing(connect(engine.url)) as client:
        client.load_model("jaxless")  # a bundle sent to the frontends, its module unparsed there
    for client, _ in fresh_clients(engine):
        assert_affine_answers(client, "jaxless")
        client.get_model_config("jaxless")
    with closing(connect(engine.url)) as client:
        client.unload_model("jaxless")
    for pid in frontend_pids(engine):
        mapped = Path(f"/proc/{pid}/maps").read_text()
        assert "/jaxlib/" not in mapped, f"frontend {pid} has loaded jaxlib (JAX imported)"


def test_an_idle_engine_keeps_its_frontends(engine: ServerThread) -> None:
    """PR_SET_PDEATHSIG fires when the thread that forked a frontend exits; trio's worker threads
    exit after 10 s idle, so frontends forked in one died with it (and were restarted)."""
    before = frontend_pids(engine)
    time.sleep(11)
    assert frontend_pids(engine) == before
    for client, _ in fresh_clients(engine):
        assert_affine_answers(client, "first")


def test_a_frontend_started_later_gets_the_table_as_it_is(engine: ServerThread) -> None:
    """A model loaded (with a config override) before a frontend restarts is served by the new
    process with its settings."""
    write_affine(Path(engine.config.server.model_repository) / "later", batch_sizes=(1, 2, 4))
    with closing(connect(engine.url)) as client:
        client.load_model("later", config='{"max_batch_size": 2}')
    killed = frontend_pids(engine)[0]
    os.kill(killed, signal.SIGKILL)
    wait_until(
        lambda: (
            killed not in frontend_pids(engine)
            and engine.call(lambda: engine.worker.frontends.listening) == 2
        ),
        30,
        "the killed frontend restarted and listening",
    )
    for client, _ in fresh_clients(engine):
        assert_affine_answers(client, "later")
        assert client.get_model_config("later").config.max_batch_size == 2
    with closing(connect(engine.url)) as client:
        client.unload_model("later")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the start fails
def test_a_second_engine_on_the_same_port_is_refused_not_joined(engine: ServerThread) -> None:
    """SO_REUSEPORT alone would let a second worker of the same user share the port (and its
    connections) with the first; the engine's plain bind first refuses it, naming the key."""
    taken = make_config(EXAMPLES, grpc_port=engine.grpc_port, frontends=2)
    with pytest.raises(RuntimeError) as error:
        start_worker(taken)
    cause = error.value.__cause__
    assert isinstance(cause, BaseExceptionGroup)
    refused, _ = cause.split(ConfigError)
    assert refused is not None and "server.grpc_port: cannot listen" in repr(refused)
    with closing(connect(engine.url)) as client:
        assert_affine_answers(client, "first")


def test_load_and_unload_errors_keep_their_status_codes_through_the_link(engine: ServerThread) -> None:
    with closing(connect(engine.url)) as client:
        for call, name, status in [
            (client.load_model, "absent", "StatusCode.NOT_FOUND"),
            (client.load_model, "../first", "StatusCode.INVALID_ARGUMENT"),
            (client.unload_model, "absent", "StatusCode.NOT_FOUND"),
        ]:
            with pytest.raises(InferenceServerException) as raised:
                call(name)
            assert raised.value.status() == status, raised.value
        assert_affine_answers(client, "first")


@pytest.fixture(name="regions")
def _regions() -> Iterator[dict[str, Any]]:
    key = f"/hloserve-test-{uuid.uuid4().hex[:12]}"
    handles = {
        "in": shm.create_shared_memory_region("in", f"{key}-in", X.nbytes),
        "out": shm.create_shared_memory_region("out", f"{key}-out", 3 * 4),
    }
    shm.set_shared_memory_region(handles["in"], [X])
    yield {"key": key, **handles}
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def _infer_in_regions(client: grpcclient.InferenceServerClient, model: str = "first") -> Any:
    tensor = grpcclient.InferInput("INPUT", list(X.shape), "FP32")
    tensor.set_shared_memory("in", X.nbytes)
    output = grpcclient.InferRequestedOutput("OUTPUT")
    output.set_shared_memory("out", 3 * 4)
    return client.infer(model, [tensor], outputs=[output])


def test_a_region_registered_on_one_frontend_is_used_from_the_other_and_unregistered_everywhere(
    engine: ServerThread, regions: dict[str, Any]
) -> None:
    registrar, registered_on = landed(engine)
    with closing(registrar):
        registrar.register_system_shared_memory("in", f"{regions['key']}-in", X.nbytes)
        registrar.register_system_shared_memory("out", f"{regions['key']}-out", 3 * 4)
        with pytest.raises(InferenceServerException) as raised:  # one registry: the engine's
            registrar.register_system_shared_memory("out", f"{regions['key']}-out", 3 * 4)
        assert raised.value.status() == "StatusCode.ALREADY_EXISTS"
    for client in on_other_frontend(engine, registered_on):
        assert sorted(client.get_system_shared_memory_status().regions) == ["in", "out"]
        result = _infer_in_regions(client)
        assert result.get_output("OUTPUT").parameters["shared_memory_byte_size"].int64_param == 12
        answer = shm.get_contents_as_numpy(regions["out"], np.float32, [1, 3])
        assert_close(answer, affine(PARAMS, X))
        client.unregister_system_shared_memory("in")
    for client, _ in fresh_clients(engine):
        assert sorted(client.get_system_shared_memory_status().regions) == ["out"]
        with pytest.raises(InferenceServerException) as raised:
            _infer_in_regions(client)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "not registered" in (raised.value.message() or "")
        assert_affine_answers(client, "first")
    with closing(connect(engine.url)) as client:
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status().regions


def test_rest_is_served_by_the_frontends() -> None:
    """tritonclient.http against two frontends: every call answers as one process does."""
    with start_worker(make_config(EXAMPLES, frontends=2)) as server:
        x = np.random.default_rng(3).random((2, 16), dtype=np.float32)
        for _ in range(6):  # fresh connections: the kernel spreads them over both frontends
            with closing(httpclient.InferenceServerClient(server.http_url)) as client:
                assert client.is_server_ready() and client.is_model_ready("mlp")
                assert client.get_model_metadata("mlp")["name"] == "mlp"
                tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x, binary_data=True)
                answer = client.infer("mlp", [tensor]).as_numpy("OUTPUT0")
                assert_close(answer, reference("mlp", x))
                with pytest.raises(InferenceServerException) as raised:
                    client.get_model_metadata("nope")
                assert raised.value.status() == "404"
        with closing(httpclient.InferenceServerClient(server.http_url)) as client:
            stats = client.get_inference_statistics("mlp")["model_stats"][0]
            assert int(stats["inference_stats"]["success"]["count"]) == 6  # every frontend's


@pytest.fixture(scope="module", name="holding")
def _holding() -> Iterator[ServerThread]:
    """Two frontends; the MLP's queue holds lone rows 2 s (a batching delay); at most 4 requests
    in flight for the worker; client regions allowed."""
    scheduler = {"models": {"mlp": ModelSettings(max_queue_delay_us=2_000_000)}}
    config = make_config(
        EXAMPLES,
        scheduler=scheduler,
        frontends=2,
        max_inflight_requests=4,
        allow_client_shm=True,
        http_port=-1,
    )
    with start_worker(config) as server:
        yield server


def held(server: ServerThread) -> int:
    """Requests the engine holds from all frontends."""
    return int(server.call(lambda: server.worker.frontends.inflight))


ONE_ROW = np.ones((1, 16), np.float32)


def test_max_inflight_requests_holds_for_the_worker_across_frontends(holding: ServerThread) -> None:
    """Four lone rows wait in the engine's queue; with a cap of 4 for the worker, a fifth is
    UNAVAILABLE on either frontend (each alone holds at most 4)."""

    def one(client: grpcclient.InferenceServerClient) -> np.ndarray:
        return infer(client, "mlp", {"INPUT0": ONE_ROW}, client_timeout=20).as_numpy("OUTPUT0")

    clients = [connect(holding.url) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = pool.map(one, clients)
        wait_until(lambda: held(holding) == 4, 10, "four requests held by the engine")
        for client, _ in fresh_clients(holding):
            with pytest.raises(InferenceServerException) as raised:
                infer(client, "mlp", {"INPUT0": ONE_ROW}, client_timeout=20)
            assert raised.value.status() == "StatusCode.UNAVAILABLE"
            assert "max_inflight_requests" in (raised.value.message() or "")
        for answer in answers:
            assert_close(answer, reference("mlp", ONE_ROW))
    for client in clients:
        client.close()
    assert held(holding) == 0
    with closing(connect(holding.url)) as client:
        assert_close(one(client), reference("mlp", ONE_ROW))


def cancel_while_held(
    holding: ServerThread, client: grpcclient.InferenceServerClient, outputs: list[Any] | None = None
) -> None:
    """Send one row, which the engine holds in the MLP's queue (2 s batching delay), and cancel
    it from the client: it leaves the engine at once, and the client's call says CANCELLED."""
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(ONE_ROW)
    answered: list[Any] = []
    call = client.async_infer("mlp", [tensor], lambda result, error: answered.append(error), outputs=outputs)
    wait_until(lambda: held(holding) == 1, 10, "the request held by the engine")
    cancelled = time.monotonic()
    call.cancel()
    wait_until(lambda: held(holding) == 0, 1.5, "the cancelled request withdrawn")
    assert time.monotonic() - cancelled < 1.5
    wait_until(lambda: answered, 5, "the client's callback")
    assert "CANCELLED" in str(answered[0].status())


def assert_serves_one_row(client: grpcclient.InferenceServerClient) -> None:
    assert_close(
        infer(client, "mlp", {"INPUT0": ONE_ROW}, client_timeout=20).as_numpy("OUTPUT0"),
        reference("mlp", ONE_ROW),
    )


def test_a_client_that_cancels_a_request_withdraws_it_from_the_engine(holding: ServerThread) -> None:
    """A plain request (its inputs in a frontend's arena) waits in the MLP's queue; the client
    cancels: it leaves the engine at once, is counted cancelled, and the frontend serves on."""
    with closing(connect(holding.url)) as client:
        drops = holding.call(lambda: holding.worker.statistics["mlp"].drops["cancelled"])
        cancel_while_held(holding, client)
        assert holding.call(lambda: holding.worker.statistics["mlp"].drops["cancelled"]) == drops + 1
        assert_serves_one_row(client)


def test_a_client_that_cancels_a_forwarded_request_withdraws_it_from_the_engine(
    holding: ServerThread, regions: dict[str, Any]
) -> None:
    """A request naming a region goes to the engine whole and waits in the MLP's queue; the
    client cancels: it leaves the engine at once, not when the queue's 2 s delay ends."""
    with closing(connect(holding.url)) as client:
        client.register_system_shared_memory("in", f"{regions['key']}-in", X.nbytes)
        try:
            output = grpcclient.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("in", 16)  # the region holds 16 bytes: one row of 4 floats
            cancel_while_held(holding, client, [output])
        finally:
            client.unregister_system_shared_memory()
        assert_serves_one_row(client)


def test_hot_reload_is_seen_by_every_frontend(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    write_affine(repository / "first")
    config = make_config(
        repository, frontends=2, reload=True, repository_poll_s=0.1, reload_debounce_s=0.2, http_port=-1
    )
    doubled = {name: value * 2 for name, value in PARAMS.items()}
    with start_worker(config) as server:
        save_affine_weights(repository / "first", doubled)
        expected = affine(doubled, X)
        with closing(connect(server.url)) as client:
            wait_until(
                lambda: close(infer(client, "first", {"INPUT": X}).as_numpy("OUTPUT"), expected),
                30,
                "the reloaded weights served",
            )
        for client, _ in fresh_clients(server):  # the reload step returned: both frontends have it
            assert_close(infer(client, "first", {"INPUT": X}).as_numpy("OUTPUT"), expected)
        (repository / "first" / "model.py").write_text(DOUBLING_PY)
        time.sleep(0.05)
        with closing(connect(server.url)) as client:
            wait_until(
                lambda: close(infer(client, "first", {"INPUT": X}).as_numpy("OUTPUT"), 2 * expected),
                30,
                "the new model.py's hook run",
            )
        for client, _ in fresh_clients(server):  # hooks run in the frontends: both run the new one
            assert_close(infer(client, "first", {"INPUT": X}).as_numpy("OUTPUT"), 2 * expected)


def test_a_bundle_the_watcher_cannot_load_is_failed_on_every_frontend_once_the_engine_says_so(
    tmp_path: Path,
) -> None:
    """The watcher goes on (and logs the failed load) only once every frontend has applied it:
    while one frontend is stopped the engine lists the model as failed but the watcher waits;
    once it logs, both frontends answer ModelReady false and list the reason, with no wait."""
    repository = tmp_path / "repository"
    write_affine(repository / "first")
    config = make_config(
        repository, frontends=2, reload=True, repository_poll_s=0.05, reload_debounce_s=0.1, http_port=-1
    )

    def reported() -> bool:
        return any(e["event"] == "reload failed" and e.get("model") == "broken" for e in list(logs))

    with structlog.testing.capture_logs() as logs, start_worker(config) as server:
        stopped = frontend_pids(server)[0]
        os.kill(stopped, signal.SIGSTOP)
        try:
            (repository / "broken").mkdir()
            (repository / "broken" / "manifest.yaml").write_text("inputs: [not, a, manifest\n")
            wait_until(
                lambda: not server.worker.models["broken"].ready, 30, "the engine to list the broken bundle"
            )
            assert not reported(), "the watcher went on before the stopped frontend applied the failure"
        finally:
            os.kill(stopped, signal.SIGCONT)
        wait_until(reported, 30, "the engine's watcher to report the broken bundle")
        for client, _ in fresh_clients(server):  # at once, on each frontend
            assert not client.is_model_ready("broken")
            index = {m.name: m for m in client.get_model_repository_index().models}
            assert index["broken"].state == "UNAVAILABLE" and "manifest" in index["broken"].reason, index
            assert_affine_answers(client, "first")  # the next good request is served


DOUBLING_PY = """
from hloserve import NamedTensor, register_model

def postprocess(outputs):
    return [NamedTensor("OUTPUT", outputs[0].data * 2)]

register_model("first", postprocess=postprocess)
"""
