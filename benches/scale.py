"""Catalogue scale (issue 36): N variants of one small model on one worker, N = 10 .. 10,000.

The catalogue is N copies of the shipped example `cnn` bundle (byte-identical modules, 1.6 KB of
weights of its own each): every variant shares one program. A second series makes every module
distinct (a comment line of its own), so each model compiles (fresh cache) or reads (warm cache)
its own executables: what a catalogue of different architectures costs.

For each N, `hloserve serve` is started twice in its own process, first with an empty
executable cache (fresh), then with the one the first start filled (warm). "Ready" is the time
from spawning the process to its first ServerReady answer: the worker opens its ports once every
model of the repository is READY (or failed), so it is the time until every model serves. With
the warm server: its resident memory (VmRSS), the RepositoryIndex call's latency (median of 5),
a metrics scrape's time and size (median of 5), then Zipf(1.1) traffic over the catalogue from 1
and from 8 client processes (each one blocking tritonclient gRPC caller), with a weight budget
of a tenth of the catalogue's weights. `python -m benches scale --sizes 10,100` runs some sizes.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CNN = ROOT / "examples" / "repository" / "cnn"
SIZES = (10, 100, 1000, 10000)
DISTINCT_SIZES = (10, 100)
"""The distinct-program series stops early: each model compiles (about 0.1-0.2 s on 2 cores)."""
LOAD_SECONDS = 6.0
ZIPF_S = 1.1


@dataclass(frozen=True)
class Row:
    series: str
    """`shared`: byte-identical modules; `distinct`: a module of its own per model."""
    models: int
    ready_fresh_s: float
    ready_warm_s: float
    rss_mb: float
    index_ms: float
    scrape_ms: float
    scrape_kb: float
    c1_per_s: float
    c1_p50_ms: float
    c1_p99_ms: float
    c8_per_s: float
    c8_p50_ms: float
    c8_p99_ms: float
    errors: int


def make_catalogue(directory: Path, models: int, *, distinct: bool) -> int:
    """`models` variants of `cnn` (`cnn00000`, ...) in `directory`, each with its own weights;
    returns the bytes of weights of one."""
    raw = (CNN / "weights.safetensors").read_bytes()
    header = raw[: 8 + struct.unpack("<Q", raw[:8])[0]]
    floats = (len(raw) - len(header)) // 4
    modules = {f: (CNN / f).read_text() for f in ("model.b1.mlir", "model.b4.mlir")}
    manifest = (CNN / "manifest.yaml").read_text()
    rng = np.random.default_rng(0)
    for i in range(models):
        name = f"cnn{i:05d}"
        bundle = directory / name
        bundle.mkdir(parents=True)
        for file, text in modules.items():
            (bundle / file).write_text(text + (f"// variant {i}\n" if distinct else ""))
        (bundle / "manifest.yaml").write_text(manifest.replace("name: cnn", f"name: {name}"))
        weights = rng.standard_normal(floats).astype(np.float32).tobytes()
        (bundle / "weights.safetensors").write_bytes(header + weights)
    return floats * 4


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(repository: Path, cache: Path, budget: int) -> tuple[subprocess.Popen[bytes], int, int, float]:
    """`hloserve serve` over `repository`; returns it, its gRPC and metrics ports and the
    seconds until it answered ServerReady."""
    import tritonclient.grpc as grpcclient

    grpc_port, metrics_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_LOGGING_LEVEL": "warning",
        "HLOSERVE_SERVER_EXECUTABLE_CACHE": str(cache),
        "HLOSERVE_WEIGHTS_BUDGET_BYTES": str(budget),
    }
    command = [sys.executable, "-m", "hloserve.cli", "serve", "--model-repository", str(repository)]
    command += ["--grpc-port", str(grpc_port), "--http-port", "-1", "--metrics-port", str(metrics_port)]
    started = time.monotonic()
    errors = tempfile.TemporaryFile()  # the server's log, to say why if it dies starting
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        while time.monotonic() < started + 600:
            try:
                if client.is_server_ready():
                    return process, grpc_port, metrics_port, time.monotonic() - started
            except Exception:
                time.sleep(0.05)
            if process.poll() is not None:
                assert process.stderr is not None
                raise RuntimeError(
                    "hloserve exited during start-up:\n" + process.stderr.read().decode()[-3000:]
                )
        process.kill()
        raise RuntimeError("hloserve was not ready in 600 s")
    finally:
        client.close()
        errors.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _median_ms(call: Any, times: int = 5) -> float:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3


def _client(args: tuple[str, int, int, float, float]) -> tuple[list[float], int]:
    """One client process: Zipf-distributed requests until `seconds` pass; its latencies."""
    import tritonclient.grpc as grpcclient

    url, models, seed, seconds, start_at = args
    ranks = 1.0 / np.arange(1, models + 1) ** ZIPF_S
    order = np.random.default_rng(0).permutation(models)  # one popularity order for every client
    chosen = order[np.random.default_rng(seed).choice(models, size=200_000, p=ranks / ranks.sum())]
    client = grpcclient.InferenceServerClient(url)
    image = grpcclient.InferInput("IMAGE", [1, 16, 16, 3], "FP32")
    image.set_data_from_numpy(np.ones((1, 16, 16, 3), np.float32))
    while time.time() < start_at:
        time.sleep(0.001)
    latencies, errors, i = [], 0, 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        model = f"cnn{int(chosen[i % len(chosen)]):05d}"
        i += 1
        began = time.perf_counter()
        try:
            client.infer(model, [image])
        except Exception:
            errors += 1
            continue
        latencies.append(time.perf_counter() - began)
    client.close()
    return latencies, errors


def _zipf(url: str, models: int, clients: int) -> tuple[float, float, float, int]:
    """Throughput, p50 and p99 (ms) and errors of `clients` processes under Zipf traffic."""
    start_at = time.time() + 1.0
    jobs = [(url, models, 1000 + k, LOAD_SECONDS, start_at) for k in range(clients)]
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        results = pool.map(_client, jobs)
    latencies = np.array([x for lat, _ in results for x in lat])
    errors = sum(e for _, e in results)
    if not len(latencies):
        return 0.0, 0.0, 0.0, errors
    return (
        len(latencies) / LOAD_SECONDS,
        float(np.percentile(latencies, 50) * 1e3),
        float(np.percentile(latencies, 99) * 1e3),
        errors,
    )


def measure(models: int, *, distinct: bool, load: bool = True) -> Row:
    import tritonclient.grpc as grpcclient

    work = Path(tempfile.mkdtemp(prefix="hloserve-scale-"))
    try:
        repository, cache = work / "repository", work / "cache"
        weight_bytes = make_catalogue(repository, models, distinct=distinct)
        budget = max(weight_bytes, models * weight_bytes // 10)
        process, _, _, fresh = _start(repository, cache, budget)
        _stop(process)
        process, grpc_port, metrics_port, warm = _start(repository, cache, budget)
        try:
            url = f"127.0.0.1:{grpc_port}"
            client = grpcclient.InferenceServerClient(url)
            index = _median_ms(client.get_model_repository_index)
            assert len(client.get_model_repository_index().models) == models
            client.close()
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            size = len(urllib.request.urlopen(metrics_url, timeout=60).read())
            scrape = _median_ms(lambda: urllib.request.urlopen(metrics_url, timeout=60).read())
            rss = _rss_mb(process.pid)
            one = eight = (0.0, 0.0, 0.0, 0)
            if load:
                one = _zipf(url, models, 1)
                eight = _zipf(url, models, 8)
        finally:
            _stop(process)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Row(
        "distinct" if distinct else "shared",
        models,
        round(fresh, 2),
        round(warm, 2),
        round(rss, 1),
        round(index, 2),
        round(scrape, 1),
        round(size / 1024, 1),
        round(one[0]),
        round(one[1], 2),
        round(one[2], 2),
        round(eight[0]),
        round(eight[1], 2),
        round(eight[2], 2),
        one[3] + eight[3],
    )


def run(window_ms: int = 3000, sizes: list[int] | None = None) -> list[Row]:
    del window_ms  # a fixed load time per run (LOAD_SECONDS)
    chosen = sizes or list(SIZES)
    rows = [measure(n, distinct=False) for n in chosen]
    rows += [measure(n, distinct=True) for n in chosen if n in DISTINCT_SIZES]
    return rows


def table(rows: list[Row]) -> str:
    header = (
        f"{'series':<9}{'N':>7}{'ready fresh':>12}{'warm':>7}{'RSS MB':>8}{'index ms':>9}"
        f"{'scrape ms':>10}{'KB':>7}{'c1 /s':>7}{'p50':>6}{'p99':>6}"
        f"{'c8 /s':>7}{'p50':>6}{'p99':>7}{'err':>5}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.series:<9}{r.models:>7}{r.ready_fresh_s:>12.2f}{r.ready_warm_s:>7.2f}{r.rss_mb:>8.0f}"
            f"{r.index_ms:>9.1f}{r.scrape_ms:>10.1f}{r.scrape_kb:>7.0f}{r.c1_per_s:>7.0f}{r.c1_p50_ms:>6.1f}"
            f"{r.c1_p99_ms:>6.1f}{r.c8_per_s:>7.0f}{r.c8_p50_ms:>6.1f}{r.c8_p99_ms:>7.1f}{r.errors:>5}"
        )
    shared = {r.models: r for r in rows if r.series == "shared"}
    if len(shared) > 1:
        small, large = shared[min(shared)], shared[max(shared)]
        added = large.models - small.models
        per_model_kb = (large.rss_mb - small.rss_mb) * 1024 / added
        warm_ms = (large.ready_warm_s - small.ready_warm_s) * 1e3 / added
        fresh_ms = (large.ready_fresh_s - small.ready_fresh_s) * 1e3 / added
        lines.append(
            f"shared, each model from {small.models} to {large.models}: {per_model_kb:.0f} KB of RSS, "
            f"{warm_ms:.1f} ms of start-up (warm cache), {fresh_ms:.1f} ms (fresh)"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


if __name__ == "__main__":  # one size, for a quick look: python benches/scale.py 100
    print(table([measure(int(sys.argv[1]), distinct="--distinct" in sys.argv)]))
