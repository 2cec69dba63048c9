"""The node's workers: how many (one per GPU, or N on CPU), their ports and devices, and the
command that runs each under the supervisor."""

from __future__ import annotations

import itertools
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hloserve.config import Config, NodeConfig, ServerConfig
from hloserve.errors import ConfigError
from hloserve.fleet.supervisor import Child

__all__ = ["WorkerSpec", "find_gpus", "free_port", "worker_child", "worker_specs"]


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


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_CHOSEN_PORT = 20000
"""Where `free_port` starts looking, below the kernel's ephemeral range (32768 on Linux)."""


def free_port(host: str = "127.0.0.1", ephemeral_range: Path = EPHEMERAL_RANGE) -> int:
    """A port nothing is bound to now, for a child to bind later (a worker, after loading its
    models). Chosen below the kernel's ephemeral range where that is known: a port from bind(0)
    comes from that range, and in between any outgoing connection or other bind(0) on the host
    could take it, leaving the child to fail to bind it at every restart."""
    try:
        low = int(ephemeral_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low > LOWEST_CHOSEN_PORT:  # from a random place on, so that callers rarely meet
        start = random.randrange(LOWEST_CHOSEN_PORT, low)
        for port in itertools.chain(range(start, low), range(LOWEST_CHOSEN_PORT, start)):
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


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
    the node's when the worker serves the public ports itself, else off (Envoy terminates it, the
    node serves the public metrics port; the worker listens on 127.0.0.1 only)."""
    env = {}
    if server.grpc_restricted_protocol:
        env["HLOSERVE_SERVER_GRPC_RESTRICTED_PROTOCOL"] = ";".join(server.grpc_restricted_protocol)
    if server.http_restricted_api:
        env["HLOSERVE_SERVER_HTTP_RESTRICTED_API"] = ";".join(server.http_restricted_api)
    if server.metrics_use_ssl:  # REST's files serve it: they are passed below
        env["HLOSERVE_SERVER_METRICS_USE_SSL"] = "true" if public else "false"
    for proto in ("grpc", "http"):
        if not (getattr(server, f"{proto}_tls") or (proto == "http" and server.metrics_use_ssl)):
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
