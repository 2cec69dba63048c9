"""A written bundle checked as the server will run it: loaded in a fresh process by the server's
own loader, run at each batch size, and compared with the model it came from.

A fresh process sees only the files, so nothing of the exporting process (a traced function, an
executable in its memory) can hide a fault in them; it may load executables from an executable
cache, as the server does, which keys them by the module file's bytes. Arrays cross to it in an
.npz, with dtype tokens (npz reads bf16 and fp8 back as void).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hloserve import _version, dtypes
from hloserve.models import _xla
from hloserve.models.bundle import load_bundle, read_weights
from hloserve.models.compiled import compile_bundle
from hloserve.models.executable_cache import ExecutableCache

__all__ = [
    "DEFAULT_TOLERANCES",
    "Difference",
    "Tolerance",
    "VerificationError",
    "compare",
    "default_tolerance",
    "precision_tolerance",
    "verify_bundle",
]


class VerificationError(Exception):
    """A written bundle, run by the server's loader in a fresh process, does not reproduce its model.

    Raised after the files are written (they stay, for inspection); a model that cannot be
    exported at all raises ValueError before anything is written.
    """


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How close a bundle's output must be to its model's: element by element,
    `|bundle - model| <= atol * scale + rtol * |model|`, where `scale` is the output's largest
    magnitude (the model's, at that batch size; 1 if it is all zeros).

    `atol` is thus relative to the output as a whole, not absolute: logits as large as 100 allow
    100 times the difference that probabilities in [0, 1] do, as their float rounding does.
    """

    rtol: float
    """Allowed difference as a fraction of the element's own magnitude."""
    atol: float
    """Allowed difference as a fraction of the output's largest magnitude."""


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "f64": Tolerance(rtol=1e-7, atol=1e-9),
    "f32": Tolerance(rtol=1e-4, atol=1e-5),
    "f16": Tolerance(rtol=1e-2, atol=1e-3),
    "bf16": Tolerance(rtol=4e-2, atol=8e-3),
    "f8_e4m3": Tolerance(rtol=0.25, atol=0.0625),
    "f8_e5m2": Tolerance(rtol=0.5, atol=0.125),
}
"""Per dtype token. The float ones allow some multiple of the type's epsilon for a deep
model's reordered sums (XLA fuses and reassociates where the framework did not); any other
dtype (integers, bool) must match exactly."""
_EXACT = Tolerance(rtol=0.0, atol=0.0)


def default_tolerance(dtype: np.dtype) -> Tolerance:
    """The tolerance an output of `dtype` is checked with when the caller gives none."""
    return DEFAULT_TOLERANCES.get(dtypes.by_numpy(dtype).token, _EXACT)


def precision_tolerance(computed_in: np.dtype) -> Tolerance:
    """The tolerance for float outputs computed in `computed_in` (bf16 or fp16) and cast back up
    (an export with `precision=`): that type's, as its rounding is what the outputs carry, though
    their dtype is f32. Outputs of a type as narrow or narrower keep their own."""
    return default_tolerance(computed_in)


def _tolerance(
    dtype: np.dtype, rtol: float | None, atol: float | None, computed_in: np.dtype | None = None
) -> Tolerance:
    default = default_tolerance(dtype)
    if computed_in is not None and dtype.itemsize > computed_in.itemsize and default != _EXACT:
        default = precision_tolerance(computed_in)  # a float output wider than what computed it
    return Tolerance(
        default.rtol if rtol is None else rtol,
        default.atol if atol is None else atol,
    )


