"""A bundle's XLA options, chosen by timing the model's own module with each candidate.

XLA:CPU's defaults do not suit every model. Its YNNPACK convolution fusions barely use a
second core, so on 2 cores ResNet-50 at batch 4 ran in 460 ms with them and 358 ms with the
convolutions left to XLA's own emitter; MobileNetV3 and EfficientNet (depthwise convolutions)
went the other way, 33 → 41 ms and 86 → 90 ms. hloserve's native kernels (`hloserve.kernels`)
split the same way: ConvNeXt's 7x7 depthwise convolutions ran 12% faster in them, MobileNetV2's
3x3 ones 8% slower (the call ends XLA's fusion of each with its bias, activation and padding).
No server-wide default wins both, so the exporter measures: it compiles the largest batch
size's module with each candidate, runs it on the model's weights, and keeps a candidate only
when it beats the defaults by `MIN_GAIN`. The bundle records what it keeps (`xla_options`, per
platform) and the times (`provenance`); the server compiles with the options, keyed into its
program sharing and its executable cache.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from hloserve.models import _xla
from hloserve.models.executable_cache import ExecutableCache

__all__ = [
    "BUSY_SHARE",
    "CANDIDATES",
    "MIN_GAIN",
    "WIDE_VECTORS",
    "Tuning",
    "candidates_with_native_kernels",
    "choose",
    "platform_candidates",
    "tune",
]

log = structlog.get_logger("hloserve.export")

CANDIDATES: Mapping[str, tuple[_xla.XlaOptions, ...]] = {
    "cpu": (
        # Convolutions to XLA's own emitter (Eigen), matmuls still to YNNPACK: XLA's default
        # list minus LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION (XLA_FLAGS' "-individual_convolution").
        {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    ),
}
"""Per platform, the option sets tried against XLA's defaults."""

WIDE_VECTORS: _xla.XlaOptions = {"xla_cpu_prefer_vector_width": 512}
"""XLA:CPU's loops vectorized over AVX-512's whole 512 bits; it prefers 256 by default, as Intel
cores once ran slower clocks on the wider instructions. On the 2-core AMD EPYC (Zen 4)
EfficientNet-B0 ran 17% faster with it at batch 1 and 4 (its SiLU's exponentials), MobileNetV2
and ConvNeXt-T 5% faster, and fifteen other zoo models as fast (all within 2%). Tried, alone and
with each of `CANDIDATES`, on CPUs that have AVX-512 (`platform_candidates`)."""

_CPUINFO = Path("/proc/cpuinfo")

MIN_GAIN = 0.10
"""How much faster (a fraction of the defaults' time) a candidate must run to be kept: more
than the run-to-run spread of a median on a busy 2-core machine, so noise never picks one."""

CLOSE_CALL = 0.05
"""A best candidate whose gain lands within this of `MIN_GAIN` either way is timed again, and
chosen on both measurements' mean: NF-ResNet-26's Eigen convolutions won 13% over 30 rounds,
and 9.8% in the export's 9, which kept the defaults (AMD EPYC, 2 cores)."""

MIN_TUNED_MS = 1.0
"""A module that runs faster than this with the defaults is not tuned: what an option could win
is small beside a request's other costs, and timing noise would pick the winner."""

BUSY_SHARE = 0.25
"""Where other processes (or a VM's neighbours, as steal time) took more than this share of the
machine's CPU time while the candidates were timed, the export warns that its choice may be
wrong: the candidates differ in how they use the cores, so a busy machine ranks them otherwise.
ResNet-18 at batch 4 measured 174.4 ms with the defaults and 173.9 with Eigen convolutions
while another export shared both cores, and 119.0 and 84.2 alone (AMD EPYC, 2 cores)."""

_PROC_STAT = Path("/proc/stat")

_ROUNDS = (3, 9)
"""Timed runs per candidate: at least the first, at most the second."""
_BUDGET_S = 4.0
"""Past this many seconds of timed runs, stop once the minimum is reached."""


