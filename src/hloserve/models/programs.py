"""Loaded programs: one set of executables per set of byte-identical modules, shared by models.

A catalogue of fine-tuned variants is one architecture with many sets of weights: every
variant's bundle holds the same module files. A model is its weights, its manifest and its
settings; what runs it is its *program*, the executables compiled from its modules (one per
batch size), keyed by `Bundle.program_digest`. `Programs` loads a program once (compiled, or
read from the executable cache, then run once per batch size on zeros to take first-run costs
off the first request and seed the scheduler's costs) and hands the same one to every later
bundle with that digest, so a variant costs neither a compile, nor a warm-up execution, nor an
executable's memory. A program lives while a model uses it: the table holds them weakly, so
the last variant unloaded (or reloaded with another module) frees it.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from hloserve.models import _xla
from hloserve.models.bundle import Bundle
from hloserve.models.executable_cache import ExecutableCache

__all__ = ["Program", "Programs", "compile_program"]


@dataclass(eq=False, slots=True, weakref_slot=True)
class Program:
    """The executables of one set of modules, and what their first runs measured."""

    digest: str
    """`Bundle.program_digest` of the bundles it serves."""
    executables: dict[int, _xla.Executable]
    """Batch size → executable; key 0 is a bundle's single `model.mlir`."""
    compile_s: float
    """Seconds compiling (or reading from the executable cache) took."""
    scratch_bytes: int
    """The largest temporary buffer XLA planned for any of the executables."""
    loaded_for: str
    """The model it was first loaded for (later ones share it: the load log's `shared_with`)."""
    costs: dict[int, float] = field(default_factory=dict)
    """Seconds of the warm-up execution of each batch size (empty until `warm_up`)."""
    peak_bytes: int | None = None
    """The device allocator's peak after the warm-up (None where the backend keeps none)."""

    def warm_up(self, bundle: Bundle) -> None:
        """Run every batch size once on zeros, inputs and weights alike (blocking)."""
        for size, executable in sorted(self.executables.items()):
            arguments = [np.zeros(t.shape, t.dtype.numpy) for t in bundle.module_for(size).signature.inputs]
            started = time.perf_counter()
            placed = [_xla.put(a) for a in arguments]
            _xla.to_numpy(_xla.run(executable, placed))
            self.costs[size] = time.perf_counter() - started
            _xla.free(placed)
        stats = _xla.memory_stats()
        self.peak_bytes = None if stats is None else stats.get("peak_bytes_in_use")


def compile_program(bundle: Bundle, cache: ExecutableCache | None) -> Program:
    """Compile every module of a bundle, through the executable cache if given (blocking)."""
    started = time.perf_counter()
    compile_module = cache.compile if cache is not None else _xla.compile_module
    executables = {m.batch_size: compile_module(m.source, bundle.xla_options) for m in bundle.modules}
    scratch = max((_xla.compiled_memory(e)["temp_bytes"] for e in executables.values()), default=0)
    return Program(bundle.program_digest, executables, time.perf_counter() - started, scratch, bundle.name)


class Programs:
    """The programs some model uses, by digest; `load` shares them. Thread-safe: bundles are
    prepared in worker threads, and two loads of one new program compile it once."""

    def __init__(self, cache: ExecutableCache | None) -> None:
        self.cache = cache
        self._loaded: weakref.WeakValueDictionary[str, Program] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        """Per digest while its program is being loaded (others wait for it, then share it)."""

    def __len__(self) -> int:
        """Programs loaded now."""
        return len(self._loaded)

    def load(self, bundle: Bundle) -> tuple[Program, bool]:
        """The program of `bundle`, and whether it was loaded already (shared); else compiled
        and warmed up now (blocking)."""
        digest = bundle.program_digest
        with self._lock:
            program = self._loaded.get(digest)
            if program is not None:
                return program, True
            loading = self._loading.setdefault(digest, threading.Lock())
        with loading:
            with self._lock:
                program = self._loaded.get(digest)
            if program is not None:
                return program, True
            try:
                program = compile_program(bundle, self.cache)
                program.warm_up(bundle)
            except BaseException:
                with self._lock:
                    del self._loading[digest]
                raise
            with self._lock:  # in one step: a later caller finds the program, never a second lock
                self._loaded[digest] = program
                del self._loading[digest]
            return program, False
