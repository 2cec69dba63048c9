"""Run benchmarks and print their tables: `python -m benches [serving]`.

Each run also writes `benches/results/<scenario>-<UTC time>.json` with the figures, the
machine's load average and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benches import scheduler, serving, shared_memory, weight_cache

RESULTS = Path(__file__).resolve().parent / "results"
SUITES = {
    "serving": serving,
    "scheduler": scheduler,
    "shared_memory": shared_memory,
    "weight_cache": weight_cache,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benches", description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer measurement window")
    args = parser.parse_args()
    for name in args.suites:
        load_before = os.getloadavg()
        rows = SUITES[name].run(window_ms=args.window_ms)
        print(f"== {name} ({platform.node()}, {os.cpu_count()} cores, load {load_before[0]:.2f} before)")
        print(SUITES[name].table(rows))
        RESULTS.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        (RESULTS / f"{name}-{stamp}.json").write_text(
            json.dumps(
                {
                    "suite": name,
                    "utc": stamp,
                    "command": " ".join(["python -m benches", *sys.argv[1:]]),
                    "cpu_count": os.cpu_count(),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                    "rows": SUITES[name].as_json(rows),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
