"""A node over a large catalogue (issue 36): `hloserve node --cpu-workers 2` over N variants of
`cnn` (`benches.scale.make_catalogue`), N = 10, 1,000 and 10,000; `--sizes` picks others.

For each N: the seconds from spawning the node to its first ServerReady answer through Envoy
(every model routed); then, with no traffic, the cores each process keeps busy over 30 s: the
node's own process (the controller, whose discovery round calls ServerReady, RepositoryIndex
and ModelControlStatus on every worker each `node.discovery_interval_s`), each worker (its
answers to those calls) and Envoy; then the median of 5 RepositoryIndex and 5 ModelControlStatus
calls through the node (the controller's union; every worker's status, merged).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benches.frontends import _own_cpu
from benches.node import _children
from benches.scale import ROOT, _free_port, _median_ms, make_catalogue

SIZES = (10, 1000, 10000)
IDLE_S = 30.0
READY_WITHIN_S = 600.0


@dataclass(frozen=True)
class Row:
    models: int
    ready_s: float
    controller_cores: float
    """The node's own process (the controller and its planes) while idle."""
    worker_cores: float
    """The busier of the two workers while idle."""
    envoy_cores: float
    index_ms: float
    status_ms: float


def _control_status(port: int) -> int:
    """ModelControlStatus through the node, as its controller calls a worker's; the number of
    models it lists."""
    from hloserve.fleet.controller import WorkerLink

    async def call() -> int:
        link = WorkerLink("node", f"127.0.0.1:{port}", None)
        try:
            return len((await link.control_status(timeout=120)).models)
        finally:
            link.reset()

    return asyncio.run(call())


def measure(models: int) -> Row:
    import tritonclient.grpc as grpcclient

    directory = Path(tempfile.mkdtemp(prefix="hloserve-node-scale-"))
    try:
        make_catalogue(directory / "repository", models, distinct=False)
        port = _free_port()
        command = [sys.executable, "-m", "hloserve.cli", "node", "--cpu-workers", "2",
                   "--grpc-port", str(port), "--http-port", "-1", "--metrics-port", "-1",
                   "--model-repository", str(directory / "repository")]  # fmt: skip
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            while True:
                try:
                    if client.is_server_ready():
                        break
                except Exception:
                    pass
                if process.poll() is not None or time.perf_counter() - started > READY_WITHIN_S:
                    raise RuntimeError(f"the node of {models} models was not ready within {READY_WITHIN_S} s")
                time.sleep(0.5)
            ready_s = time.perf_counter() - started
            processes = {"node": process.pid, **_children(process.pid)}
            before = {name: _own_cpu(pid) for name, pid in processes.items()}
            time.sleep(IDLE_S)
            cores = {name: (_own_cpu(pid) - before[name]) / IDLE_S for name, pid in processes.items()}
            workers = [v for name, v in cores.items() if name not in ("node", "envoy")]
            index = client.get_model_repository_index()
            if len(index.models) != models:
                raise RuntimeError(f"the node's index lists {len(index.models)} models of {models}")
            if _control_status(port) != models:
                raise RuntimeError(f"the node's control status does not list all {models} models")
            return Row(
                models=models,
                ready_s=round(ready_s, 1),
                controller_cores=round(cores["node"], 3),
                worker_cores=round(max(workers), 3),
                envoy_cores=round(cores.get("envoy", 0.0), 3),
                index_ms=round(_median_ms(client.get_model_repository_index), 1),
                status_ms=round(_median_ms(lambda: _control_status(port)), 1),
            )
        finally:
            client.close()
            process.terminate()
            process.wait(60)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(window_ms: int = 0, sizes: list[int] | None = None) -> list[Row]:
    del window_ms  # fixed calls and an idle window, not a perf_analyzer window
    rows = []
    for models in sizes or SIZES:
        rows.append(measure(models))
        print(f"  {rows[-1]}", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    head = "models  ready s  idle cores: node  worker  envoy  index ms  status ms"
    lines = [
        f"{r.models:>6}  {r.ready_s:>7}  {r.controller_cores:>16}  {r.worker_cores:>6}  {r.envoy_cores:>5}  "
        f"{r.index_ms:>8}  {r.status_ms:>9}"
        for r in rows
    ]
    return "\n".join([head, *lines])


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
