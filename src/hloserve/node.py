"""`hloserve node`: one worker per GPU (or N on CPU) under a supervisor; with two or more workers,
Envoy in front of them on the public gRPC port and the controller (`hloserve.fleet`) beside it.
Given `node.workers_dns`, no worker of its own: Envoy and the controller front the workers that
name resolves to (a fleet's router).

The supervisor restarts a child that dies (after a doubling backoff, giving up after a budget of
restarts in a row), makes every child die with it (`PR_SET_PDEATHSIG`), stops them with SIGTERM
and a grace period before SIGKILL, and writes each child's output line by line after its name.

Children are forked from the trio thread itself, never from a helper thread: the kernel sends the
parent-death signal when the *thread* that forked a child ends, and trio's `open_process` forks
from a thread of its pool that idles out within seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio

from hloserve.config import Config, NodeConfig, ServerConfig
from hloserve.errors import ConfigError

__all__ = [
    "Child",
    "GaveUp",
    "NodePlan",
    "Supervisor",
    "WorkerSpec",
    "find_gpus",
    "free_port",
    "plan_node",
    "run_node",
    "worker_child",
    "worker_specs",
]

log = structlog.get_logger("hloserve.node")

_PR_SET_PDEATHSIG = 1


class GaveUp(Exception):
    """A child died more times in a row than `node.max_restarts` allows."""


@dataclass(frozen=True, slots=True)
class Child:
    """A process the supervisor keeps running."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    """Set over the supervisor's own environment."""
    grace_s: float = 15.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of the node: its name, where it listens, which device it sees."""

    name: str
    grpc_port: int
    metrics_port: int
    http_port: int
    devices: str | None  # CUDA_VISIBLE_DEVICES, or None for a CPU worker

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def find_gpus(setting: str, environ: Mapping[str, str], nvidia_smi: str | None = None) -> list[str]:
    """The GPUs that get a worker each: `node.gpus` (a count or a list; flag and environment
    variable already folded in), else `CUDA_VISIBLE_DEVICES`, else what `nvidia-smi` lists."""
    if setting != "auto":
        if setting.isdigit():
            return [str(i) for i in range(int(setting))]
        return setting.split(",")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound and released; the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_specs(node: NodeConfig, environ: Mapping[str, str]) -> list[WorkerSpec]:
    """The node's workers: `node.cpu_workers` CPU workers, else one per GPU found."""
    devices: list[str | None]
    if node.cpu_workers:
        devices = [None] * node.cpu_workers
    else:
        devices = list(find_gpus(node.gpus, environ))
        if not devices:
            raise ConfigError(
                "node.gpus", "no GPU found (nvidia-smi, CUDA_VISIBLE_DEVICES); pass --cpu-workers N for CPU"
            )
    specs = []
    for i, device in enumerate(devices):
        base = node.worker_base_port
        grpc_port, metrics_port, http_port = (
            (base + 3 * i, base + 3 * i + 1, base + 3 * i + 2)
            if base
            else (free_port(), free_port(), free_port())
        )
        specs.append(WorkerSpec(f"worker{i}", grpc_port, metrics_port, http_port, device))
    return specs


