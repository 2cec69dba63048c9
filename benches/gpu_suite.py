"""The GPU scenarios in one go: `benches/gpu` runs this on a GPU machine (and on a CPU, `--quick`,
which the test suite does so that it cannot rot).

- Host-to-device bandwidth by transfer size, from pageable memory (64-byte aligned numpy arrays),
  from a POSIX shared-memory region (a shared host floor) and from pinned host memory (where the
  weight cache keeps private `system` floors on a GPU), median of five.
- The self-sized weight budget: a worker started with no budget configured sizes it from the
  allocator's limit and the warm-up peaks; its resolved budget and the device statistics.
- Cold against warm requests for 10, 100 and 500 MB models beside a raw put of the same bytes
  from pageable and from pinned memory (`benches/weight_cache.py`; target: the cold overhead at
  most 1.2x the raw pinned put).
- A catalogue ten times the budget under Zipf traffic against the same catalogue all resident
  (target: at least 0.9x), with and without overlapping loads.
- Compaction: a worker in this process serves a catalogue of mixed sizes under a budget, then
  compacts; the allocator's statistics before and after. Beside it, a fragmented allocator
  provoked by hand (fill with blocks, free every other one): whether a block twice their size
  fails there and succeeds once everything is freed, as compaction frees it.
- ResNet-50 and ViT-B/16 (benches/gpu_models.py) exported on this machine in float32 and bf16
  and served at batch 1 and 8: compute per execution and the gRPC request (`--quick`: a small
  CNN in their place), beside the same model in torch on the same device, eager and
  `torch.compile` (target: hloserve's compute within 1.2x of torch.compile in bf16).

Results go to one JSON file (`--output`, by default `benches/results/gpu-<UTC>.json`) and are
printed as they come.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benches import weight_cache
from benches.serving import _free_port, start_server

RESULTS = Path(__file__).resolve().parent / "results"


def _median_s(action: Callable[[], list[Any]], repeats: int) -> float:
    from hloserve.models import _xla

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        placed = action()
        for array in placed:
            array.block_until_ready()
        times.append(time.perf_counter() - started)
        _xla.free(placed)
    return statistics.median(times)


def _shared_put_s(region: Any, shape: tuple[int, ...], repeats: int) -> float:
    from hloserve.models import _xla

    shared = np.ndarray(shape, np.float32, buffer=region.buf)
    shared[:] = 1.0
    return _median_s(lambda: _xla.put_all([shared]), repeats)


def bandwidth(sizes_mb: tuple[int, ...], repeats: int = 5) -> list[dict[str, Any]]:
    """Host-to-device GB/s by size, from pageable memory, from a POSIX shared-memory region (what
    `weights.shared_host_weights` floors are: pageable, JAX cannot pin them) and from pinned host
    memory."""
    from multiprocessing import shared_memory

    from hloserve.models import _xla

    rows = []
    for mb in sizes_mb:
        nbytes = mb << 20
        host = _xla.host_buffer(nbytes).view(np.float32)
        host[:] = 1.0
        pageable = _median_s(lambda: _xla.put_all([host]), repeats)  # noqa: B023
        row: dict[str, Any] = {
            "mb": mb,
            "pageable_ms": round(pageable * 1e3, 3),
            "pageable_gb_per_s": round(nbytes / pageable / 1e9, 2),
        }
        region = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            seconds = _shared_put_s(region, host.shape, repeats)
            row["shm_ms"] = round(seconds * 1e3, 3)
            row["shm_gb_per_s"] = round(nbytes / seconds / 1e9, 2)
        finally:
            region.close()  # the array over it is gone with _shared_put_s's frame
            region.unlink()
        try:
            pinned_host = _xla.pin([host])
        except Exception as e:  # the row says why instead of the figures
            row["pinned_error"] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        else:
            pinned = _median_s(lambda: _xla.put_all(pinned_host), repeats)  # noqa: B023
            row["pinned_ms"] = round(pinned * 1e3, 3)
            row["pinned_gb_per_s"] = round(nbytes / pinned / 1e9, 2)
            _xla.free(pinned_host)
        rows.append(row)
    return rows


def self_sized_budget() -> dict[str, Any]:
    """Start a worker on a small catalogue with no budget configured; report what it resolved."""
    import asyncio

    from grpclib.client import Channel

    from hloserve._proto import hloserve_control as hc
    from hloserve.models import _xla

    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "catalogue"
        weight_cache._catalogue(repository)
        port = _free_port()
        server = start_server(port, settings={"HLOSERVE_SERVER_MODEL_REPOSITORY": str(repository)})
        try:

            async def status() -> Any:
                channel = Channel("127.0.0.1", port)
                try:
                    return await hc.ControlServiceStub(channel).model_control_status(
                        hc.ModelControlStatusRequest()
                    )
                finally:
                    channel.close()

            resolved = asyncio.run(status())
        finally:
            server.terminate()
            server.wait(60)
    return {
        "device": str(_xla.device()),
        "memory_stats": _xla.memory_stats(),
        "resolved_on_demand_bytes": resolved.weight_cache_max_bytes,
        "residency_mode": resolved.residency_mode,
    }


@contextmanager
def _worker(config: Any) -> Iterator[tuple[Any, Callable[..., Any]]]:
    """A worker serving `config` in a thread of this process (so that this process's allocator
    statistics are the worker's); yields it and a function running a coroutine function on it."""
    import trio

    from hloserve.worker import serve

    started: queue.Queue[Any] = queue.Queue()
    stop: list[trio.Event] = []
    token: list[Any] = []

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())
        stop.append(trio.Event())
        try:
            async with serve(config) as worker:
                started.put(worker)
                await stop[0].wait()
        except BaseException as e:
            started.put(e)
            raise

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    worker = started.get(timeout=300)
    if isinstance(worker, BaseException):
        raise RuntimeError("the worker failed to start") from worker
    try:
        yield worker, lambda fn, *args: trio.from_thread.run(lambda: fn(*args), trio_token=token[0])
    finally:
        trio.from_thread.run_sync(stop[0].set, trio_token=token[0])
        thread.join(60)


