"""An imported bundle compared with ONNX Runtime running the original file.

The bundle runs in a fresh process with the server's own loader (`verify_bundle`, which also
checks dtypes and shapes); ONNX Runtime runs the same seeded inputs at every compiled batch size.
Two different compilers of the same graph agree only within rounding, so each output is allowed
a difference from its dtype, scaled by its largest magnitude: `rtol * max|reference| + atol`
(`TOLERANCES`). Integer and boolean outputs must agree exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from hloserve.importers.triton_config import VARIABLE, NotConvertible, TensorPlan

__all__ = ["TOLERANCES", "OutputCheck", "verify_against_onnxruntime"]

TOLERANCES: dict[np.dtype, tuple[float, float]] = {
    np.dtype(np.float16): (1e-2, 1e-3),
    np.dtype(ml_dtypes.bfloat16): (4e-2, 1e-2),
    np.dtype(np.float32): (1e-4, 1e-6),
    np.dtype(np.float64): (1e-9, 1e-12),
}
"""(rtol, atol) per float dtype: an output may differ from ONNX Runtime's by rtol times its
largest magnitude plus atol. Other dtypes must be equal."""


_ANY = 1e300
"""verify_bundle's atol here: it accepts any finite difference (numpy refuses an infinite atol),
and the scaled comparison is ours."""


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """One output's comparison over every batch size: the largest difference and what was allowed."""

    name: str
    difference: float
    tolerance: float


def tolerance(reference: Sequence[np.ndarray], dtype: np.dtype) -> float:
    """The difference allowed for an output whose ONNX Runtime values are `reference`."""
    rtol, atol = TOLERANCES.get(np.dtype(dtype), (0.0, 0.0))
    finite = [np.abs(r[np.isfinite(r)].astype(np.float64)) for r in reference]
    scale = max((float(np.max(f)) for f in finite if f.size), default=0.0)
    return rtol * scale + atol


def verify_against_onnxruntime(
    onnx_file: Path,
    directory: Path,
    inputs: Sequence[TensorPlan],
    outputs: Sequence[TensorPlan],
    samples: Sequence[np.ndarray],
    batch_sizes: Sequence[int] | None,
    platform: str,
) -> tuple[OutputCheck, ...]:
    """Run the bundle and ONNX Runtime on `samples` (the first rows at each batch size; whole
    inputs without a batch axis) and compare every output.

    Raises:
        NotConvertible: the bundle does not load or run, or an output differs from ONNX Runtime by
            more than its tolerance (naming it, the difference and the tolerance), or has other
            dims than the config gives.
    """
    from hloserve import _xla
    from hloserve.verification import VerificationError, verify_bundle

    local = "cpu" if _xla.device().platform == "cpu" else "cuda"
    if platform != local:
        return ()  # lowered for another platform: it cannot run here
    session = _session(onnx_file)
    sizes = list(batch_sizes) if batch_sizes is not None else [0]
    given = {size: [s[:size] if size else s for s in samples] for size in sizes}
    expected: dict[int, list[np.ndarray]] = {}
    for size, arrays in given.items():
        feed = {t.name: a for t, a in zip(inputs, arrays, strict=True)}
        results = session.run([t.name for t in outputs], feed)
        expected[size] = [np.asarray(r) for r in results]
        for t, r in zip(outputs, expected[size], strict=True):
            shape = r.shape[1:] if size else r.shape
            if t.dims is not None and (
                len(t.dims) != len(shape)
                or any(d not in (VARIABLE, s) for d, s in zip(t.dims, shape, strict=False))
            ):
                after = " after the batch axis" if size else ""
                raise NotConvertible(
                    f"output {t.name!r} is {list(shape)}{after} in ONNX Runtime, "
                    f"the config gives dims {list(t.dims)}"
                )
    try:
        # The comparison is ours (scaled per output below); verify_bundle loads, runs and checks
        # dtypes and shapes, and reports the largest difference of each output.
        differences = verify_bundle(directory, given, expected, rtol=0.0, atol=_ANY)
    except VerificationError as e:
        raise NotConvertible(f"verification against ONNX Runtime failed: {e}") from None
    checks = []
    for k, (t, difference) in enumerate(zip(outputs, differences, strict=True)):
        allowed = tolerance([expected[size][k] for size in sizes], expected[sizes[0]][k].dtype)
        checks.append(OutputCheck(t.name, difference, allowed))
        if not difference <= allowed:
            raise NotConvertible(
                f"output {t.name!r} differs from ONNX Runtime by up to {difference:.3g} at batch sizes "
                f"{sizes if batch_sizes is not None else '(none)'}; allowed {allowed:.3g} "
                f"({expected[sizes[0]][k].dtype}: rtol x max|value| + atol)"
            )
    return tuple(checks)


def _session(onnx_file: Path) -> Any:
    try:
        import onnxruntime
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{e}: verifying imported models needs the `onnx` extra (pip install 'hloserve[onnx]')",
            name=e.name,
        ) from None
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    options.log_severity_level = 3  # errors only: its warnings are about the graph, not the import
    try:
        return onnxruntime.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise NotConvertible(f"ONNX Runtime cannot load {onnx_file}: {e}") from None