@dataclass(frozen=True, slots=True)
class Difference:
    """How far a bundle's output is from its model's, and what tolerance would accept it."""

    max_abs: float
    """The largest absolute difference (0 where both are NaN)."""
    scale: float
    """The output's largest finite magnitude (the model's): what `atol` is a fraction of."""
    index: tuple[int, ...]
    """Where the difference is furthest outside the tolerance (else where it is largest)."""
    got: float
    want: float
    tolerance: Tolerance
    passing_atol: float
    """The least `atol` that accepts the output with this `rtol` (inf: none, a NaN differs)."""
    passing_rtol: float
    """The least `rtol` that accepts the output with this `atol` (inf: none does)."""
    top1_agreement: float | None = None
    """For an output that looks like logits (2-D, last axis > 1): the fraction of rows, over
    every batch size, whose largest entry is at the same index in the bundle as in the model."""

    @property
    def ok(self) -> bool:
        return self.passing_atol <= self.tolerance.atol

    @property
    def relative(self) -> float:
        """The largest absolute difference as a fraction of the output's largest magnitude."""
        return self.max_abs / self.scale

    def describe(self) -> str:
        """One sentence: how far off, where, and what tolerance would pass."""
        where = ", ".join(map(str, self.index))
        text = (
            f"differs from the model by up to {self.max_abs:.3g} ({self.relative:.3g} of its largest "
            f"magnitude {self.scale:.3g}); at index [{where}] the bundle gives {self.got:.7g}, the model "
            f"{self.want:.7g}; the tolerance is rtol={self.tolerance.rtol:g} (of each element) plus "
            f"atol={self.tolerance.atol:g} (of {self.scale:.3g})"
        )
        if not math.isfinite(self.passing_atol):
            return f"{text}; NaN or infinity where the model has another value, which no tolerance passes"
        options = [f"atol={_round_up(self.passing_atol):g}"]
        if math.isfinite(self.passing_rtol):
            options.append(f"rtol={_round_up(self.passing_rtol):g}")
        return f"{text}; it would pass with {' or '.join(options)}"


def _round_up(value: float) -> float:
    """`value` rounded up to two significant digits, so that it passes when given back."""
    if value <= 0:
        return 0.0
    exponent = math.floor(math.log10(value)) - 1
    return math.ceil(value / 10.0**exponent * (1 - 1e-12)) * 10.0**exponent


def compare(got: np.ndarray, want: np.ndarray, tolerance: Tolerance) -> Difference:
    """Compare an output with the model's under `tolerance` (arrays of the same shape).

    Two NaNs are equal, as are two infinities of the same sign; a NaN or infinity against
    anything else fails whatever the tolerance.
    """
    g64, w64 = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    same = (np.isnan(g64) & np.isnan(w64)) | (np.isinf(w64) & (g64 == w64))
    finite = np.isfinite(g64) & np.isfinite(w64)
    magnitude = np.abs(np.where(np.isfinite(w64), w64, 0.0))
    scale = float(np.max(magnitude, initial=0.0)) or 1.0
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN - NaN, inf - inf, x / 0: masked
        abs_diff = np.where(same, 0.0, np.where(finite, np.abs(g64 - w64), np.inf))
        # per element: the atol it needs with this rtol, and the rtol it needs with this atol
        needs_atol = np.maximum(abs_diff - tolerance.rtol * magnitude, 0.0) / scale
        over = np.maximum(abs_diff - tolerance.atol * scale, 0.0)
        needs_rtol = np.where(over > 0, over / magnitude, 0.0)
    passing_atol = float(np.max(needs_atol, initial=0.0))
    passing_rtol = float(np.max(needs_rtol, initial=0.0))
    flat = int(np.argmax(needs_atol)) if passing_atol > tolerance.atol else int(np.argmax(abs_diff))
    index = tuple(int(i) for i in np.unravel_index(flat, g64.shape)) if g64.size else ()
    return Difference(
        max_abs=float(np.max(np.where(np.isnan(abs_diff), 0.0, abs_diff), initial=0.0)),
        scale=scale,
        index=index,
        got=float(g64.reshape(-1)[flat]) if g64.size else 0.0,
        want=float(w64.reshape(-1)[flat]) if g64.size else 0.0,
        tolerance=tolerance,
        passing_atol=passing_atol,
        passing_rtol=passing_rtol,
    )