def _die_with_parent(parent: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


async def _copy_lines(name: str, fd: int, out: Callable[[bytes], object]) -> None:
    """Write each line the child prints as `[name] line`, until it closes its output. Shielded:
    what a stopping child says on its way out is kept (and it never writes to a closed pipe)."""
    prefix = f"[{name}] ".encode()
    pending = b""
    with trio.CancelScope(shield=True):
        async with trio.lowlevel.FdStream(fd) as stream:
            while chunk := await stream.receive_some(1 << 16):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    out(prefix + line + b"\n")
    if pending:
        out(prefix + pending + b"\n")


def _write_stderr(data: bytes) -> None:
    sys.stderr.buffer.write(data)
    sys.stderr.buffer.flush()


class Supervisor:
    """Keeps children running until cancelled, then stops them all."""

    def __init__(self, node: NodeConfig, out: Callable[[bytes], object] = _write_stderr) -> None:
        self._node = node
        self._out = out
        self.pids: dict[str, int] = {}
        """The live pid of each child (for tests and logs)."""
        self.starts: dict[str, int] = {}

    async def keep_running(self, child: Child) -> None:
        """Run `child` again each time it exits; raises `GaveUp` past the restart budget."""
        in_a_row = 0
        while True:
            started = time.monotonic()
            code = await self._run_once(child)
            if time.monotonic() - started >= self._node.restart_reset_s:
                in_a_row = 0
            in_a_row += 1
            if self._node.max_restarts and in_a_row > self._node.max_restarts:
                log.error("giving up on a child", child=child.name, exit=code, restarts=in_a_row - 1)
                raise GaveUp(f"{child.name} exited {in_a_row} times in a row (last status {code})")
            backoff = min(2.0 ** (in_a_row - 1), self._node.restart_backoff_max_s)
            log.warning("child exited; restarting", child=child.name, exit=code, backoff_s=backoff)
            await trio.sleep(backoff)

    async def _run_once(self, child: Child) -> int:
        read, write = os.pipe()
        try:
            process = subprocess.Popen(
                list(child.argv),
                env={**os.environ, **child.env},
                stdin=subprocess.DEVNULL,
                stdout=write,
                stderr=write,
                process_group=0,  # its own group: stopping it reaches whatever it started
                preexec_fn=_die_with_parent(os.getpid()),
            )
        finally:
            os.close(write)
        self.pids[child.name] = process.pid
        self.starts[child.name] = self.starts.get(child.name, 0) + 1
        log.info("child started", child=child.name, pid=process.pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_copy_lines, child.name, read, self._out)
                try:
                    with os.fdopen(os.pidfd_open(process.pid), "rb", buffering=0) as pidfd:
                        await trio.lowlevel.wait_readable(pidfd)
                finally:
                    if process.poll() is None:  # cancelled: the node is stopping
                        with trio.CancelScope(shield=True):
                            await _stop(process, child)
                return process.wait()
        finally:
            self.pids.pop(child.name, None)


async def _stop(process: subprocess.Popen[bytes], child: Child) -> None:
    """SIGTERM to the child's group, SIGKILL once `grace_s` has passed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with trio.move_on_after(child.grace_s):
        while process.poll() is None:
            await trio.sleep(0.05)
    if process.poll() is None:
        log.warning("child ignored SIGTERM; killing it", child=child.name, grace_s=child.grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    else:  # whatever it started and left behind goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    log.info("child stopped", child=child.name, exit=process.returncode)


def worker_child(spec: WorkerSpec, config: Config, config_path: Path | None, public: bool) -> Child:
    """The command that runs one worker: on the public host and ports when it is the only one."""
    server = config.server
    argv = [sys.executable, "-m", "hloserve.cli", "serve", "--model-repository", str(server.model_repository)]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if public:
        argv += ["--host", server.host, "--grpc-port", str(server.grpc_port)]
        argv += ["--metrics-port", str(server.metrics_port), "--http-port", str(server.http_port)]
    else:  # REST on its own port behind Envoy's, when the node serves REST
        argv += ["--host", "127.0.0.1", "--grpc-port", str(spec.grpc_port)]
        argv += ["--metrics-port", str(spec.metrics_port)]
        argv += ["--http-port", str(spec.http_port if server.http_port >= 0 else -1)]
    if server.allow_client_shm:
        argv.append("--allow-client-shm")
    if spec.devices is None:
        env = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    else:
        env = {"CUDA_VISIBLE_DEVICES": spec.devices}
    env.update(_access_env(server, public))
    return Child(spec.name, argv, env, config.node.worker_grace_s)


def _access_env(server: ServerConfig, public: bool) -> dict[str, str]:
    """What a worker is told of restrictions and TLS, as environment variables (over its config
    file, whatever the node's own flags said), when the node has any: the restrictions, so a
    worker behind Envoy refuses what the node would (Envoy passes the headers through); TLS as
    the node's when the worker serves the public ports itself, else off (Envoy terminates it;
    the worker listens on 127.0.0.1 only)."""
    env = {}
    if server.grpc_restricted_protocol:
        env["HLOSERVE_SERVER_GRPC_RESTRICTED_PROTOCOL"] = ";".join(server.grpc_restricted_protocol)
    if server.http_restricted_api:
        env["HLOSERVE_SERVER_HTTP_RESTRICTED_API"] = ";".join(server.http_restricted_api)
    for proto in ("grpc", "http"):
        if not getattr(server, f"{proto}_tls"):
            continue
        for key in ("use_ssl", "use_ssl_mutual"):
            on = public and getattr(server, f"{proto}_{key}")
            env[f"HLOSERVE_SERVER_{proto.upper()}_{key.upper()}"] = "true" if on else "false"
        for key in ("server_cert", "server_key", "root_cert"):
            path = getattr(server, f"{proto}_{key}")
            env[f"HLOSERVE_SERVER_{proto.upper()}_{key.upper()}"] = (
                str(path.resolve()) if public and path else ""
            )
    return env


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What a node will run, settled before anything starts (so a bad setting stops it early)."""

    workers: Sequence[WorkerSpec]
    envoy: str | None  # the Envoy binary, with two workers or more


def plan_node(config: Config, environ: Mapping[str, str] | None = None) -> NodePlan:
    """The workers to start and the Envoy to front them; raises `ConfigError`. Given
    `node.workers_dns`, no worker: Envoy fronts the workers that name resolves to."""
    if config.node.workers_dns:
        from hloserve.fleet.envoy import find_envoy

        return NodePlan([], find_envoy(config.node.envoy))
    specs = worker_specs(config.node, os.environ if environ is None else environ)
    if len(specs) == 1:
        return NodePlan(specs, None)
    from hloserve.fleet.envoy import find_envoy

    return NodePlan(specs, find_envoy(config.node.envoy))


async def run_node(config: Config, plan: NodePlan, config_path: Path | None = None) -> str:
    """Run the node until cancelled; returns why it gave up if a child died past its budget."""
    supervisor = Supervisor(config.node)
    failures: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            if plan.envoy is None:
                (spec,) = plan.workers
                nursery.start_soon(supervisor.keep_running, worker_child(spec, config, config_path, True))
                log.info("node serving one worker directly", grpc_port=config.server.grpc_port)
            else:
                from hloserve.fleet.front import run_front

                await nursery.start(run_front, config, plan.workers, supervisor, plan.envoy)
                for spec in plan.workers:
                    child = worker_child(spec, config, config_path, False)
                    nursery.start_soon(supervisor.keep_running, child)
    except* GaveUp as group:
        failures += map(str, group.exceptions)
    return "; ".join(failures)  # keep_running returns only by giving up
