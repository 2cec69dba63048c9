"""The node's supervisor with small real children: restarts, backoff, the restart budget,
SIGTERM then SIGKILL, prefixed output, death with the parent; and how GPUs are found."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from hloserve.config import Config, NodeConfig
from hloserve.errors import ConfigError
from hloserve.fleet.supervisor import Child, GaveUp, Supervisor
from hloserve.fleet.workers import (
    LOWEST_CHOSEN_PORT,
    WorkerSpec,
    find_gpus,
    free_port,
    worker_child,
    worker_specs,
)

# The supervisor forks its children from the trio thread (see hloserve.fleet.supervisor). In this test
# process JAX may already be loaded by other tests, and JAX warns at every fork; the child execs
# at once, so the warning's deadlock cannot happen here (`hloserve node` imports JAX but starts no
# backend, so it has no JAX threads).
pytestmark = [
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
    pytest.mark.serial,
]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_keeps_dying_is_restarted_after_a_backoff_until_the_budget_is_spent() -> None:
    lines: list[bytes] = []
    supervisor = Supervisor(NodeConfig(max_restarts=2, restart_backoff_max_s=0.2), lines.append)
    child = Child("flaky", _python("print('hello'); print('partial', end=''); raise SystemExit(3)"))
    started = time.monotonic()
    with pytest.raises(GaveUp, match="flaky exited 3 times in a row"):
        trio.run(supervisor.keep_running, child)
    assert supervisor.starts["flaky"] == 3
    assert lines.count(b"[flaky] hello\n") == 3 and lines.count(b"[flaky] partial\n") == 3
    assert time.monotonic() - started >= 0.4  # two waits of min(2^(n-1), 0.2) s


def test_a_child_that_stayed_up_long_enough_starts_a_fresh_budget() -> None:
    supervisor = Supervisor(NodeConfig(max_restarts=1, restart_reset_s=0, restart_backoff_max_s=0.05))

    async def main() -> None:
        with trio.move_on_after(1.5):
            await supervisor.keep_running(Child("dies", _python("raise SystemExit(1)")))

    trio.run(main)
    assert supervisor.starts["dies"] >= 3  # never gave up: each run counted as the first in a row


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_stopping_sends_sigterm_then_sigkill_after_the_grace(ignores_sigterm: bool) -> None:
    handler = "signal.SIG_IGN" if ignores_sigterm else "lambda *_: (print('bye', flush=True), sys.exit(0))"
    code = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, {handler}); "
        "print('up', flush=True); time.sleep(60)"
    )
    lines: list[bytes] = []
    supervisor = Supervisor(NodeConfig(), lines.append)
    pids: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.keep_running, Child("c", _python(code), {}, grace_s=0.5))
            with trio.fail_after(10):
                while b"[c] up\n" not in lines:
                    await trio.sleep(0.01)
            pids.append(supervisor.pids["c"])
            stopping.append(time.monotonic())  # from here: the child's start is not the stop's
            nursery.cancel_scope.cancel()

    stopping: list[float] = []
    trio.run(main)
    elapsed = time.monotonic() - stopping[0]
    assert not Path(f"/proc/{pids[0]}").exists()
    if ignores_sigterm:
        assert 0.5 <= elapsed < 5 and b"[c] bye\n" not in lines
    else:
        assert elapsed < 0.5 and b"[c] bye\n" in lines  # what it says while stopping is kept


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def test_children_die_with_the_supervisor_even_when_it_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "supervise.py"
    script.write_text(
        "import sys, trio\n"
        "from hloserve.config import NodeConfig\n"
        "from hloserve.fleet.supervisor import Child, Supervisor\n"
        "code = 'import os, time; print(os.getpid(), flush=True); time.sleep(60)'\n"
        "child = Child('c', [sys.executable, '-c', code])\n"
        "out = lambda line: (sys.stdout.buffer.write(line), sys.stdout.flush())\n"
        "trio.run(Supervisor(NodeConfig(), out).keep_running, child)\n"
    )
    supervisor = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    try:
        lines = iter(supervisor.stdout.readline, "")
        child = int(next(line for line in lines if line.startswith("[c] ")).split()[1])
        time.sleep(1)  # well past any helper thread's life
        assert not _gone(child)
        supervisor.kill()
        supervisor.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the child outlived its supervisor"
    finally:
        supervisor.kill()
        supervisor.wait()
        supervisor.stdout.close()


def test_gpus_are_found_from_the_setting_then_cuda_visible_devices_then_nvidia_smi(tmp_path: Path) -> None:
    assert find_gpus("2", {}) == ["0", "1"]
    assert find_gpus("GPU-a,GPU-b", {"CUDA_VISIBLE_DEVICES": "0"}) == ["GPU-a", "GPU-b"]
    assert find_gpus("auto", {"CUDA_VISIBLE_DEVICES": "1, 3"}) == ["1", "3"]
    assert find_gpus("auto", {"CUDA_VISIBLE_DEVICES": ""}) == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    smi.chmod(0o755)
    assert find_gpus("auto", {}, str(smi)) == ["0", "1", "2"]
    assert find_gpus("auto", {}, str(tmp_path / "missing")) == []


def test_workers_get_their_own_device_and_ports() -> None:
    with pytest.raises(ConfigError, match="--cpu-workers"):
        worker_specs(NodeConfig(gpus="auto"), {"CUDA_VISIBLE_DEVICES": ""})
    specs = worker_specs(NodeConfig(gpus="2", worker_base_port=9100), {})
    assert specs == [
        WorkerSpec("worker0", 9100, 9101, 9102, "0"),
        WorkerSpec("worker1", 9103, 9104, 9105, "1"),
    ]
    gpu = worker_child(specs[1], Config(), None, public=False)
    assert gpu.env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert [gpu.argv[gpu.argv.index(f) + 1] for f in ("--grpc-port", "--metrics-port", "--http-port")] == [
        "9103", "9104", "9105",
    ]  # fmt: skip
    no_rest = worker_child(specs[1], Config().replace("server", http_port=-1), None, public=False)
    assert no_rest.argv[no_rest.argv.index("--http-port") + 1] == "-1"
    cpu = worker_specs(NodeConfig(cpu_workers=3), {})
    assert [s.devices for s in cpu] == [None] * 3 and len({s.grpc_port for s in cpu}) == 3
    assert worker_child(cpu[0], Config(), None, public=False).env["JAX_PLATFORMS"] == "cpu"
    public = worker_child(cpu[0], Config(), None, public=True)
    assert public.argv[public.argv.index("--grpc-port") + 1] == "8001"


def test_a_worker_s_chosen_port_is_below_the_ephemeral_range_and_free(tmp_path: Path) -> None:
    """What a connection or bind(0) elsewhere on the host may take before the worker binds it
    is never chosen; a port something holds is passed over; without the kernel's range, bind(0)."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    ports = {free_port(ephemeral_range=ranges) for _ in range(20)}
    assert all(LOWEST_CHOSEN_PORT <= p < 32768 for p in ports) and len(ports) > 1
    held: dict[int, socket.socket] = {}
    try:  # every port of a narrow range but one is held (here or by the host): that one is chosen
        ranges.write_text(f"{LOWEST_CHOSEN_PORT + 40} 60999")
        for port in range(LOWEST_CHOSEN_PORT, LOWEST_CHOSEN_PORT + 40):
            held[port] = socket.socket()
            with contextlib.suppress(OSError):  # in use on this host already: as good as held
                held[port].bind(("127.0.0.1", port))
        freed = max(port for port, s in held.items() if s.getsockname()[1] == port)
        held.pop(freed).close()
        assert {free_port(ephemeral_range=ranges) for _ in range(5)} == {freed}
    finally:
        for s in held.values():
            s.close()
    ranges.write_text("nonsense")
    for unknown in (tmp_path / "missing", ranges):
        with socket.socket() as s:
            s.bind(("127.0.0.1", free_port(ephemeral_range=unknown)))  # free, as bind(0) said


def _node(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hloserve.cli", "node", "--metrics-port", "-1", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip


def test_bad_node_settings_stop_it_before_anything_starts() -> None:
    missing = _node("--cpu-workers", "2", env={"HLOSERVE_NODE_ENVOY": "/nonexistent/envoy"})
    assert (
        missing.returncode == 2 and "node.envoy" in missing.stderr and "child started" not in missing.stderr
    )
    no_gpu = _node(env={"CUDA_VISIBLE_DEVICES": ""})
    assert no_gpu.returncode == 2 and "--cpu-workers" in no_gpu.stderr


@pytest.mark.slow
def test_a_worker_that_keeps_dying_stops_the_node_with_status_1(tmp_path: Path) -> None:
    ended = _node(
        "--cpu-workers", "1", "--model-repository", str(tmp_path / "missing"), "--grpc-port", "0",
        env={"HLOSERVE_NODE_MAX_RESTARTS": "1"},
    )  # fmt: skip
    assert ended.returncode == 1, ended.stderr[-2000:]
    assert ended.stderr.count("[worker0]") >= 2 and "worker0 exited 2 times in a row" in ended.stderr
