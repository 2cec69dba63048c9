"""The zoo's models in hloserve beside the runtimes a CPU user would otherwise pick (issue 35).

For each zoo model (tests/zoo, exported as `tox -e zoo` exports it, sharing its cache), at 1
and 2 threads (`--threads N`: N only), one fresh process confined to that many cores times, at
batch 1 and 4, each of:

- `hloserve`: its compute per execution, `CompiledModel.execute` (inputs placed, the executable
  run, outputs read back: what the server's `compute_infer` statistic times), the bundle compiled
  without the executable cache, so the compile is timed as a first load;
- `eager`: torch eager, `torch.set_num_threads(N)`;
- `compile`: `torch.compile` (Inductor, default mode; `dynamic=False`, one static graph per batch
  size as hloserve has), its first call timed as its compile;
- `ort`: ONNX Runtime's CPU provider, `intra_op_num_threads=N`, on the model exported by
  `torch.onnx.export(opset_version=17, dynamo=False)` with a dynamic batch axis;
- `dflt` (where the export kept XLA options of its own, `xla_options`): the same module
  compiled with XLA's defaults, so that each row shows what the chosen options won;
- `portable` (where the export chose hloserve's native kernels, `hloserve_native_kernels`):
  the same module with its composites' portable decompositions, so the row shows what the
  kernels won;
- `baseline` (with `--baseline CACHE`, where it holds the model): the model as another zoo
  cache holds it, an earlier exporter's (run this bench with `HLOSERVE_ZOO_CACHE=CACHE` in a
  worktree of that commit to fill it), so the row shows what a change of the exporter won with
  nothing else changed.

They take turns (`WARMUP` untimed rounds, then at least `REPEATS`; medians), so load from elsewhere
on the machine weighs on all alike; in each turn a runtime is called untimed for at least
`PRIMING_S` (and `PRIMING` calls), then once timed, so that what the runtime before it left behind
(threads still spinning on the cores, caches filled with its own weights) weighs on no timed call:
each runtime is timed as a server that runs that model request after request. XLA:CPU sizes its
thread pool by the cores a process may use, which is why each thread count is its own process. The
ratios are hloserve's time over each anchor's: above 1, hloserve is slower. Export and first-load
compile seconds are reported per model (a cached export reports the seconds the zoo recorded when
it made it, "-" where it recorded none). A cached export whose tuning ran while other processes
kept the cores busy (`provenance.xla_tuning.others_cpu_share` above
`hloserve.export.tuning.BUSY_SHARE`: the zoo's tests export two at a time) is exported again first,
alone, so the options it keeps are the ones an idle machine picks.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
WARMUP = 2
BUDGET_S = 1.0
MAX_ROUNDS = 25
"""Rounds go on past `WARMUP + REPEATS` while hloserve's timed calls add up to under `BUDGET_S`
(at most `MAX_ROUNDS`): small models get more samples for little time."""
PRIMING = 1
"""Untimed calls of a runtime before its timed one in each turn, at the least. Timed right after
another runtime, a call paid for what that one left behind: MobileNetV3-Large at batch 4 on 2
cores ran in hloserve in 34.0 ms right after ONNX Runtime (whose threads spin on after a call
returns) against 22.1 ms back to back, and in another process 28.7 ms after ONNX Runtime and a
50 ms pause (its caches refilled) against 18.7; ONNX Runtime took 18.0 ms right after torch eager
against 11.6 back to back."""
PRIMING_S = 0.2
"""Seconds of untimed calls of a runtime before its timed one in each turn, at the least: one
call was not enough. After one call of ONNX Runtime, hloserve's calls of MobileNetV3-Large on 2
cores ran slower for 60 ms at batch 4 (29.8, 29.7, then 19-21 ms) and for about 100 ms at batch 1
(10-12, then 8-9 ms); with one priming call its batch-4 median was 32.4 ms against 22.0 in blocks
of its own calls, and 21.9 with ONNX Runtime's spinning turned off (medians of 12-15 in one
process each)."""
THREADS = (1, 2)
BATCHES = (1, 4)
RUNTIMES = ("hloserve", "eager", "compile", "ort")
QUICK_MODELS = ("squeezenet1_1",)


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    threads: int
    ms: dict[str, float]
    """Median ms per execution, by runtime (`RUNTIMES`)."""
    ratios: dict[str, float]
    """hloserve's time over each anchor's."""
    export_s: float | None
    """None: a cached export that recorded no seconds."""
    onnx_export_s: float
    compile_s: float
    """hloserve's first-load compile of every batch size (no executable cache)."""
    torch_compile_s: float
    """torch.compile's first call at this batch size (its compile; Inductor's caches may help)."""
    xla_flags: str = field(default="")
    xla_options: dict[str, Any] = field(default_factory=dict)
    """The bundle's XLA options on this platform, as the exporter chose them."""
    defaults_ms: float | None = None
    """hloserve's median ms with XLA's default options instead, in the same rounds (None: the
    bundle has none of its own)."""
    portable_ms: float | None = None
    """hloserve's median ms without its native kernels, in the same rounds (None: the module
    calls none)."""
    baseline_ms: float | None = None
    """hloserve's median ms on the `--baseline` cache's export, in the same rounds (None: none
    asked for, or it does not hold the model)."""


