"""A request's path around the executable: client tensors, model.py hooks, executable tensors.

Without a model.py the client-facing tensors are the executable's and nothing happens here.
With one, `preprocess` turns the client's inputs into the executable's and `postprocess` turns
all of the executable's outputs into the client's; whatever a hook returns is checked against
the manifest (names, dtypes, shapes, variable axes, agreeing batch axes) before it goes on, so a
buggy hook fails its own request with INTERNAL and the hook's words, never the executable or
another request. A `Route` holds both ways for one request; they block (hooks are arbitrary
Python): run them in worker threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hloserve import dtypes
from hloserve.errors import HookFailed
from hloserve.models.manifest import Manifest, TensorSpec
from hloserve.models.model_py import Hook, ModelHooks, NamedTensor

__all__ = ["Route", "arrange", "client_outputs", "named"]


def named(specs: Sequence[TensorSpec], arrays: Sequence[np.ndarray]) -> list[NamedTensor]:
    return [NamedTensor(spec.name, array) for spec, array in zip(specs, arrays, strict=True)]


def arrange(tensors: object, specs: Sequence[TensorSpec]) -> tuple[list[np.ndarray], int | None]:
    """`tensors` (a list of NamedTensor) in the order of `specs`, checked against them, and the
    extent of their shared batch axis (None when none has one); ValueError says what is wrong."""
    if not isinstance(tensors, list | tuple) or not all(isinstance(t, NamedTensor) for t in tensors):
        raise ValueError(f"expected a list of NamedTensor, got {type(tensors).__name__}")
    by_name: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in by_name:
            raise ValueError(f"tensor {tensor.name!r} appears more than once")
        by_name[tensor.name] = np.asarray(tensor.data)
    expected = [spec.name for spec in specs]
    unknown = sorted(set(by_name) - set(expected))
    missing = [name for name in expected if name not in by_name]
    if unknown or missing:
        raise ValueError(f"expected tensors {expected}; missing {missing}, unexpected {unknown}")
    arrays, rows = [], None
    for spec in specs:
        array = by_name[spec.name]
        if spec.dtype is dtypes.BYTES and array.dtype.kind in "OSU":  # strings, however held
            array = array.astype(object)
        if array.dtype != spec.dtype.numpy:
            raise ValueError(
                f"tensor {spec.name!r} is {array.dtype}, expected {spec.dtype.numpy} ({spec.dtype.token})"
            )
        problem = spec.shape_problem(array.shape)
        if problem is not None:
            raise ValueError(f"tensor {spec.name!r}: {problem}")
        if spec.batch_axis is not None:
            extent = array.shape[spec.batch_axis]
            if rows is not None and extent != rows:
                raise ValueError(f"tensor {spec.name!r} has {extent} rows, others have {rows}")
            rows = extent
        arrays.append(array)
    return arrays, rows


def _apply(model: str, stage: str, hook: Hook | None, tensors: list[NamedTensor]) -> object:
    if hook is None:
        return tensors
    try:
        return hook(tensors)
    except Exception as e:
        raise HookFailed(model, stage, f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True, slots=True)
class Route:
    """How one request crosses a model's hooks, the same for a client's request and a meta
    model's call: which executable outputs to ask for, the way in and the way out. Without hooks
    both ways are the identity and only the `selected` outputs are computed."""

    model: str
    manifest: Manifest
    hooks: ModelHooks | None
    selected: Sequence[int]
    """The client outputs asked for, as indices into the manifest's outputs."""

    @property
    def executable_outputs(self) -> list[int]:
        """All of them when a postprocess makes the client's outputs from them, else `selected`."""
        every = range(len(self.manifest.executable_outputs))
        return list(every if self.hooks is not None else self.selected)

    def inward(self, inputs: list[np.ndarray], rows: int) -> tuple[list[np.ndarray], int]:
        """Client inputs (in manifest order) through `preprocess`: the executable's inputs and rows."""
        if self.hooks is None:
            return inputs, rows
        returned = _apply(
            self.model, "preprocess", self.hooks.preprocess, named(self.manifest.inputs, inputs)
        )
        try:
            arrays, extent = arrange(returned, self.manifest.executable_inputs)
        except ValueError as e:
            raise HookFailed(
                self.model, "preprocess", f"returned tensors that do not fit executable_inputs: {e}"
            ) from None
        if extent == 0:
            raise HookFailed(self.model, "preprocess", "returned a batch of 0 rows")
        return [np.ascontiguousarray(a) for a in arrays], 1 if extent is None else extent

    def outward(self, outputs: list[np.ndarray], rows: int) -> list[np.ndarray]:
        """The executable's answer as the client's `selected` outputs: through `postprocess`
        (which gets every executable output), their batch axes holding the client's `rows`."""
        if self.hooks is None:
            return outputs
        returned = _apply(
            self.model,
            "postprocess",
            self.hooks.postprocess,
            named(self.manifest.executable_outputs, outputs),
        )
        client = client_outputs(self.model, "postprocess", self.manifest, returned, rows)
        return [client[i] for i in self.selected]


def client_outputs(
    model: str, stage: str, manifest: Manifest, returned: object, rows: int
) -> list[np.ndarray]:
    """What a hook (or a meta model's `run`) returned, checked against the client-facing outputs
    and the request's `rows`: the arrays in manifest order."""
    where = "client_outputs" if manifest.client_outputs is not None else "executable_outputs"
    try:
        arrays, extent = arrange(returned, manifest.outputs)
    except ValueError as e:
        raise HookFailed(model, stage, f"returned tensors that do not fit {where}: {e}") from None
    if extent is not None and extent != rows:
        raise HookFailed(model, stage, f"returned {extent} rows for a request of {rows}")
    return arrays