def compaction(sizes_mb: tuple[int, ...], requests: int) -> dict[str, Any]:
    """Serve a catalogue of mixed sizes under a budget of about half of it in this process,
    `requests` requests in a shuffled order, then compact: the allocator's statistics before and
    after, and what the cache held."""
    import tritonclient.grpc as grpcclient

    from hloserve.config import load_config
    from hloserve.models import _xla

    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "mixed"
        for i, mb in enumerate(sizes_mb):
            weight_cache._export_weighty(repository / f"c{i}", np.full(mb << 18, i, np.float32))
        budget = (sum(sizes_mb) << 20) // 2
        config = load_config(environ={})
        config = config.replace(
            "server", model_repository=repository, grpc_port=0, http_port=-1, metrics_port=-1
        )
        config = config.replace("weights", budget_bytes=budget)
        with _worker(config) as (worker, call):
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{worker.grpc_port}")
            tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
            order = np.random.default_rng(7).integers(0, len(sizes_mb), requests)
            for i in order:
                client.infer(f"c{i}", [tensor])
            client.close()
            before = _xla.memory_stats()
            started = time.perf_counter()
            done = call(worker.compact, [])
            seconds = time.perf_counter() - started
            after = _xla.memory_stats()
    return {
        "sizes_mb": list(sizes_mb),
        "budget_bytes": budget,
        "requests": requests,
        "memory_stats_before": before,
        "memory_stats_after": after,
        "compact_ms": round(seconds * 1e3, 2),
        "resident_bytes_after": done.resident_bytes,
        "fragmentation": fragmentation(),
    }