def verify_bundle(
    directory: Path,
    inputs: Mapping[int, Sequence[np.ndarray]],
    expected: Mapping[int, Sequence[np.ndarray]],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    computed_in: np.dtype | None = None,
    executables: Path | None = None,
) -> list[Difference]:
    """Run a bundle as the server would, in a fresh process, and compare it with `expected`.

    `inputs` and `expected` map a batch size to its input and output arrays. A fresh process
    sees only the files, so nothing of the exporting process (a traced function) can hide a
    fault in them; `executables`, an executable cache directory, spares it compiling a module
    whose bytes the exporter already compiled there. Each output is compared by `compare` with the
    tolerance of its dtype (`DEFAULT_TOLERANCES`), or with `rtol` / `atol` where given (they
    then apply to every output). `computed_in` (bf16, fp16: a bundle exported with
    `precision=`) gives float outputs of a wider type `precision_tolerance(computed_in)` instead;
    integer and bool outputs stay exact. Each Difference of a logits-like output (2-D, last axis
    > 1) carries its top-1 agreement. Returns, per output, its largest difference over the batch
    sizes.

    Raises:
        VerificationError: naming the output, the batch size, how far off it is, where, and
            what tolerance would pass; or saying why the bundle does not load and run.
    """
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="hloserve-verify-") as scratch:
        sent, received = Path(scratch) / "inputs.npz", Path(scratch) / "outputs.npz"
        _save_arrays(sent, inputs)
        env = dict(os.environ)
        source = str(Path(_version.__file__).resolve().parents[1])  # importable whatever the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(directory), str(sent), str(received), str(executables or "")],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if child.returncode != 0:
            lines = child.stderr.strip().splitlines()
            raise VerificationError(
                f"bundle {directory.name!r} does not run with the server's loader: "
                f"{lines[-1] if lines else f'exit status {child.returncode}'}"
            )
        got = _load_arrays(received)
    names = [t.name for t in load_bundle(directory).manifest.executable_outputs]
    worst: list[Difference | None] = [None] * len(names)
    agree, rows = [0] * len(names), [0] * len(names)
    for size, want in expected.items():
        for k, (name, w, g) in enumerate(zip(names, want, got[size], strict=True)):
            where = f"bundle {directory.name!r}, output {name!r}, batch size {size}"
            if g.dtype != w.dtype or g.shape != w.shape:
                raise VerificationError(
                    f"{where}: the bundle gives {g.dtype}{list(g.shape)}, the model {w.dtype}{list(w.shape)}"
                )
            difference = compare(g, w, _tolerance(w.dtype, rtol, atol, computed_in))
            if not difference.ok:
                token = dtypes.by_numpy(w.dtype).token
                raise VerificationError(f"{where} ({token}): {difference.describe()}")
            if g.ndim == 2 and g.shape[1] > 1 and g.dtype.kind not in "biu":
                agree[k] += int(np.sum(np.argmax(g, axis=1) == np.argmax(w, axis=1)))
                rows[k] += g.shape[0]
            previous = worst[k]
            if previous is None or difference.relative > previous.relative:
                worst[k] = difference
    return [
        dataclasses.replace(d, top1_agreement=agree[k] / rows[k] if rows[k] else None)
        for k, d in enumerate(worst)
        if d is not None
    ]


_CHILD = "import sys; from hloserve.export.verification import _run_bundle; _run_bundle(*sys.argv[1:])"


def _run_bundle(directory: str, inputs_path: str, outputs_path: str, executables: str) -> None:
    """The fresh process's half of `verify_bundle`: load, compile (or load what the exporter
    compiled, from the cache `executables`) and run as the server does."""
    _xla.warm_up()
    bundle = load_bundle(Path(directory))
    compiled = compile_bundle(bundle, ExecutableCache(Path(executables)) if executables else None)
    weights = [_xla.put(w) for w in read_weights(bundle)]
    outputs = {
        size: compiled.execute(size, arrays, weights).outputs
        for size, arrays in _load_arrays(Path(inputs_path)).items()
    }
    _save_arrays(Path(outputs_path), outputs)


def _save_arrays(path: Path, arrays: Mapping[int, Sequence[np.ndarray]]) -> None:
    """Arrays per batch size as an .npz, with dtype tokens: npz reads bf16 and fp8 back as void."""
    entries: dict[str, np.ndarray] = {}
    for size, batch in arrays.items():
        entries[f"b{size}_dtypes"] = np.array([dtypes.by_numpy(a.dtype).token for a in batch])
        entries.update({f"b{size}_{k}": np.asarray(a) for k, a in enumerate(batch)})
    np.savez(path, **entries)  # type: ignore[arg-type]  # numpy's stub types **kwds as one array-like


def _load_arrays(path: Path) -> dict[int, list[np.ndarray]]:
    with np.load(path) as saved:
        sizes = sorted(int(key[1:].split("_")[0]) for key in saved.files if key.endswith("_dtypes"))
        return {
            size: [
                saved[f"b{size}_{k}"].view(dtypes.by_token(str(token)).numpy)
                for k, token in enumerate(saved[f"b{size}_dtypes"])
            ]
            for size in sizes
        }
