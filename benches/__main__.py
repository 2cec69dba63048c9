"""Run benchmarks and print their tables: `python -m benches [compare|serving|scheduler|...]`.

With no suite named it runs `compare`, hloserve beside Triton, MLServer and KServe. Each run
writes `benches/results/<suite>-<UTC time>.json` with the figures, the machine, its load and
the command; `compare` also draws one PNG per scenario into `benches/results/<run>/` and puts
its table in `benches/README.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benches import (
    anchors,
    breakdown,
    compare,
    frontends,
    imports,
    node,
    node_scale,
    overload,
    rest,
    routes,
    scale,
    scheduler,
    serving,
    shared_memory,
    soak,
    tracing,
    weight_cache,
    zoo,
)
from benches.charts import write_charts

BENCHES = Path(__file__).resolve().parent
RESULTS = BENCHES / "results"
SUITES = {
    "compare": compare,
    "serving": serving,
    "scheduler": scheduler,
    "shared_memory": shared_memory,
    "weight_cache": weight_cache,
    "breakdown": breakdown,
    "overload": overload,
    "node": node,
    "frontends": frontends,
    "rest": rest,
    "tracing": tracing,
    "zoo": zoo,
    "scale": scale,
    "anchors": anchors,
    "imports": imports,
    "soak": soak,
    "routes": routes,
    "node_scale": node_scale,
}
_BEGIN, _END = "<!-- latest compare run: begin -->", "<!-- latest compare run: end -->"


def _machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {memory_gib:.0f} GiB, {platform.system()} {platform.release()}"


def _update_readme(table: str, stamp: str, command: str, charts: list[Path]) -> None:
    readme = BENCHES / "README.md"
    text = readme.read_text()
    if _BEGIN not in text or _END not in text:
        raise RuntimeError(f"{readme} lost its markers {_BEGIN!r} / {_END!r}")
    images = "\n".join(f"![{p.stem}]({p.relative_to(BENCHES)})" for p in charts)
    block = (
        f"{_BEGIN}\nRun {stamp} on {_machine()}, with `{command}`:\n\n```\n{table}\n```\n\n{images}\n{_END}"
    )
    head, rest = text.split(_BEGIN, 1)
    readme.write_text(head + block + rest.split(_END, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benches", description=__doc__.splitlines()[0])
    parser.add_argument(
        "suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default: compare)"
    )
    parser.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer measurement window")
    parser.add_argument(
        "--quick", action="store_true", help="zoo, anchors, imports: one small model, one size, few calls"
    )
    parser.add_argument(
        "--models",
        help="zoo, anchors: comma-separated zoo models (default: the whole zoo); imports: zoo models to "
        "import through ONNX besides the ONNX zoo",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="zoo: hloserve and torch both on this many cores (default: all); anchors, imports: this count "
        "only (default: 1 and 2)",
    )
    parser.add_argument(
        "--sizes",
        help="scale, routes, node_scale: comma-separated catalogue sizes (default: 10,100,1000,10000; "
        "10,1000,10000 for the others)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="anchors: another zoo cache (an earlier exporter's), its exports timed in the same rounds",
    )
    parser.add_argument("--duration", type=float, default=600, help="soak: seconds of load")
    parser.add_argument("--frontends", type=int, default=0, help="soak: serve with this many frontends")
    parser.add_argument("--node", action="store_true", help="soak: through `hloserve node --cpu-workers 2`")
    parser.add_argument(
        "--no-trace", action="store_true", help="soak: the memory probe without tracemalloc (no heap figures)"
    )
    args = parser.parse_args()
    unknown = [name for name in args.suites if name not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; expected any of {list(SUITES)}")
    command = " ".join(["python -m benches", *sys.argv[1:]])
    for name in args.suites or ["compare"]:
        load_before = os.getloadavg()
        models = args.models.split(",") if args.models else None
        extra: dict[str, object] = (
            {"quick": args.quick, "models": models, "threads": args.threads}
            if name in ("zoo", "anchors", "imports")
            else {}
        )
        if name == "anchors" and args.baseline:
            extra["baseline"] = args.baseline
        if name in ("scale", "routes", "node_scale") and args.sizes:
            extra = {"sizes": [int(n) for n in args.sizes.split(",")]}
        if name == "soak":
            extra = {
                "duration_s": args.duration,
                "frontends": args.frontends,
                "node": args.node,
                "trace": not args.no_trace,
            }
        rows = SUITES[name].run(window_ms=args.window_ms, **extra)
        table = SUITES[name].table(rows)
        print(f"== {name} ({platform.node()}, {_machine()}, load {load_before[0]:.2f} before)")
        print(table)
        RESULTS.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        figures = SUITES[name].as_json(rows)
        (RESULTS / f"{name}-{stamp}.json").write_text(
            json.dumps(
                {
                    "suite": name,
                    "utc": stamp,
                    "command": command,
                    "machine": _machine(),
                    "python": platform.python_version(),
                    "cpu_count": os.cpu_count(),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                    "rows": figures,
                },
                indent=2,
            )
        )
        if name == "compare":
            charts = write_charts(figures, RESULTS / f"{name}-{stamp}")
            _update_readme(table, stamp, command, charts)
            print(f"charts in {RESULTS / f'{name}-{stamp}'}; table in {BENCHES / 'README.md'}")


if __name__ == "__main__":
    main()
