"""Envoy with the node's routes and clusters for N models (`python -m benches routes`).

Every model is placed on the same two workers, which the files name but nothing listens at, as
the controller's port: what is measured is Envoy's side alone. Per size: the seconds the
controller takes to write the files and their size, the seconds Envoy takes to apply them and
its resident memory then, and the median time of a request no model claims (it walks to the
controller's route; a closed port answers 503 at once), over gRPC and REST.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tritonclient.utils import InferenceServerException

from hloserve.fleet import envoy
from hloserve.fleet.workers import free_port

SIZES = (10, 1000, 10_000)
CALLS = 200


@dataclass(frozen=True)
class Row:
    models: int
    write_s: float
    files_mb: float
    envoy_apply_s: float
    envoy_rss_mb: float
    grpc_unclaimed_ms: float
    rest_unclaimed_ms: float


def _write(directory: Path, models: int) -> float:
    """The node's files for `models` models on two workers and a controller at closed ports; the
    seconds taken."""
    workers = [
        envoy.Endpoint(f"127.0.0.1:{port}", f"127.0.0.1:{port}") for port in (free_port(), free_port())
    ]
    controller = f"127.0.0.1:{free_port()}"
    placement = {f"v{i}": workers for i in range(models)}
    started = time.perf_counter()
    versioned = {"version_info": "1"}
    clusters = envoy.clusters(placement.values(), controller, "LEAST_REQUEST", 1 << 26, controller)
    envoy.write_atomically(directory / "clusters.json", versioned | clusters)
    envoy.write_atomically(directory / "routes.json", versioned | envoy.routes(placement))
    envoy.write_atomically(directory / "routes_http.json", versioned | envoy.http_routes(placement))
    return time.perf_counter() - started


def _median_ms(call: Callable[[], str], expected: str) -> float:
    """The median ms of `call`, which answers a status: every one must be `expected` (the closed
    controller port's), or the route was not the one being timed."""
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        status = call()
        times.append(time.perf_counter() - started)
        if status != expected:
            raise RuntimeError(f"a request no model claims answered {status}, not {expected}")
    return round(statistics.median(times[CALLS // 10 :]) * 1e3, 3)


def _grpc_status(client: Any, model: str) -> str:
    try:
        client.is_model_ready(model, headers={envoy.MODEL_HEADER: model})
    except InferenceServerException as e:  # the status being checked
        return str(e.status())
    return "OK"


def _rest_status(connection: http.client.HTTPConnection, model: str) -> str:
    connection.request("GET", f"/v2/models/{model}/ready")
    answer = connection.getresponse()
    answer.read()
    return str(answer.status)


def measure(models: int) -> Row:
    import tritonclient.grpc as grpc

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        envoy.write_atomically(directory / "routing.pb", envoy.descriptor_set())
        write_s = _write(directory, models)
        files_mb = sum(
            (directory / f).stat().st_size for f in ("clusters.json", "routes.json", "routes_http.json")
        )
        ports = {name: free_port() for name in ("grpc", "http", "admin")}
        bootstrap = envoy.bootstrap(
            directory, "127.0.0.1", ports["grpc"], ports["http"], ports["admin"], 1 << 26
        )
        (directory / "envoy.json").write_text(json.dumps(bootstrap))
        started = time.perf_counter()
        process = subprocess.Popen(
            [envoy.find_envoy(), "-c", str(directory / "envoy.json"), "--disable-hot-restart", "-l", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while True:
                try:
                    if envoy.applied(f"127.0.0.1:{ports['admin']}", 5.0).version == 1:
                        break
                except OSError:
                    pass
                if time.perf_counter() - started > 300:
                    raise RuntimeError(f"Envoy did not apply {models} models' files within 300 s")
                time.sleep(0.05)
            apply_s = time.perf_counter() - started
            status = Path(f"/proc/{process.pid}/status").read_text()
            rss_mb = int(status.split("VmRSS:")[1].split()[0]) / 1024
            on_grpc = grpc.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
            on_rest = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=10)
            grpc_ms = _median_ms(lambda: _grpc_status(on_grpc, "unclaimed"), "StatusCode.UNAVAILABLE")
            rest_ms = _median_ms(lambda: _rest_status(on_rest, "unclaimed"), "503")
            on_grpc.close()
            on_rest.close()
        finally:
            process.terminate()
            process.wait(10)
    return Row(
        models,
        round(write_s, 2),
        round(files_mb / 1e6, 1),
        round(apply_s, 2),
        round(rss_mb),
        grpc_ms,
        rest_ms,
    )


def run(window_ms: int = 0, sizes: list[int] | None = None) -> list[Row]:
    del window_ms  # a fixed number of calls, not a window
    rows = []
    for models in sizes or SIZES:
        rows.append(measure(models))
        print(f"  {rows[-1]}", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    head = "models  write s  files MB  Envoy apply s  Envoy RSS MB  gRPC unclaimed ms  REST unclaimed ms"
    lines = [
        f"{r.models:>6}  {r.write_s:>7}  {r.files_mb:>8}  {r.envoy_apply_s:>13}  {r.envoy_rss_mb:>12}  "
        f"{r.grpc_unclaimed_ms:>17}  {r.rest_unclaimed_ms:>17}"
        for r in rows
    ]
    return "\n".join([head, *lines])


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
