"""`--frontends 2`: a real engine process and two frontend processes on one port (SO_REUSEPORT),
reached with tritonclient on many connections; a frontend killed with SIGKILL comes back and its
arena leaves /dev/shm; the engine killed takes the frontends with it and frees the port."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from export_examples import reference
from support.bundles import assert_affine_answers, write_affine
from support.clients import assert_serves, infer
from support.numerics import assert_close
from support.servers import start_worker
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and "hloserve.frontends.frontend" in _cmdline(int(stat.parent.name)):
            found.append(int(stat.parent.name))
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def gone(pid: int) -> bool:
    """Exited with its files closed: reaped, or a zombie whose every thread has exited (the
    leader turns zombie, and its command line empties, while other threads still hold the
    process's sockets)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except OSError:
        return True


def can_listen(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do (TIME_WAIT)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        probe.listen()
        return True


def arenas(pids: list[int]) -> list[str]:
    """The /dev/shm names of these frontends' arenas."""
    return [
        n for n in os.listdir("/dev/shm") if any(n.startswith("hloserve-f") and f"-{p}-" in n for p in pids)
    ]


def mapped_unnamed_arena(pid: int) -> bool:
    """Whether process `pid` maps a frontend arena whose name is already unlinked."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any("/dev/shm/hloserve-f" in line and line.endswith("(deleted)") for line in maps.splitlines())


def wait_for(condition: Callable[[], bool], timeout: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def connect(url: str) -> grpcclient.InferenceServerClient:
    """A client on its own TCP connection (grpcio otherwise shares one among a process's channels
    to one address, and so one frontend)."""
    return grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def serve_many(url: str, connections: int = 8, requests: int = 5) -> None:
    def one(seed: int) -> None:
        x = np.random.default_rng(seed).random((1 + seed % 4, 16), dtype=np.float32)
        with closing(connect(url)) as client:
            for _ in range(requests):
                answer = infer(client, "mlp", {"INPUT0": x}).as_numpy("OUTPUT0")
                assert_close(answer, reference("mlp", x))

    with ThreadPoolExecutor(connections) as pool:
        list(pool.map(one, range(connections)))


def test_two_frontends_serve_and_one_killed_comes_back() -> None:
    with start_worker(process="subprocess", frontends=2) as worker:
        frontends = children(worker.pid)
        assert len(frontends) == 2, frontends
        serve_many(worker.url, connections=16)
        # Each arena is shared with the engine and named no more: no death can leave it behind.
        assert all(mapped_unnamed_arena(p) for p in [worker.pid, *frontends])
        assert not arenas(frontends)
        os.kill(frontends[0], signal.SIGKILL)
        # Once it is gone (connections in its backlog at that instant are reset, as with any
        # process that dies), new connections all land on the other.
        wait_for(lambda: gone(frontends[0]))
        serve_many(worker.url)
        wait_for(lambda: len(children(worker.pid)) == 2 and frontends[0] not in children(worker.pid))
        assert not arenas([frontends[0]]), "the killed frontend's arena was left in /dev/shm"
        serve_many(worker.url, connections=16)


def test_the_engine_killed_takes_its_frontends_and_frees_the_port() -> None:
    with start_worker(process="subprocess", frontends=2) as worker:
        frontends = children(worker.pid)
        assert len(frontends) == 2
        assert_serves(worker.url)
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.wait(60)  # a busy machine can take seconds to tear a large process down
        wait_for(lambda: all(gone(p) for p in frontends), what=f"the frontends {frontends} exit")
        wait_for(lambda: can_listen(worker.grpc_port), timeout=10, what=f"port {worker.grpc_port} to be free")
        assert not arenas(frontends), "the frontends' arenas were left in /dev/shm"


def test_sigterm_drains_requests_in_flight_then_every_process_exits(tmp_path: Path) -> None:
    config = tmp_path / "hloserve.yaml"  # the queue holds lone rows a second: in flight at SIGTERM
    config.write_text("scheduler:\n  models:\n    mlp: {max_queue_delay_us: 1000000}\n")
    with start_worker(process="subprocess", frontends=2, args=["--config", str(config)]) as worker:
        frontends = children(worker.pid)
        x = np.random.default_rng(1).random((1, 16), dtype=np.float32)

        def one(_: int) -> np.ndarray:
            with closing(connect(worker.url)) as client:
                return infer(client, "mlp", {"INPUT0": x}, client_timeout=20).as_numpy("OUTPUT0")

        with ThreadPoolExecutor(6) as pool:
            answers = pool.map(one, range(6))
            time.sleep(0.5)
            os.kill(worker.pid, signal.SIGTERM)
            for answer in answers:
                assert_close(answer, reference("mlp", x))
        assert worker.process.wait(30) == 0
        assert all(gone(p) for p in frontends)
        assert not arenas(frontends)


def test_statistics_count_every_frontend_from_any_connection() -> None:
    with start_worker(process="subprocess", frontends=2) as worker:
        serve_many(worker.url, connections=16, requests=5)  # 80 calls, rows 1..4 by connection
        rows = sum(5 * (1 + seed % 4) for seed in range(16))
        for _ in range(4):  # fresh connections: the kernel spreads them over both frontends
            with closing(connect(worker.url)) as client:
                stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
                assert int(stats["inference_stats"]["success"]["count"]) == 80
                assert int(stats["inference_count"]) == rows
                with pytest.raises(InferenceServerException) as raised:
                    infer(client, "nope", {"INPUT0": np.ones((1, 16), np.float32)})
                assert raised.value.status() == "StatusCode.NOT_FOUND"


def test_every_frontend_answers_grpc_health_for_kubernetes_probes() -> None:
    """Each frontend serves grpc.health.v1 on the public port as the single process does: the
    server, its gRPC services and each model by name; an unknown name is NOT_FOUND."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    with start_worker(process="subprocess", frontends=2) as worker:
        for _ in range(6):  # fresh connections: the kernel spreads them over both frontends
            with grpc.insecure_channel(worker.url) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for name in ("", "inference.GRPCInferenceService", "mlp"):
                    check = health_pb2.HealthCheckRequest(service=name)
                    assert stub.Check(check, timeout=10).status == serving
                with pytest.raises(grpc.RpcError) as raised:
                    stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
                assert raised.value.code() == grpc.StatusCode.NOT_FOUND


TIMED_PY = """
import os, time
from hloserve import NamedTensor, register_model

def preprocess(inputs):
    started = time.time()
    while time.time() < started + 0.5:  # holds its process's GIL throughout
        pass
    with open(os.environ["HOOK_LOG"], "a") as log:
        log.write(f"{os.getpid()} {started} {time.time()}\\n")
    return [NamedTensor("INPUT", inputs[0].data)]

register_model("timed", preprocess=preprocess)
"""


def test_hooks_of_two_requests_run_at_the_same_time_in_two_processes(tmp_path: Path) -> None:
    write_affine(tmp_path / "repository" / "timed", batch_sizes=(1, 2, 4))
    (tmp_path / "repository" / "timed" / "model.py").write_text(TIMED_PY)
    log = tmp_path / "hooks.log"
    with start_worker(
        process="subprocess", frontends=2, repository=tmp_path / "repository", env={"HOOK_LOG": str(log)}
    ) as worker:
        frontends = children(worker.pid)

        def one(_: int) -> None:
            with closing(connect(worker.url)) as client:
                assert_affine_answers(client, "timed")

        # The kernel hashes each connection to one frontend, so rounds of 8 at once go on (at most
        # 6, a chance of 2**-42 to miss) until both processes have run a hook in the same round.
        for _ in range(6):
            log.write_text("")
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(8)))
            runs = [
                (int(pid), float(start), float(end))
                for pid, start, end in (line.split() for line in log.read_text().splitlines())
            ]
            if {pid for pid, _, _ in runs} == set(frontends):
                break
    assert len(runs) == 8 and {pid for pid, _, _ in runs} == set(frontends)
    overlapping = [(a, b) for a in runs for b in runs if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]]
    assert overlapping, f"no two hooks ran at once in two processes: {runs}"


def test_a_deadline_passed_in_the_engine_queue_is_deadline_exceeded_as_with_one_process(
    tmp_path: Path,
) -> None:
    config = tmp_path / "hloserve.yaml"  # the queue holds a lone row 2 s; the client allows 0.3 s
    config.write_text("scheduler:\n  models:\n    mlp: {max_queue_delay_us: 2000000}\n")
    with start_worker(process="subprocess", frontends=2, args=["--config", str(config)]) as worker:
        with closing(connect(worker.url)) as client:
            started = time.monotonic()
            with pytest.raises(InferenceServerException) as raised:
                infer(client, "mlp", {"INPUT0": np.ones((1, 16), np.float32)}, client_timeout=0.3)
            assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
            assert time.monotonic() - started < 1.5
            x = np.ones((16, 16), np.float32)  # a full batch runs at once: nothing left stuck
            answer = infer(client, "mlp", {"INPUT0": x}, client_timeout=10).as_numpy("OUTPUT0")
            assert_close(answer, reference("mlp", x))
