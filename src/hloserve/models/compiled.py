"""A bundle compiled for the device: one executable per batch size, and how to run one batch.

Compiling blocks (and releases the GIL), so `compile_bundle` is called from a worker thread.
A worker gets the program of each model from `Programs`, which shares one among byte-identical
modules; `compile_bundle` compiles one of its own (export's verification, tests).
An execution blocks for its whole length (on CPU it runs in the calling thread): the
dispatcher runs a cheap one inline and hands an expensive one to a worker thread.
Weights are passed in, not owned: where they live (host, device, evicted) is the concern of
whoever holds them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from hloserve.errors import ExecutionFailed
from hloserve.models import _xla
from hloserve.models.bundle import Bundle
from hloserve.models.executable_cache import ExecutableCache
from hloserve.models.programs import Program, compile_program

__all__ = ["CompiledModel", "ExecutionResult", "compile_bundle"]


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    outputs: list[np.ndarray]
    input_s: float
    """Seconds spent placing inputs on the device."""
    infer_s: float
    """Seconds from starting the executable until its results were read to the host."""


@dataclass(frozen=True, slots=True)
class CompiledModel:
    """A model ready to run: its bundle (weights, manifest) and its program, which every model
    with byte-identical modules shares (`hloserve.models.programs`)."""

    bundle: Bundle
    program: Program
    batch_sizes: tuple[int, ...] = field(init=False)
    """The compiled sizes, ascending."""
    coalescable: bool = field(init=False)
    """Requests can be joined: every executable input and output has a batch axis."""

    def __post_init__(self) -> None:  # both are read per request
        manifest = self.bundle.manifest
        tensors = (*manifest.executable_inputs, *manifest.executable_outputs)
        executables = self.program.executables
        object.__setattr__(self, "batch_sizes", tuple(sorted(executables)))
        object.__setattr__(
            self, "coalescable", 0 not in executables and all(t.batch_axis is not None for t in tensors)
        )

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def executables(self) -> dict[int, _xla.Executable]:
        """Batch size → executable; key 0 is a bundle's single `model.mlir`."""
        return self.program.executables

    @property
    def compile_s(self) -> float:
        return self.program.compile_s

    @property
    def scratch_bytes(self) -> int:
        """The largest temporary buffer XLA planned for any of the executables."""
        return self.program.scratch_bytes

    def execute(
        self, batch_size: int, inputs: Sequence[np.ndarray], weights: Sequence[_xla.DeviceArray]
    ) -> ExecutionResult:
        """Place the inputs, run the `batch_size` executable and read its outputs to host memory.

        Blocks for the whole execution. PJRT checks only byte sizes, so the inputs are checked
        against the signature here, last, whatever the caller validated before.
        """
        module = self.bundle.module_for(batch_size)
        for i, (array, expected) in enumerate(zip(inputs, module.signature.inputs, strict=False)):
            if array.shape != expected.shape or array.dtype != expected.dtype.numpy:
                raise ExecutionFailed(
                    self.name, f"argument {i} is {array.dtype}{list(array.shape)}, module expects {expected}"
                )
        started = time.perf_counter()
        with _execution_errors(self.name):
            args = [_xla.put(np.ascontiguousarray(a)) for a in inputs]
            placed = time.perf_counter()
            outputs = _xla.to_numpy(_xla.run(self.program.executables[batch_size], [*args, *weights]))
        return ExecutionResult(outputs, placed - started, time.perf_counter() - placed)


@contextlib.contextmanager
def _execution_errors(model: str) -> Iterator[None]:
    """XLA raises its own runtime errors (some only when results are read): report the cause."""
    try:
        yield
    except ExecutionFailed:
        raise
    except Exception as e:
        text = str(e).strip()
        raise ExecutionFailed(model, text.splitlines()[0] if text else repr(e)) from e


def compile_bundle(bundle: Bundle, cache: ExecutableCache | None = None) -> CompiledModel:
    """Compile every module of a bundle, through the executable cache if given, into a program
    of its own (blocking); a worker shares programs through `Programs` instead."""
    return CompiledModel(bundle, compile_program(bundle, cache))