@dataclass(frozen=True, slots=True)
class Tuning:
    """What the exporter measured for one module, and what it chose."""

    batch_size: int
    default_ms: float
    """Median execution time with XLA's defaults."""
    measured: tuple[tuple[_xla.XlaOptions, float | str], ...]
    """Each candidate and its median milliseconds, or why it could not run."""
    chosen: _xla.XlaOptions
    """The options kept (empty: the defaults)."""
    skipped: str = ""
    """Why no candidate was timed, where none was."""
    others_cpu_share: float | None = None
    """The share of the machine's CPU time that other processes took while the candidates were
    timed (None where the platform does not say: no `/proc/stat`)."""

    def provenance(self) -> dict[str, Any]:
        """The manifest's record of the measurement (`provenance.xla_tuning`)."""
        return {
            "batch_size": self.batch_size,
            "default_ms": round(self.default_ms, 3),
            "candidates": [{"options": dict(options), **_outcome(ms)} for options, ms in self.measured],
            **({"skipped": self.skipped} if self.skipped else {}),
            **(
                {"others_cpu_share": round(self.others_cpu_share, 3)}
                if self.others_cpu_share is not None
                else {}
            ),
        }


def _outcome(ms: float | str) -> dict[str, float | str]:
    return {"ms": round(ms, 3)} if isinstance(ms, float) else {"error": ms}


def platform_candidates(platform: str) -> tuple[_xla.XlaOptions, ...]:
    """`CANDIDATES` for `platform`, and on a CPU with AVX-512 `WIDE_VECTORS` alone and with each."""
    candidates = tuple(CANDIDATES.get(platform, ()))
    if platform != "cpu" or not _has_avx512():
        return candidates
    return _alone_and_with_each(WIDE_VECTORS, candidates)


def _has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512's foundation (`avx512f` in /proc/cpuinfo's flags)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512f" in line.split() for line in text.splitlines())


def candidates_with_native_kernels(
    source: str | bytes, candidates: Sequence[_xla.XlaOptions]
) -> tuple[_xla.XlaOptions, ...]:
    """`candidates`, and where `source` has composites that this machine's native kernels run
    (`hloserve.kernels`), the kernels alone and with each candidate."""
    if not _xla.native_kernels_apply(source):
        return tuple(candidates)
    return _alone_and_with_each({_xla.NATIVE_KERNELS: True}, candidates)


def _alone_and_with_each(
    added: _xla.XlaOptions, candidates: Sequence[_xla.XlaOptions]
) -> tuple[_xla.XlaOptions, ...]:
    """`candidates`, then `added` alone, then `added` with each of them."""
    return (*candidates, added, *({**options, **added} for options in candidates))


def choose(default_ms: float, measured: Sequence[tuple[_xla.XlaOptions, float | str]]) -> _xla.XlaOptions:
    """The fastest candidate that beats the defaults by `MIN_GAIN`; else none (empty)."""
    timed = [(ms, options) for options, ms in measured if isinstance(ms, float)]
    if not timed:
        return {}
    ms, options = min(timed, key=lambda pair: pair[0])
    return options if ms < default_ms * (1 - MIN_GAIN) else {}