def _zoo() -> Any:
    from benches.zoo import _zoo

    return _zoo()


def _exported(zoo: Any, root: Path, name: str) -> tuple[float | None, float]:
    """Export `name` to the zoo's cache unless cached (again if tuned on a busy machine), and to
    ONNX unless cached; the seconds each took (the export's as the zoo recorded them)."""
    repository = root / "repository" / name
    if _tuned_while_busy(repository):
        print(f"  {name}: exported again, alone (its tuning ran on a busy machine)", flush=True)
        shutil.rmtree(repository)
        zoo._export_seconds(root, name).unlink(missing_ok=True)
    failed = zoo._export(name, root)
    if failed is not None:
        raise RuntimeError(f"export of {name} failed:\n{failed}")
    onnx = root / "seconds" / f"{name}.onnx"
    if not onnx.exists():
        started = time.perf_counter()
        _onnx_export(zoo, name, root / "onnx" / f"{name}.onnx")
        onnx.parent.mkdir(parents=True, exist_ok=True)
        onnx.write_text(f"{time.perf_counter() - started:.2f}")
    export = zoo._export_seconds(root, name)
    return (float(export.read_text()) if export.exists() else None), float(onnx.read_text())


def _tuned_while_busy(repository: Path) -> bool:
    """Whether the export in `repository` chose its XLA options while other processes took more
    than `BUSY_SHARE` of the machine."""
    import yaml

    from hloserve.export.tuning import BUSY_SHARE

    manifest = repository / "manifest.yaml"
    if not manifest.exists():
        return False
    record = (yaml.safe_load(manifest.read_text()).get("provenance") or {}).get("xla_tuning") or {}
    return float(record.get("others_cpu_share") or 0.0) > BUSY_SHARE


def _onnx_export(zoo: Any, name: str, path: Path) -> None:
    import torch

    model = zoo._builder(name)()
    inputs = zoo._requests(name, 2, seed=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    # the TorchScript exporter on purpose: what Triton users' `.onnx` files come from (opset 17);
    # torch deprecates it, in warnings about torch itself (as tests/zoo/test_zoo_onnx.py's export).
    # Attention's fused fast path (torchvision's ViT in eval mode) has no ONNX form: off while
    # exporting, so the exporter sees the layers it is made of.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model,
                tuple(torch.from_numpy(a) for a in inputs.values()),
                str(staging),
                input_names=list(inputs),
                dynamic_axes={key: {0: "batch"} for key in inputs},
                opset_version=17,
                dynamo=False,
            )
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    staging.rename(path)


def run(
    window_ms: int = 0,
    quick: bool = False,
    models: list[str] | None = None,
    threads: int | None = None,
    baseline: Path | None = None,
) -> list[Row]:
    del window_ms  # a fixed number of calls, not a window
    zoo = _zoo()
    names = tuple(models or (QUICK_MODELS if quick else zoo.ZOO))
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        raise ValueError(f"not zoo models: {unknown}; the zoo: {list(zoo.ZOO)}")
    counts = (threads,) if threads else THREADS
    cores = sorted(os.sched_getaffinity(0))
    if max(counts) > len(cores):
        raise ValueError(f"{max(counts)} threads asked for, {len(cores)} cores available")
    root = zoo._cache_root()
    rows = []
    for name in names:
        export_s, onnx_s = _exported(zoo, root, name)
        for count in counts:
            for found in _measure_in_child(name, count, set(cores[:count]), quick, baseline):
                rows.append(Row(**found, export_s=export_s, onnx_export_s=onnx_s))
                print(f"  {_line(rows[-1])}", flush=True)
    return rows


