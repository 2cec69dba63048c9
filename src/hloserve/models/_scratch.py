"""The scratch memory XLA plans for an exported module, and the exporter's refusal of a module
whose scratch dwarfs what it holds anyway (its weights, inputs and outputs).

A lowering that materializes a weight per row or token (a linear layer's weight broadcast for a
batched matmul: 1.39 GB per layer in ViT-B/16 at batch 4) still computes the right numbers, so
only its memory gives it away; on a GPU that scratch is taken from the weight budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloserve.models import _xla
from hloserve.models.executable_cache import ExecutableCache

__all__ = ["DEFAULT_MAX_SCRATCH_RATIO", "ModuleMemory", "ScratchError", "check_scratch", "module_memory"]

DEFAULT_MAX_SCRATCH_RATIO = 16.0
"""The most scratch an exported module may plan, as a multiple of its weights, inputs and
outputs together. A convolutional network at batch 64 plans a few times them; a weight
broadcast per token is tens of times (ViT-B/16 at batch 4 was 48x)."""


class ScratchError(ValueError):
    """A lowered module plans more scratch than `max_scratch_ratio` allows; nothing is written."""


@dataclass(frozen=True, slots=True)
class ModuleMemory:
    """What XLA planned for one compiled module, in bytes."""

    scratch: int
    """Temporary buffers, beside the arguments and results."""
    arguments: int
    """Inputs and weights."""
    outputs: int

    @property
    def ratio(self) -> float:
        """Scratch as a multiple of the arguments and outputs."""
        return self.scratch / max(self.arguments + self.outputs, 1)


def module_memory(source: str | bytes, cache: ExecutableCache | None = None) -> ModuleMemory:
    """Compile `source` for this machine's device (through `cache` if given) and read what XLA
    planned (blocking)."""
    stats = _xla.compiled_memory(cache.compile(source) if cache is not None else _xla.compile_module(source))
    return ModuleMemory(stats["temp_bytes"], stats["argument_bytes"], stats["output_bytes"])


def check_scratch(memory: ModuleMemory, where: str, max_ratio: float | None) -> None:
    """Raise ScratchError when `memory`'s scratch exceeds `max_ratio` times its other bytes."""
    if max_ratio is None or memory.ratio <= max_ratio:
        return
    held = memory.arguments + memory.outputs
    raise ScratchError(
        f"{where}: XLA plans {_size(memory.scratch)} of scratch, {memory.ratio:.1f}x the module's "
        f"weights, inputs and outputs ({_size(held)}); the limit is {max_ratio:g}x. A tensor "
        "materialized per row or token (a weight broadcast for a batched matmul: look for a large "
        "stablehlo.broadcast_in_dim in the module) is the usual cause; change how the model computes "
        "it, or accept it with --max-scratch-ratio N or --allow-large-scratch (max_scratch_ratio=None)"
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