def fragmentation(block_mb: int = 256, most_blocks: int = 2048) -> dict[str, Any]:
    """Fill the device allocator with `block_mb` blocks until it refuses, free every other one,
    and ask for a block twice as large: refused there (fragmentation), granted once every block
    is freed (what compaction does to the weight cache's buffers). Needs allocator statistics (a
    GPU); elsewhere says it did not run."""
    import jax.numpy as jnp

    from hloserve.models import _xla

    if _xla.memory_stats() is None:
        return {"ran": False, "why": "the backend keeps no allocator statistics (a CPU)"}
    blocks: list[Any] = []

    def block(mb: int) -> Any:
        array = jnp.zeros(mb << 18, jnp.float32, device=_xla.device())
        array.block_until_ready()
        return array

    try:
        while len(blocks) < most_blocks:
            blocks.append(block(block_mb))
    except Exception:  # RESOURCE_EXHAUSTED: the allocator is full
        pass
    full = _xla.memory_stats()
    _xla.free(blocks[::2])
    kept = blocks[1::2]
    fragmented = _xla.memory_stats()
    try:
        _xla.free([block(2 * block_mb)])
        refused_before = False
    except Exception:
        refused_before = True
    _xla.free(kept)
    try:
        _xla.free([block(2 * block_mb)])
        granted_after = True
    except Exception:
        granted_after = False
    return {
        "ran": True,
        "block_mb": block_mb,
        "blocks": len(blocks),
        "memory_stats_full": full,
        "memory_stats_fragmented": fragmented,
        "double_block_refused_when_fragmented": refused_before,
        "double_block_granted_after_freeing": granted_after,
        "memory_stats_after": _xla.memory_stats(),
    }


REAL_MODELS = ("resnet50", "vit_b_16")
"""Specs in benches/gpu_models.py, each exported and measured in every precision at every batch size."""
PRECISIONS = ("fp32", "bf16")
REAL_BATCH_SIZES = (1, 8)
MODEL_SPECS = Path(__file__).resolve().parent / "gpu_models.py"


def torch_anchors(name: str, precision: str, batch: int, repeats: int) -> dict[str, Any]:
    """The same model in torch on the same device (the GPU where there is one): eager and
    `torch.compile` (Inductor, default mode, `dynamic=False`: one static graph per batch size, as
    hloserve compiles), in `precision` (bf16: the module and its input cast), medians in ms of
    `repeats` after two warm-ups, each call synchronized; and torch.compile's first call in s."""
    import torch

    from benches import gpu_models

    spec = getattr(gpu_models, name)()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = spec["module"].to(device=device, dtype=dtype).eval()
    (example,) = spec["example_inputs"]
    image = torch.randn(batch, *example.shape[1:], generator=torch.Generator().manual_seed(batch))
    image = image.to(device=device, dtype=dtype)

    def synchronized(call: Callable[[], Any]) -> float:
        started = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def median_ms(call: Callable[[], Any]) -> float:
        times = [synchronized(call) for _ in range(repeats + 2)][2:]
        return round(statistics.median(times) * 1e3, 3)

    with torch.no_grad():
        eager_ms = median_ms(lambda: model(image))
        compiled: Any = torch.compile(model, dynamic=False)
        compile_s = synchronized(lambda: compiled(image))
        compiled_ms = median_ms(lambda: compiled(image))
    torch._dynamo.reset()
    return {
        "torch_device": device,
        "torch_eager_ms": eager_ms,
        "torch_compile_ms": compiled_ms,
        "torch_compile_s": round(compile_s, 1),
    }


