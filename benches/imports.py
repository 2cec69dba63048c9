"""Models imported from ONNX beside ONNX Runtime running the original file (issue 35, item 3).

A user migrating with `hloserve import triton|onnx` ran these very `.onnx` files in ONNX Runtime;
what they measure after the move is the imported bundle's execution against that. The models:

- the ONNX zoo (tests/zoo/test_zoo_onnx.py: ResNet-50, ConvNeXt-T, Swin-T, DeiT-Ti as a Triton
  repository with a dynamic batch axis, converted by `hloserve import triton`), sharing its
  cache, made as that test makes it when missing;
- with `--models`, zoo models (tests/zoo) exported to ONNX as `benches anchors` exports them
  (the TorchScript exporter, opset 17, a dynamic batch axis) and converted by
  `hloserve import onnx --batch-sizes 1,4`, cached beside the zoo's exports under a folder
  keyed by the importer's sources.

For each model and for 1 and 2 threads (`--threads N`: N only), one fresh process confined to
that many cores times, at each of the bundle's compiled batch sizes, call by call in turn:
`hloserve`, the bundle's compute per execution (`CompiledModel.execute`, what the server's
`compute_infer` times; compiled without the executable cache, so the compile is a first load's)
and `ort`, ONNX Runtime's CPU provider (`intra_op_num_threads=N`) on the original file, the
same input. Medians after warm-ups (`benches.anchors.take_turns`); the ratio is hloserve's over
ONNX Runtime's (above 1, the import made the model slower). The import's seconds (conversion,
export, verification) and the first-load compile are reported per model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benches import anchors

ROOT = Path(__file__).resolve().parent.parent
THREADS = (1, 2)
RUNTIMES = ("hloserve", "ort")
IMPORT_BATCH_SIZES = "1,4"
"""The compiled sizes `--models` imports with, as `benches anchors` times the exports."""
QUICK_MODELS = ("timm_deit_tiny_patch16_224",)
"""The ONNX zoo's smallest (DeiT-Ti), what `--quick` times at its smallest compiled size."""


@dataclass(frozen=True)
class Row:
    model: str
    via: str
    """`import triton` (the ONNX zoo) or `import onnx` (`--models`)."""
    batch: int
    threads: int
    ms: dict[str, float]
    """Median ms per execution, by runtime (`RUNTIMES`)."""
    ratio: float
    """hloserve's time over ONNX Runtime's."""
    import_s: float
    compile_s: float
    """hloserve's first-load compile of every batch size (no executable cache)."""
    xla_options: dict[str, Any]


@dataclass(frozen=True)
class Imported:
    """One imported model: its bundle, the original `.onnx` and how long the import took."""

    name: str
    via: str
    bundle: Path
    onnx: Path
    import_s: float


def _onnx_zoo() -> Any:
    """tests/zoo/test_zoo_onnx.py as a module (its Triton repository and import, and their cache)."""
    anchors._zoo()  # puts tests/ and tests/zoo/ on the path
    import test_zoo_onnx

    return test_zoo_onnx


def onnx_zoo_models() -> list[Imported]:
    """The ONNX zoo, imported by `hloserve import triton` (made unless cached)."""
    module = _onnx_zoo()
    root, status, report = module.imported_repository()
    if status != 0:
        raise RuntimeError(f"hloserve import triton failed on the ONNX zoo:\n{report[-3000:]}")
    seconds = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S+): version .*\[([\d.]+) s\]$", report, re.M)}
    triton = root / "triton"
    return [
        Imported(name, "import triton", root / "hloserve" / name, triton / name / "1" / "model.onnx", s)
        for name, s in sorted(seconds.items())
    ]


