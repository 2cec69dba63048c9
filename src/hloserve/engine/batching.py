"""Joining requests into one compiled batch and cutting the results back apart.

Each tensor has its own batch axis (from its manifest letters, in wire order), so joining and
slicing go along that axis, not always axis 0. Tensors without a batch axis are taken from the
first request and returned whole to every request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hloserve.models.manifest import TensorSpec

__all__ = ["assemble", "join_outputs", "slice_rows", "split_outputs"]


def assemble(
    specs: Sequence[TensorSpec], requests: Sequence[Sequence[np.ndarray]], batch_size: int
) -> list[np.ndarray]:
    """The executable inputs for one execution: requests joined, zero-padded up to `batch_size`.

    A lone request that already fills the batch is passed through without a copy.
    """
    joined: list[np.ndarray] = []
    for i, spec in enumerate(specs):
        axis = spec.batch_axis
        parts = [inputs[i] for inputs in requests]
        if axis is None or batch_size == 0:
            joined.append(parts[0])
            continue
        rows = sum(p.shape[axis] for p in parts)
        if len(parts) == 1 and rows == batch_size:
            joined.append(parts[0])
            continue
        shape = list(parts[0].shape)
        shape[axis] = batch_size
        out = np.zeros(shape, dtype=parts[0].dtype)
        index: list[slice] = [slice(None)] * len(shape)
        start = 0
        for part in parts:
            index[axis] = slice(start, start + part.shape[axis])
            out[tuple(index)] = part
            start += part.shape[axis]
        joined.append(out)
    return joined


def split_outputs(
    specs: Sequence[TensorSpec], outputs: Sequence[np.ndarray], rows: Sequence[int]
) -> list[list[np.ndarray]]:
    """Per request, its slice of every output (padding rows dropped); views, not copies."""
    per_request: list[list[np.ndarray]] = [[] for _ in rows]
    for spec, output in zip(specs, outputs, strict=True):
        axis = spec.batch_axis
        start = 0
        for r, count in enumerate(rows):
            if axis is None:
                per_request[r].append(output)
                continue
            index: list[slice] = [slice(None)] * output.ndim
            index[axis] = slice(start, start + count)
            per_request[r].append(output[tuple(index)])
            start += count
    return per_request


def slice_rows(
    specs: Sequence[TensorSpec], arrays: Sequence[np.ndarray], start: int, count: int
) -> list[np.ndarray]:
    """Rows `start:start+count` of each batched tensor (views); unbatched tensors whole."""
    sliced = []
    for spec, array in zip(specs, arrays, strict=True):
        axis = spec.batch_axis
        if axis is None:
            sliced.append(array)
            continue
        index: list[slice] = [slice(None)] * array.ndim
        index[axis] = slice(start, start + count)
        sliced.append(array[tuple(index)])
    return sliced


def join_outputs(specs: Sequence[TensorSpec], parts: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Outputs of consecutive executions of one request, joined along each batch axis."""
    joined = []
    for i, spec in enumerate(specs):
        if spec.batch_axis is None:
            joined.append(parts[0][i])
        else:
            joined.append(np.concatenate([p[i] for p in parts], axis=spec.batch_axis))
    return joined
