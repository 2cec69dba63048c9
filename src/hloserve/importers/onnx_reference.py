"""An imported bundle compared with ONNX Runtime running the original file.

The bundle runs in a fresh process with the server's own loader (`verify_bundle`, which also
checks dtypes and shapes); ONNX Runtime runs the same seeded inputs at every compiled batch size.
Two different compilers of the same graph agree only within rounding, so each output is compared
as the exporter compares a bundle with its model: with its dtype's tolerance, scaled by the
output's largest magnitude (`hloserve.export.verification.DEFAULT_TOLERANCES`). Integer and boolean
outputs must agree exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hloserve.importers.triton_config import VARIABLE, NotConvertible, TensorPlan

__all__ = ["OutputCheck", "verify_against_onnxruntime"]


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """One output's comparison over every batch size: the largest difference and what was allowed."""

    name: str
    difference: float
    tolerance: float
    """What the output's largest element was allowed: (atol + rtol) x its largest magnitude."""


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
    from hloserve.export.verification import VerificationError, verify_bundle
    from hloserve.models import _xla

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
        differences = verify_bundle(directory, given, expected)
    except VerificationError as e:
        raise NotConvertible(f"differs from ONNX Runtime: {e}") from None
    return tuple(
        OutputCheck(t.name, d.max_abs, d.scale * (d.tolerance.atol + d.tolerance.rtol))
        for t, d in zip(outputs, differences, strict=True)
    )


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
