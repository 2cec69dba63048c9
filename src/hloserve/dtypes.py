"""Element types: one table joins the manifest token, numpy, KServe wire string and MLIR type.

Every place that converts between these names reads this table, so a dtype is added once.
FP8 has no KServe wire string: it may appear on executable tensors only, never on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import ml_dtypes
import numpy as np

__all__ = ["BYTES", "DTYPES", "DType", "by_mlir", "by_numpy", "by_token", "by_wire"]


@dataclass(frozen=True, slots=True)
class DType:
    """One element type under each of its names."""

    token: str
    """Manifest token (`f32`, `bf16`, `bool`...)."""
    numpy: np.dtype
    """The numpy dtype holding it (ml_dtypes for bf16 and fp8)."""
    wire: str | None
    """KServe V2 datatype string, or None where the protocol has none (fp8)."""
    mlir: str
    """MLIR element type as it appears in `tensor<...x f32>`."""
    contents_field: str | None
    """`InferTensorContents` field that carries it when typed, or None (raw bytes only)."""

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    def __repr__(self) -> str:
        return f"DType({self.token})"


DTYPES: Final[tuple[DType, ...]] = (
    DType("bool", np.dtype(np.bool_), "BOOL", "i1", "bool_contents"),
    DType("u8", np.dtype(np.uint8), "UINT8", "ui8", "uint_contents"),
    DType("u16", np.dtype(np.uint16), "UINT16", "ui16", "uint_contents"),
    DType("u32", np.dtype(np.uint32), "UINT32", "ui32", "uint_contents"),
    DType("u64", np.dtype(np.uint64), "UINT64", "ui64", "uint64_contents"),
    DType("i8", np.dtype(np.int8), "INT8", "i8", "int_contents"),
    DType("i16", np.dtype(np.int16), "INT16", "i16", "int_contents"),
    DType("i32", np.dtype(np.int32), "INT32", "i32", "int_contents"),
    DType("i64", np.dtype(np.int64), "INT64", "i64", "int64_contents"),
    DType("f16", np.dtype(np.float16), "FP16", "f16", None),
    DType("bf16", np.dtype(ml_dtypes.bfloat16), "BF16", "bf16", None),
    DType("f32", np.dtype(np.float32), "FP32", "f32", "fp32_contents"),
    DType("f64", np.dtype(np.float64), "FP64", "f64", "fp64_contents"),
    DType("f8_e5m2", np.dtype(ml_dtypes.float8_e5m2), None, "f8E5M2", None),
    DType("f8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), None, "f8E4M3FN", None),
    DType("bytes", np.dtype(object), "BYTES", "", "bytes_contents"),
)
"""`bytes` (KServe BYTES: strings, each element a Python `bytes`) has no MLIR type: it may
appear on client tensors only, which a model.py turns into numbers and back."""
BYTES: Final = DTYPES[-1]

_BY_TOKEN: Final = {d.token: d for d in DTYPES}
_BY_WIRE: Final = {d.wire: d for d in DTYPES if d.wire is not None}
_BY_MLIR: Final = {d.mlir: d for d in DTYPES if d.mlir}
_BY_NUMPY: Final = {d.numpy: d for d in DTYPES}


def by_token(token: str) -> DType:
    """The dtype for a manifest token; KeyError names the token and the accepted ones."""
    try:
        return _BY_TOKEN[token]
    except KeyError:
        raise KeyError(f"unknown dtype token {token!r}; expected one of {', '.join(_BY_TOKEN)}") from None


def by_wire(wire: str) -> DType:
    """The dtype for a KServe datatype string (`FP32`, `BF16`...)."""
    try:
        return _BY_WIRE[wire]
    except KeyError:
        raise KeyError(f"unknown datatype {wire!r}; expected one of {', '.join(_BY_WIRE)}") from None


def by_mlir(mlir: str) -> DType:
    """The dtype for an MLIR element type (`f32`, `i1`, `ui8`...)."""
    try:
        return _BY_MLIR[mlir]
    except KeyError:
        raise KeyError(f"unsupported MLIR element type {mlir!r}") from None


def by_numpy(dtype: np.dtype) -> DType:
    """The dtype for a numpy dtype."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise KeyError(f"unsupported numpy dtype {np.dtype(dtype)}") from None
