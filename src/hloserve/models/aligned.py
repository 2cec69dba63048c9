"""Host memory that XLA:CPU aliases instead of copying: arrays 64-byte aligned. Apart from
`_xla` so that a process that fills such buffers and never runs a model (a frontend) does not
import JAX."""

from __future__ import annotations

import numpy as np

__all__ = ["ALIGNMENT", "host_buffer"]

ALIGNMENT = 64
"""XLA:CPU's alignment for a host buffer it takes without a copy."""


def host_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised, 64-byte aligned uint8 array: on CPU, `put` aliases it instead of copying."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes]