def _importer_digest() -> str:
    digest = hashlib.sha256()
    for package in ("importers", "export"):
        for path in sorted((ROOT / "src" / "hloserve" / package).glob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def zoo_models(names: list[str]) -> list[Imported]:
    """Zoo models exported to ONNX and imported by `hloserve import onnx` (each unless cached)."""
    zoo = anchors._zoo()
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        raise ValueError(f"not zoo models: {unknown}; the zoo: {list(zoo.ZOO)}")
    root = zoo._cache_root()
    found = []
    for name in names:
        onnx = root / "onnx" / f"{name}.onnx"
        if not onnx.exists():
            anchors._onnx_export(zoo, name, onnx)
        folder = root / "imported" / _importer_digest()
        bundle, seconds = folder / name, folder / f"{name}.seconds"
        if not seconds.exists():
            started = time.perf_counter()
            command = [sys.executable, "-m", "hloserve.cli", "import", "onnx", str(onnx)]
            command += ["--out", str(bundle), "--batch-sizes", IMPORT_BATCH_SIZES]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                said = (done.stdout + done.stderr)[-3000:]
                raise RuntimeError(f"hloserve import onnx {onnx} failed:\n{said}")
            seconds.write_text(f"{time.perf_counter() - started:.2f}")
        found.append(Imported(name, "import onnx", bundle, onnx, float(seconds.read_text())))
    return found


def run(
    window_ms: int = 0, quick: bool = False, models: list[str] | None = None, threads: int | None = None
) -> list[Row]:
    del window_ms  # a fixed number of calls, not a window
    counts = (threads,) if threads else THREADS
    cores = sorted(os.sched_getaffinity(0))
    if max(counts) > len(cores):
        raise ValueError(f"{max(counts)} threads asked for, {len(cores)} cores available")
    imported = onnx_zoo_models()
    if quick:
        imported = [m for m in imported if m.name in QUICK_MODELS]
    imported += zoo_models(models or [])
    rows = []
    for model in imported:
        for count in counts:
            for found in _measure_in_child(model, count, set(cores[:count]), quick):
                rows.append(Row(**found, via=model.via, import_s=model.import_s))
                print(f"  {_line(rows[-1])}", flush=True)
    return rows


def _measure_in_child(model: Imported, threads: int, cores: set[int], quick: bool) -> list[dict[str, Any]]:
    """One process confined to `cores` measures `model` at every compiled batch size: its rows."""
    arguments = ["benches.imports", str(model.bundle), str(model.onnx), str(threads)]
    what = f"{model.name} at {threads} threads"
    return anchors.measure_confined([*arguments, *(["--quick"] if quick else [])], cores, what)


def measure(bundle_dir: Path, onnx: Path, threads: int, quick: bool = False) -> list[dict[str, Any]]:
    """In this process (already confined to `threads` cores): the bundle and ONNX Runtime on the
    original file at each compiled batch size, in turn. Returns `Row` fields but `via` and the
    import seconds."""
    import numpy as np
    import onnxruntime

    from hloserve.models import _xla
    from hloserve.models.bundle import load_bundle, read_weights
    from hloserve.models.compiled import compile_bundle

    bundle = load_bundle(bundle_dir)
    compiled = compile_bundle(bundle)  # no executable cache: a first load's compile
    weights = _xla.put_all(read_weights(bundle))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])
    specs = bundle.manifest.executable_inputs
    takes, expected = [i.name for i in session.get_inputs()], [s.name for s in specs]
    if takes != expected:
        raise ValueError(f"{onnx} takes inputs {takes}, the bundle {expected}")
    sizes, repeats = (compiled.batch_sizes[:1], 2) if quick else (compiled.batch_sizes, anchors.REPEATS)
    rng = np.random.default_rng(1)
    rows = []
    for batch in sizes:
        arrays = [rng.standard_normal(s.wire_shape(batch)).astype(s.dtype.numpy) for s in specs]
        feed = {s.name: a for s, a in zip(specs, arrays, strict=True)}
        ms = anchors.take_turns(
            {
                "hloserve": lambda: compiled.execute(batch, arrays, weights),  # noqa: B023  # called in this iteration
                "ort": lambda: session.run(None, feed),  # noqa: B023
            },
            repeats,
        )
        rows.append(
            {
                "model": bundle.name,
                "batch": batch,
                "threads": threads,
                "ms": ms,
                "ratio": round(ms["hloserve"] / ms["ort"], 3),
                "compile_s": round(compiled.compile_s, 2),
                "xla_options": dict(bundle.xla_options),
            }
        )
    return rows


def _line(r: Row) -> str:
    times = " ".join(f"{r.ms[k]:>9.2f}" for k in RUNTIMES)
    seconds = f"{r.import_s:>7.1f} {r.compile_s:>7.1f}"
    return f"{r.model:<28} {r.via:<13} {r.batch:>2} {r.threads:>2} {times} {r.ratio:>6.2f} {seconds}"


def table(rows: list[Row]) -> str:
    head = " ".join(f"{k + ' ms':>9}" for k in RUNTIMES)
    lines = [f"{'model':<28} {'via':<13} {'b':>2} {'th':>2} {head} {'/ort':>6} {'import':>7} {'compile':>7}"]
    lines += [_line(r) for r in rows]
    for count in sorted({r.threads for r in rows}):
        some = [r for r in rows if r.threads == count]
        ratios = sorted(r.ratio for r in some)
        worst = max(some, key=lambda r: r.ratio)
        lines.append(
            f"{count} thread(s), imported hloserve / ONNX Runtime on the original: median "
            f"{statistics.median(ratios):.2f}x, worst {ratios[-1]:.2f}x ({worst.model} b{worst.batch}), "
            f"at or under 1.0x: {sum(x <= 1.0 for x in ratios)} of {len(ratios)}"
        )
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


if __name__ == "__main__":  # the child `_measure_in_child` starts
    bundle_path, onnx_path, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(measure(bundle_path, onnx_path, count, quick="--quick" in sys.argv[4:])), flush=True)