def real_models(names: tuple[str, ...], repeats: int) -> list[dict[str, Any]]:
    """Export each model with `hloserve export --precision P --batch-sizes 1,8` on this machine
    (verified on its device against torch in float32), serve them all from one `hloserve serve`
    and time each at each batch size: compute per execution (ModelStatistics) and the gRPC
    request, medians of `repeats`. A model that does not export gets a row saying why."""
    import tritonclient.grpc as grpcclient

    from benches import zoo
    from hloserve.models import _xla
    from hloserve.models.bundle import load_bundle

    platform = "cpu" if _xla.device().platform == "cpu" else "cuda"  # lowered for, verified on
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "repository"
        exported = []
        for name in names:
            for precision in PRECISIONS:
                bundle = repository / f"{name}_{precision}"
                row: dict[str, Any] = {"model": name, "precision": precision}
                started = time.monotonic()
                done = subprocess.run(
                    [sys.executable, "-m", "hloserve.cli", "export", f"{MODEL_SPECS}:{name}",
                     "--out", str(bundle), "--batch-sizes", ",".join(map(str, REAL_BATCH_SIZES)),
                     "--precision", precision, "--platform", platform],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                row["export_s"] = round(time.monotonic() - started, 1)
                if done.returncode != 0:
                    rows.append({**row, "error": "\n".join(done.stderr.strip().splitlines()[-5:])})
                    continue
                row["weight_bytes"] = load_bundle(bundle).weight_nbytes
                exported.append((bundle.name, row))
        if not exported:
            return rows
        port = _free_port()
        server = zoo.serve(repository, port)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            for served, row in exported:
                for batch in REAL_BATCH_SIZES:
                    shape = (batch, *(int(d) for d in client.get_model_metadata(served).inputs[0].shape[1:]))
                    image = np.random.default_rng(batch).standard_normal(shape, np.float32)
                    request = zoo.tensors({"IMAGE": image})
                    timed = [zoo.served(client, served, request) for _ in range(repeats + 2)][2:]
                    compute_ms = round(statistics.median(t[0] for t in timed), 3)
                    anchors = torch_anchors(row["model"], row["precision"], batch, repeats)
                    rows.append({
                        **row, "batch": batch, "compute_ms": compute_ms,
                        "grpc_ms": round(statistics.median(t[1] for t in timed), 3),
                        **anchors,
                        "compute_over_torch_compile": round(compute_ms / anchors["torch_compile_ms"], 3),
                    })  # fmt: skip
                    print("real model:", rows[-1], flush=True)
        finally:
            client.close()
            server.terminate()
            server.wait(60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CPU dry run")
    parser.add_argument("--output", type=Path, help="the JSON file (default: benches/results/gpu-<UTC>.json)")
    args = parser.parse_args()
    if args.quick:
        weight_cache.SIZES_MB = (1, 4)
        weight_cache.SECONDS = 1.0
        weight_cache.WEIGHT_FLOATS = 1 << 16
    begun = time.monotonic()
    sizes = (1, 16) if args.quick else (1, 4, 16, 64, 256, 1024)
    results: dict[str, Any] = {
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    results["bandwidth"] = bandwidth(sizes)
    print("host-to-device bandwidth:", results["bandwidth"], flush=True)
    results["budget"] = self_sized_budget()
    print("self-sized budget:", results["budget"], flush=True)
    cold = weight_cache.run_cold(repeats=2 if args.quick else 5)
    results["cold"] = weight_cache.as_json(list(cold))
    print(weight_cache.cold_table(cold), flush=True)
    zipf = weight_cache.run_zipf()
    results["catalogue"] = [asdict(r) for r in zipf]
    results["catalogue_note"] = (
        "the catalogue's models compute almost nothing: an execution expected under "
        "INLINE_WORK_S runs on the loop's thread and starts no overlapping load, so the rows with "
        "and without overlap differ only where executions went to a worker thread"
    )
    print(weight_cache.table(list(zipf)), flush=True)
    results["compaction"] = compaction(
        (1, 2, 3, 5) if args.quick else (64, 96, 160, 256, 384), 12 if args.quick else 40
    )
    print("compaction:", results["compaction"], flush=True)
    results["real_models"] = real_models(
        ("small_cnn",) if args.quick else REAL_MODELS, 3 if args.quick else 20
    )
    results["seconds"] = round(time.monotonic() - begun, 1)
    path = args.output or RESULTS / f"gpu-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"written {path} after {results['seconds']} s")


if __name__ == "__main__":
    main()
