"""A module's entry function as hloserve reads it: its argument and result types. Apart from
`_xla`, which parses it, so that a process that is sent bundles and never compiles one (a
frontend) does not import JAX."""

from __future__ import annotations

from dataclasses import dataclass

from hloserve.dtypes import DType

__all__ = ["Signature", "TensorType"]


@dataclass(frozen=True, slots=True)
class TensorType:
    """One argument or result of a module's `main`, in row-major (XLA) order."""

    shape: tuple[int, ...]
    dtype: DType

    def __str__(self) -> str:
        return f"{self.dtype.token}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class Signature:
    """The entry function of a module: argument and result types, and donated arguments."""

    inputs: tuple[TensorType, ...]
    outputs: tuple[TensorType, ...]
    donated: tuple[int, ...]
    """Indices of arguments carrying a donation attribute (hloserve rejects these)."""
