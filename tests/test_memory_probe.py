"""The opt-in memory probe (`logging.memory_probe_dir`): every server process writes its figures,
the node's supervisor, its worker's engine and that engine's frontend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.clients import assert_serves, wait_until
from support.servers import start_worker

NODE = (sys.executable, "-m", "hloserve.cli", "node")


def test_the_node_its_engine_and_each_frontend_write_their_memory_figures(tmp_path: Path) -> None:
    env = {
        "HLOSERVE_LOGGING_MEMORY_PROBE_DIR": str(tmp_path),
        "HLOSERVE_LOGGING_MEMORY_PROBE_S": "0.2",
        "HLOSERVE_SERVER_FRONTENDS": "1",  # the node's one worker: an engine and a frontend
    }
    with start_worker(process="subprocess", command=NODE, args=["--cpu-workers", "1"], env=env) as server:
        assert_serves(server.url)

        def probed() -> list[dict[str, object]]:
            files = sorted(tmp_path.glob("*.jsonl"))
            lines = [json.loads(f.read_text().splitlines()[-1]) for f in files if f.read_text()]
            return lines if {line["role"] for line in lines} == {"node", "engine", "frontend"} else []

        wait_until(probed, timeout=60, what="a probe line from the node, the engine and the frontend")
        lines = probed()
    for line in lines:
        assert line["pid"] != 0 and line["rss_bytes"] > 10 << 20 and line["descriptors"] > 3  # type: ignore[operator]
        assert line["threads"] >= 2 and line["heap_bytes"] > 0  # type: ignore[operator]
        allocator = line["allocator"]
        assert isinstance(allocator, dict) and allocator["in_use"] > 0
        assert isinstance(line["top_growth"], list)
        # every process settled its heap at startup (the node too: it proxies every load and
        # unload, whose names would otherwise rebuild the interned-string table under load)
        assert line["frozen_objects"] > 0, f"the {line['role']} did not settle its heap"  # type: ignore[operator]


_UNTRACED = """
import sys, time, tracemalloc
from pathlib import Path
from hloserve.config import LoggingConfig
from hloserve.memory_probe import start_memory_probe
settings = LoggingConfig(memory_probe_dir=Path(sys.argv[1]), memory_probe_s=0.05, memory_probe_trace=False)
assert start_memory_probe(settings, "engine")
time.sleep(0.25)
names = [sys.intern(f"probe-{i}") for i in range(5000)]
time.sleep(0.25)
print(tracemalloc.is_tracing())
"""


def test_without_tracing_the_probe_writes_the_process_s_figures_and_leaves_tracemalloc_off(
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-c", _UNTRACED, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
    (probe,) = tmp_path.glob("engine-*.jsonl")
    lines = [json.loads(line) for line in probe.read_text().splitlines()]
    assert len(lines) >= 2
    for line in lines:
        assert line["rss_bytes"] > 10 << 20 and line["allocator"]["in_use"] > 0
        assert "heap_bytes" not in line and "top_growth" not in line
    # the interned strings are counted where Python can count them (3.12+), left out before
    if sys.version_info >= (3, 12):
        assert lines[-1]["interned_strings"] >= lines[0]["interned_strings"] + 5000
    else:
        assert all("interned_strings" not in line for line in lines)


_BASELINED = """
import sys, time
from pathlib import Path
from hloserve.config import LoggingConfig
from hloserve.memory_probe import start_memory_probe
settings = LoggingConfig(memory_probe_dir=Path(sys.argv[1]), memory_probe_s=0.05, memory_probe_baseline_s=0.5)
assert start_memory_probe(settings, "engine")
early = [bytearray(1000) for _ in range(3000)]  # allocated during warm-up
time.sleep(1.0)
late = [bytearray(1000) for _ in range(2000)]  # allocated after the baseline
time.sleep(0.5)
"""


def test_the_probe_s_top_growth_counts_from_its_baseline_after_warm_up(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", _BASELINED, str(tmp_path)], timeout=60, check=True)
    (probe,) = tmp_path.glob("engine-*.jsonl")
    lines = [json.loads(line) for line in probe.read_text().splitlines()]
    source = _BASELINED.splitlines()
    early, late = (f"<string>:{source.index(s) + 1}" for s in source if s.startswith(("early =", "late =")))
    assert all(line["top_growth"] == [] for line in lines if line["uptime_s"] < 0.5)
    grown = {g["line"]: g["bytes"] for g in lines[-1]["top_growth"]}
    assert grown.get(late, 0) >= 2000 * 1000 and early not in grown