def _measure_in_child(
    name: str, threads: int, cores: set[int], quick: bool, baseline: Path | None = None
) -> list[dict[str, Any]]:
    """One process confined to `cores` measures `name` at every batch size: its rows."""
    arguments = ["benches.anchors", name, str(threads), *(["--quick"] if quick else [])]
    arguments += [f"--baseline={baseline.resolve()}"] if baseline else []
    what = f"{name} at {threads} threads"
    # no pool of torch.compile's compile workers left behind
    return measure_confined(arguments, cores, what, TORCHINDUCTOR_COMPILE_THREADS="1")


def measure_confined(arguments: list[str], cores: set[int], what: str, **env: str) -> list[dict[str, Any]]:
    """`python -m *arguments` in a process confined to `cores` (XLA:CPU sizes its pool by them),
    with `env` added to this one's: the JSON rows its last line prints."""
    done = subprocess.run(
        [sys.executable, "-m", *arguments],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {what} failed:\n{done.stderr[-3000:]}")
    found: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


def measure(
    name: str, threads: int, quick: bool = False, baseline: Path | None = None
) -> list[dict[str, Any]]:
    """In this process (already confined to `threads` cores): `name` at each batch size, the
    four runtimes in turn. Returns `Row` fields but the export seconds."""
    import numpy as np
    import onnxruntime
    import torch

    from hloserve.models import _xla
    from hloserve.models.bundle import load_bundle, read_weights
    from hloserve.models.compiled import compile_bundle

    torch.set_num_threads(threads)
    zoo = _zoo()
    root = zoo._cache_root()
    bundle = load_bundle(root / "repository" / name)
    compiled = compile_bundle(bundle)  # no executable cache: a first load's compile
    defaults = None  # the same module with XLA's defaults: what the chosen options won
    if bundle.xla_options:
        defaults = compile_bundle(replace(bundle, manifest=replace(bundle.manifest, xla_options={})))
    portable = None  # the same module without native kernels, where it calls them: what they won
    if bundle.xla_options.get(_xla.NATIVE_KERNELS):
        platform = _xla.compile_platform()
        off = {**bundle.manifest.xla_options, platform: {**bundle.xla_options, _xla.NATIVE_KERNELS: False}}
        portable = compile_bundle(replace(bundle, manifest=replace(bundle.manifest, xla_options=off)))
    weights = _xla.put_all(read_weights(bundle))
    earlier = None  # the baseline cache's export: what the exporter's change won
    if baseline is not None and (baseline / "repository" / name).is_dir():
        earlier_bundle = load_bundle(baseline / "repository" / name)
        earlier = (compile_bundle(earlier_bundle), _xla.put_all(read_weights(earlier_bundle)))
    model = zoo._builder(name)()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(
        str(root / "onnx" / f"{name}.onnx"), options, providers=["CPUExecutionProvider"]
    )
    batches, repeats = ((1,), 2) if quick else (BATCHES, REPEATS)
    rows = []
    for batch in batches:
        inputs = {k: np.ascontiguousarray(a) for k, a in zoo._requests(name, batch, seed=1).items()}
        ms, torch_compile_s = _time_batch(
            compiled,
            weights,
            model,
            session,
            batch,
            inputs,
            repeats,
            {"defaults": defaults, "portable": portable},
            earlier,
        )
        defaults_ms, portable_ms = ms.pop("defaults", None), ms.pop("portable", None)
        baseline_ms = ms.pop("baseline", None)
        rows.append(
            {
                "model": name,
                "batch": batch,
                "threads": threads,
                "ms": ms,
                "ratios": {r: round(ms["hloserve"] / ms[r], 3) for r in RUNTIMES[1:]},
                "compile_s": round(compiled.compile_s, 2),
                "torch_compile_s": round(torch_compile_s, 2),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "xla_options": dict(bundle.xla_options),
                "defaults_ms": defaults_ms,
                "portable_ms": portable_ms,
                "baseline_ms": baseline_ms,
            }
        )
    return rows


def _time_batch(
    compiled: Any,
    weights: Any,
    model: Any,
    session: Any,
    batch: int,
    inputs: dict[str, Any],
    repeats: int,
    variants: dict[str, Any] | None = None,
    baseline: tuple[Any, Any] | None = None,
) -> tuple[dict[str, float], float]:
    """Median ms per call of each runtime on `inputs` (and of each of `variants`, hloserve's
    module compiled otherwise, under its name: "defaults", "portable"; and of `baseline`, another
    export with its weights, as "baseline"), taking turns; torch.compile's compile s."""
    import torch

    arrays = list(inputs.values())
    tensors = [torch.from_numpy(a) for a in arrays]
    torch._dynamo.reset()
    compiled_model: Any = torch.compile(model, dynamic=False)
    calls = {
        "hloserve": lambda: compiled.execute(batch, arrays, weights),
        "eager": lambda: model(*tensors),
        "compile": lambda: compiled_model(*tensors),
        "ort": lambda: session.run(None, inputs),
    }
    for variant, other in (variants or {}).items():
        if other is not None:
            calls[variant] = lambda other=other: other.execute(batch, arrays, weights)
    if baseline is not None:
        calls["baseline"] = lambda: baseline[0].execute(batch, arrays, baseline[1])
    with torch.no_grad():
        started = time.perf_counter()
        compiled_model(*tensors)
        torch_compile_s = time.perf_counter() - started
        return take_turns(calls, repeats), torch_compile_s


def take_turns(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each of `calls`, called in turn round after round, each turn
    untimed calls for `PRIMING_S` (at least `PRIMING` of them) then a timed one: `WARMUP` untimed
    rounds, then at least `repeats` timed ones, more while hloserve's add up to under `BUDGET_S`."""
    times: dict[str, list[float]] = {runtime: [] for runtime in calls}
    k = 0
    while k < WARMUP + repeats or (k < MAX_ROUNDS and sum(times["hloserve"]) < BUDGET_S):
        for runtime, call in calls.items():
            turn = time.perf_counter()
            primed = 0
            while primed < PRIMING or time.perf_counter() - turn < PRIMING_S:
                call()
                primed += 1
            started = time.perf_counter()
            call()
            if k >= WARMUP:
                times[runtime].append(time.perf_counter() - started)
        k += 1
    return {runtime: _median_ms(t) for runtime, t in times.items()}


def _line(r: Row) -> str:
    times = " ".join(f"{r.ms[k]:>9.2f}" for k in RUNTIMES)
    ratios = " ".join(f"{r.ratios[k]:>6.2f}" for k in RUNTIMES[1:])
    export = f"{r.export_s:>7.1f}" if r.export_s is not None else f"{'-':>7}"
    seconds = f"{export} {r.compile_s:>7.1f} {r.torch_compile_s:>7.1f} {r.onnx_export_s:>6.1f}"
    variants = " ".join(
        f"{ms:>9.2f}" if ms is not None else f"{'-':>9}"
        for ms in (r.defaults_ms, r.portable_ms, r.baseline_ms)
    )
    return f"{r.model:<30} {r.batch:>2} {r.threads:>2} {times} {ratios} {seconds} {variants}"


def table(rows: list[Row]) -> str:
    head = " ".join(f"{k + ' ms':>9}" for k in RUNTIMES)
    ratios = " ".join(f"{'/' + k:>6}" for k in RUNTIMES[1:])
    lines = [
        f"{'model':<30} {'b':>2} {'th':>2} {head} {ratios} {'export':>7} {'compile':>7} "
        f"{'t.comp':>7} {'onnx':>6} {'dflt ms':>9} {'port. ms':>9} {'base ms':>9}"
    ]
    lines += [_line(r) for r in rows]
    for count in sorted({r.threads for r in rows}):
        some = [r for r in rows if r.threads == count]
        for anchor in RUNTIMES[1:]:
            ratios_ = sorted(r.ratios[anchor] for r in some)
            worst = max(some, key=lambda r: r.ratios[anchor])
            lines.append(
                f"{count} thread(s), hloserve / {anchor}: median {statistics.median(ratios_):.2f}x, "
                f"worst {ratios_[-1]:.2f}x ({worst.model} b{worst.batch}), "
                f"above 1.5x: {sum(x > 1.5 for x in ratios_)} of {len(ratios_)}"
            )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


if __name__ == "__main__":  # the child `_measure_in_child` starts
    model_name, count = sys.argv[1], int(sys.argv[2])
    given = [Path(a.split("=", 1)[1]) for a in sys.argv[3:] if a.startswith("--baseline=")]
    found = measure(model_name, count, quick="--quick" in sys.argv[3:], baseline=given[0] if given else None)
    print(json.dumps(found), flush=True)
