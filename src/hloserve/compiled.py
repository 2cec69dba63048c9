"""A bundle compiled for the device: one executable per batch size, and how to run one batch.

Compiling blocks (and releases the GIL), so `compile_bundle` is called from a worker thread.
`CompiledModel.execute` also blocks; the dispatcher runs it in a worker thread, one at a time.
Weights are passed in, not owned: where they live (host, device, evicted) is the concern of
whoever holds them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hloserve import _xla
from hloserve.bundle import Bundle
from hloserve.errors import ExecutionFailed

__all__ = ["CompiledModel", "ExecutionResult", "compile_bundle"]


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    outputs: list[np.ndarray]
    input_s: float
    """Seconds spent placing inputs on the device."""
    infer_s: float
    """Seconds from launch until the results were readable on the host."""


@dataclass(frozen=True, slots=True)
class CompiledModel:
    bundle: Bundle
    executables: dict[int, _xla.Executable]
    """Batch size → executable; key 0 is a bundle's single `model.mlir`."""
    compile_s: float
    scratch_bytes: int
    """The largest temporary buffer XLA planned for any of the executables."""

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.executables))

    def batch_size_for(self, rows: int) -> int | None:
        """The smallest compiled size holding `rows`; 0 for a single-module bundle; None if none."""
        if 0 in self.executables:
            return 0
        return next((b for b in self.batch_sizes if b >= rows), None)

    def execute(
        self, batch_size: int, inputs: Sequence[np.ndarray], weights: Sequence[_xla.DeviceArray]
    ) -> ExecutionResult:
        """Run the `batch_size` executable on inputs (exactly its signature) and the weights.

        PJRT checks only byte sizes, so the inputs are checked against the signature here, last,
        whatever the caller validated before.
        """
        module = self.bundle.module_for(batch_size)
        for i, (array, expected) in enumerate(zip(inputs, module.signature.inputs, strict=False)):
            if array.shape != expected.shape or array.dtype != expected.dtype.numpy:
                raise ExecutionFailed(
                    self.name,
                    f"argument {i} is {array.dtype}{list(array.shape)}, module expects {expected}",
                )
        started = time.perf_counter()
        try:
            args = [_xla.put(np.ascontiguousarray(a)) for a in inputs]
            placed = time.perf_counter()
            outputs = _xla.to_numpy(_xla.run(self.executables[batch_size], [*args, *weights]))
        except Exception as e:  # XLA raises its own runtime errors; report the cause
            raise ExecutionFailed(
                self.name, str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            ) from e
        done = time.perf_counter()
        return ExecutionResult(outputs, placed - started, done - placed)


def compile_bundle(bundle: Bundle) -> CompiledModel:
    """Compile every module of a bundle (blocking; run it in a worker thread)."""
    started = time.perf_counter()
    executables = {m.batch_size: _xla.compile_module(m.source) for m in bundle.modules}
    scratch = max((_xla.compiled_memory(e)["temp_bytes"] for e in executables.values()), default=0)
    return CompiledModel(bundle, executables, time.perf_counter() - started, scratch)