def tune(
    source: str | bytes,
    batch_size: int,
    weights: Sequence[np.ndarray],
    cache: ExecutableCache,
    candidates: Sequence[_xla.XlaOptions] | None = None,
) -> Tuning | None:
    """Time `source` (its inputs zeros, its last arguments `weights`) with XLA's defaults and each
    candidate for this machine's platform, compiled through `cache`; None when the platform has
    no candidates. Blocks for a few compiles and at most about `_BUDGET_S` of runs."""
    if candidates is None:
        candidates = candidates_with_native_kernels(source, platform_candidates(_xla.compile_platform()))
    if not candidates:
        return None
    types = _xla.main_signature(source).inputs
    n_inputs = len(types) - len(weights)
    arguments = [np.zeros(t.shape, t.dtype.numpy) for t in types[:n_inputs]]
    arguments += [np.asarray(w, dtype=t.dtype.numpy) for w, t in zip(weights, types[n_inputs:], strict=True)]
    placed = [_xla.put(np.ascontiguousarray(a)) for a in arguments]
    try:
        executables = [_first_run(cache.compile(source), placed)]
        # a median of three: one run alone may be a descheduled thread's (a 0.04 ms module once
        # measured over 1 ms in a full test run, and was tuned)
        (quick_ms,) = _interleaved_medians(executables, placed, rounds=(3, 3))
        if quick_ms < MIN_TUNED_MS:
            log.info("XLA options not tried", batch_size=batch_size, default_ms=round(quick_ms, 3))
            return Tuning(batch_size, quick_ms, (), {}, f"the defaults run in under {MIN_TUNED_MS:g} ms")
        tried: list[int] = []
        failed: dict[int, str] = {}
        for k, options in enumerate(candidates):
            try:
                executables.append(_first_run(cache.compile(source, options), placed))
            except Exception as e:  # an option this jaxlib does not know, or cannot compile with
                failed[k] = (str(e).strip().splitlines() or [repr(e)])[0][:200]
                log.warning("XLA option set not tried", options=dict(options), error=failed[k])
            else:
                tried.append(k)
        before, started = _cpu_seconds(), time.perf_counter()
        times = _interleaved_medians(executables, placed)
        if _close_call(times):
            again = _interleaved_medians(executables, placed)
            times = [(first + second) / 2 for first, second in zip(times, again, strict=True)]
        others = _others_share(before, _cpu_seconds(), time.perf_counter() - started)
    finally:
        _xla.free(placed)
    outcomes: dict[int, float | str] = {**failed, **dict(zip(tried, times[1:], strict=True))}
    measured = tuple((options, outcomes[k]) for k, options in enumerate(candidates))
    tuning = Tuning(batch_size, times[0], measured, choose(times[0], measured), others_cpu_share=others)
    if others is not None and others > BUSY_SHARE:
        log.warning(
            "XLA options chosen on a busy machine: the choice may be wrong; export again on an idle "
            "machine, or pass --no-tune",
            batch_size=batch_size,
            others_cpu_share=round(others, 2),
        )
    log.info(
        "XLA options measured",
        batch_size=batch_size,
        default_ms=round(tuning.default_ms, 2),
        candidates=[round(ms, 2) if isinstance(ms, float) else ms for _, ms in measured],
        chosen=dict(tuning.chosen) or "defaults",
    )
    return tuning


def _close_call(times: Sequence[float]) -> bool:
    """Whether the fastest of the candidates (`times[1:]`) beats the defaults (`times[0]`) by
    within `CLOSE_CALL` of `MIN_GAIN`."""
    if len(times) < 2:
        return False
    gain = 1 - min(times[1:]) / times[0]
    return abs(gain - MIN_GAIN) <= CLOSE_CALL


def _cpu_seconds() -> tuple[float, float] | None:
    """(the machine's busy CPU seconds, this process's) so far; None without `/proc/stat`."""
    try:
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    ours = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy, ours.user + ours.system


def _others_share(
    before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float
) -> float | None:
    """The share of all the machine's cores that other processes kept busy between two
    `_cpu_seconds` readings `wall_s` apart; None for under half a second, too short beside the
    kernel's 10 ms ticks."""
    if before is None or after is None or wall_s < 0.5:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return min(1.0, max(0.0, others / ((os.cpu_count() or 1) * wall_s)))


def _first_run(executable: Any, arguments: Sequence[_xla.DeviceArray]) -> Any:
    """Run once untimed (first-run costs), so a failure shows here; returns the executable."""
    _xla.to_numpy(_xla.run(executable, arguments))
    return executable


def _interleaved_medians(
    executables: Sequence[Any], arguments: Sequence[_xla.DeviceArray], rounds: tuple[int, int] = _ROUNDS
) -> list[float]:
    """Median milliseconds of each executable over `rounds` (at least, at most) rounds, timed in
    turns so that a change in the machine's load falls on all of them alike."""
    samples: list[list[float]] = [[] for _ in executables]
    started = time.perf_counter()
    least, most = rounds
    for done in range(1, most + 1):
        for executable, times in zip(executables, samples, strict=True):
            begun = time.perf_counter()
            _xla.to_numpy(_xla.run(executable, arguments))
            times.append((time.perf_counter() - begun) * 1e3)
        if done >= least and time.perf_counter() - started > _BUDGET_S:
            break
    return [statistics.median(times) for times in samples]
