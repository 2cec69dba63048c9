"""The GPU scenarios in one go: `benches/gpu` runs this on a GPU machine (and on a CPU, `--quick`).

- Host-to-device bandwidth by transfer size: a raw `device_put` of 64-byte aligned host arrays
  (what the weight cache's host floor hands to the device), median of five.
- The self-sized weight budget: a worker started with no budget configured sizes it from the
  allocator's limit and the warm-up peaks; its resolved budget and the device statistics.
- Cold against warm requests for 10, 100 and 500 MB models beside a raw put of the same bytes
  (`benches/weight_cache.py`; target: the cold overhead at most 1.2x the raw put).
- A catalogue ten times the budget under Zipf traffic against the same catalogue all resident.

Results go to `benches/results/gpu-<UTC>.json` and are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benches import weight_cache
from benches.serving import _free_port, start_server

RESULTS = Path(__file__).resolve().parent / "results"


def bandwidth(sizes_mb: tuple[int, ...], repeats: int = 5) -> list[dict[str, float]]:
    from hloserve import _xla

    rows = []
    for mb in sizes_mb:
        host = _xla.host_buffer(mb << 20).view(np.float32)
        host[:] = 1.0
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            placed = _xla.put(host)
            placed.block_until_ready()
            times.append(time.perf_counter() - started)
            _xla.free([placed])
        seconds = statistics.median(times)
        rows.append(
            {"mb": mb, "ms": round(seconds * 1e3, 3), "gb_per_s": round((mb << 20) / seconds / 1e9, 2)}
        )
    return rows


def self_sized_budget() -> dict[str, Any]:
    """Start a worker on a small catalogue with no budget configured; report what it resolved."""
    import asyncio

    from grpclib.client import Channel

    from hloserve import _xla
    from hloserve._proto import hloserve_control as hc

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a CPU dry run")
    args = parser.parse_args()
    if args.quick:
        weight_cache.SIZES_MB = (1, 10)
        weight_cache.SECONDS = 2.0
    sizes = (1, 16, 64) if args.quick else (1, 16, 64, 256, 1024)
    results: dict[str, Any] = {"bandwidth": bandwidth(sizes)}
    print("host-to-device bandwidth:", results["bandwidth"], flush=True)
    results["budget"] = self_sized_budget()
    print("self-sized budget:", results["budget"], flush=True)
    cold = weight_cache.run_cold()
    results["cold"] = [{**asdict(r), "overhead_ratio": r.overhead_ratio} for r in cold]
    print(weight_cache.cold_table(cold), flush=True)
    zipf = weight_cache.run_zipf()
    results["catalogue"] = [asdict(r) for r in zipf]
    print(weight_cache.table(list(zipf)), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gpu-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"written {path}")


if __name__ == "__main__":
    main()
