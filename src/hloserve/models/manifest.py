"""The bundle manifest (`manifest.yaml`): tensors, letter shapes, compiled batch sizes.

Shapes are written ReactantServer.jl's way: one ASCII letter per axis in column-major order with the
batch axis last (`"fn"` with `dims: {f: 16}` is a wire tensor of shape `[batch, 16]`). `n` or
`b` marks the batch axis; every other letter needs a size in `dims`; `-1` marks a variable axis,
allowed only on client-facing tensors (a `model.py` consumes or produces them). A bundle of
`kind: meta` has no executable: its `model.py` answers with calls to the models listed in
`meta.calls`. `xla_options` names, per platform, the XLA options the modules are compiled with
(the exporter keeps those it measured to win). Every rule raises a `BundleError` that names the
bundle, the file and the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hloserve import dtypes, kernels
from hloserve.dtypes import DType
from hloserve.errors import BundleError

__all__ = ["Axis", "Manifest", "TensorSpec", "load_manifest", "parse_manifest"]

FILE = "manifest.yaml"
BATCH_LETTERS = frozenset("nb")
VARIABLE = -1
_KEYS = frozenset(
    {
        "format_version",
        "name",
        "description",
        "kind",
        "executable_inputs",
        "executable_outputs",
        "client_inputs",
        "client_outputs",
        "batching",
        "provenance",
        "input_shapes",
        "meta",
        "xla_options",
    }
)
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "dims", "description", "labels", "format"})
PLATFORMS = ("cpu", "cuda")
"""The platforms `xla_options` may name (a bundle's modules are lowered for one of them)."""
_XLA_OPTION = re.compile(r"^xla_[a-z0-9_]{1,120}$")
FORMATS = ("NHWC", "NCHW")
"""Image layouts an input may declare (`format`), which ModelConfig reports as Triton does."""


@dataclass(frozen=True, slots=True)
class Axis:
    """One axis of a tensor: its letter and size (None for the batch axis, -1 when variable)."""

    letter: str
    size: int | None

    @property
    def is_batch(self) -> bool:
        return self.size is None

    @property
    def is_variable(self) -> bool:
        return self.size == VARIABLE


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A named tensor of the manifest, its axes in manifest (column-major) order."""

    name: str
    dtype: DType
    axes: tuple[Axis, ...]
    labels: str | None = None
    """An output's labels file in the bundle (one label per line, class index = line number),
    which Triton's classification (`class_count`) appends to each "score:index"."""
    format: str | None = None
    """An image input's layout (`NHWC` or `NCHW`), for clients that read it from ModelConfig
    (Triton's image client does); None: not an image."""
    batch_axis: int | None = field(init=False, compare=False, repr=False)
    """Index of the batch axis in wire order, or None for an unbatched tensor (read per
    request, so found once)."""

    def __post_init__(self) -> None:
        batch_axis = next((i for i, a in enumerate(self.wire_axes) if a.is_batch), None)
        object.__setattr__(self, "batch_axis", batch_axis)

    @property
    def wire_axes(self) -> tuple[Axis, ...]:
        """Axes in wire (row-major, numpy, XLA) order: the manifest's reversed."""
        return self.axes[::-1]

    @property
    def metadata_shape(self) -> list[int]:
        """The shape KServe ModelMetadata reports: wire order, -1 for batch and variable axes."""
        return [VARIABLE if a.size is None else a.size for a in self.wire_axes]

    def wire_shape(self, batch: int) -> tuple[int, ...]:
        """The wire shape with the batch axis set to `batch`; ValueError on a variable axis."""
        if any(a.is_variable for a in self.axes):
            raise ValueError(f"tensor {self.name!r} has a variable axis; its shape depends on the data")
        return tuple(batch if a.size is None else a.size for a in self.wire_axes)

    def shape_problem(self, shape: Sequence[int]) -> str | None:
        """None when a wire shape fits this tensor, else a sentence saying what was expected."""
        expected = self.metadata_shape
        if len(shape) != len(expected):
            return f"shape {list(shape)} has rank {len(shape)}, expected {expected} (rank {len(expected)})"
        for i, (got, axis) in enumerate(zip(shape, self.wire_axes, strict=True)):
            if axis.size is not None and axis.size != VARIABLE and got != axis.size:
                return f"shape {list(shape)} does not match {expected}: axis {i} must be {axis.size}"
        return None


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    format_version: str
    executable_inputs: tuple[TensorSpec, ...]
    executable_outputs: tuple[TensorSpec, ...]
    client_inputs: tuple[TensorSpec, ...] | None = None
    client_outputs: tuple[TensorSpec, ...] | None = None
    compiled_batch_sizes: tuple[int, ...] = ()
    """Ascending and unique; empty when the manifest names none (the module files decide)."""
    description: str = ""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "model"
    """`model` (an executable) or `meta` (a model.py calling other models)."""
    calls: tuple[str, ...] = ()
    """The models a meta model may call (`meta.calls`)."""
    xla_options: Mapping[str, Mapping[str, str | bool | int | float]] = field(default_factory=dict)
    """Platform (`cpu`, `cuda`) → XLA debug options its executables are compiled with, over
    XLA's defaults: what the exporter measured to run this model faster on that platform."""

    @property
    def is_meta(self) -> bool:
        return self.kind == "meta"

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The inputs clients send (client_inputs when a model.py transforms them)."""
        return self.client_inputs if self.client_inputs is not None else self.executable_inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """The outputs clients receive."""
        return self.client_outputs if self.client_outputs is not None else self.executable_outputs

    @property
    def batched(self) -> bool:
        """True when every executable input has a batch axis (the rule is all or none)."""
        return all(s.batch_axis is not None for s in self.executable_inputs)


class _Reader:
    """Raises BundleErrors located in this bundle's manifest."""

    def __init__(self, bundle: str) -> None:
        self.bundle = bundle

    def fail(self, where: str | None, problem: str) -> BundleError:
        return BundleError(self.bundle, FILE, where, problem)

    def tensor(self, data: Any, where: str, *, client: bool, allow_variable: bool) -> TensorSpec:
        if not isinstance(data, Mapping):
            raise self.fail(where, f"expected a mapping with name, dtype, shape and dims, got {data!r}")
        unknown = set(data) - _TENSOR_KEYS
        if unknown:
            raise self.fail(f"{where}.{_first(unknown)}", f"unknown key; expected {sorted(_TENSOR_KEYS)}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise self.fail(f"{where}.name", f"expected a non-empty string, got {name!r}")
        token = data.get("dtype")
        try:
            dtype = dtypes.by_token(str(token))
        except KeyError as e:
            raise self.fail(f"{where}.dtype", str(e.args[0])) from None
        if not client and dtype is dtypes.BYTES:
            raise self.fail(
                f"{where}.dtype",
                "bytes (BYTES) may appear only in client_inputs and client_outputs, "
                "which a model.py turns into numbers and back",
            )
        if client and dtype.wire is None:
            raise self.fail(
                f"{where}.dtype", f"{token} has no KServe datatype; it may appear only on executable tensors"
            )
        shape = data.get("shape", "")
        if not isinstance(shape, str) or not all(c.isascii() and c.isalpha() for c in shape):
            raise self.fail(
                f"{where}.shape", f"expected a string of ASCII letters, one per axis, got {shape!r}"
            )
        repeated = sorted({c for c in shape if shape.count(c) > 1})
        if repeated:
            raise self.fail(f"{where}.shape", f"letter(s) {repeated} appear more than once in {shape!r}")
        if len(BATCH_LETTERS & set(shape)) > 1:
            raise self.fail(
                f"{where}.shape", f"{shape!r} has both batch letters n and b; at most one batch axis"
            )
        dims = data.get("dims") or {}
        if not isinstance(dims, Mapping):
            raise self.fail(f"{where}.dims", f"expected a mapping of letter to size, got {dims!r}")
        axes = []
        for letter in shape:
            if letter in BATCH_LETTERS:
                if letter in dims:
                    raise self.fail(
                        f"{where}.dims.{letter}", f"{letter!r} is the batch axis and takes no size"
                    )
                axes.append(Axis(letter, None))
                continue
            if letter not in dims:
                raise self.fail(f"{where}.dims", f"no size for letter {letter!r} of shape {shape!r}")
            size = dims[letter]
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != VARIABLE):
                raise self.fail(f"{where}.dims.{letter}", f"expected a positive integer or -1, got {size!r}")
            if size == VARIABLE and not allow_variable:
                raise self.fail(
                    f"{where}.dims.{letter}",
                    "-1 (variable axis) is allowed only in client_inputs and client_outputs, "
                    "which a model.py consumes and produces",
                )
            axes.append(Axis(letter, size))
        extra = sorted(set(map(str, dims)) - set(shape))
        if extra:
            raise self.fail(f"{where}.dims.{extra[0]}", f"letter not in shape {shape!r}")
        labels = data.get("labels")
        if labels is not None and (
            not isinstance(labels, str) or not labels or "/" in labels or labels.startswith(".")
        ):
            raise self.fail(f"{where}.labels", f"expected the name of a file in the bundle, got {labels!r}")
        layout = data.get("format")
        if layout is not None and layout not in FORMATS:
            raise self.fail(f"{where}.format", f"expected one of {list(FORMATS)}, got {layout!r}")
        if layout is not None and len(axes) - any(a.is_batch for a in axes) != 3:
            raise self.fail(f"{where}.format", f"{layout} describes an image: three axes besides the batch")
        return TensorSpec(name, dtype, tuple(axes), labels, layout)

    def tensors(self, data: Mapping[str, Any], key: str, *, required: bool) -> tuple[TensorSpec, ...] | None:
        value = data.get(key)
        if value is None:
            if required:
                raise self.fail(key, "missing; expected a non-empty list of tensors")
            return None
        if not isinstance(value, list) or not value:
            raise self.fail(key, f"expected a non-empty list of tensors, got {value!r}")
        specs = tuple(
            self.tensor(
                t, f"{key}[{i}]", client=key.startswith("client_"), allow_variable=key.startswith("client_")
            )
            for i, t in enumerate(value)
        )
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise self.fail(key, f"tensor name(s) {duplicates} appear more than once")
        return specs


def parse_manifest(data: object, bundle: str, *, has_model_py: bool) -> Manifest:
    """Validate a loaded manifest mapping; `bundle` is the directory name."""
    read = _Reader(bundle)
    if not isinstance(data, Mapping):
        raise read.fail(None, f"expected a mapping at the top level, got {type(data).__name__}")
    unknown = set(data) - _KEYS
    if unknown:
        raise read.fail(_first(unknown), f"unknown key; expected one of {sorted(_KEYS)}")
    version = data.get("format_version")
    if str(version) not in ("2", "2.0"):
        raise read.fail("format_version", f'expected "2.0", got {version!r}')
    name = data.get("name", bundle)
    if name != bundle:
        raise read.fail("name", f"{name!r} must equal the bundle's directory name {bundle!r}")
    kind = data.get("kind", "model")
    if kind not in ("model", "meta"):
        raise read.fail("kind", f"{kind!r} is not a bundle kind; expected 'model' or 'meta'")
    if kind == "meta":
        return _meta_manifest(read, data, bundle, str(version), has_model_py=has_model_py)
    if "meta" in data:
        raise read.fail("meta", "allowed only with kind: meta")
    executable_inputs = read.tensors(data, "executable_inputs", required=True)
    executable_outputs = read.tensors(data, "executable_outputs", required=True)
    assert executable_inputs is not None and executable_outputs is not None
    client_inputs = read.tensors(data, "client_inputs", required=False)
    client_outputs = read.tensors(data, "client_outputs", required=False)
    for key, specs in (("client_inputs", client_inputs), ("client_outputs", client_outputs)):
        if specs is not None and not has_model_py:
            raise read.fail(key, "allowed only in a bundle with a model.py that transforms the tensors")
    # Without client_* tensors the executable ones are what clients see, so they need wire types.
    for key, specs, client in (
        ("executable_inputs", executable_inputs, client_inputs),
        ("executable_outputs", executable_outputs, client_outputs),
    ):
        for i, spec in enumerate(specs):
            if client is None and spec.dtype.wire is None:
                raise read.fail(
                    f"{key}[{i}].dtype", f"{spec.dtype.token} has no KServe datatype; clients cannot send it"
                )
    batched = [s.batch_axis is not None for s in executable_inputs]
    if any(batched) and not all(batched):
        unbatched = [s.name for s, b in zip(executable_inputs, batched, strict=True) if not b]
        raise read.fail("executable_inputs", f"batch axes are all or none; {unbatched} have no n/b axis")
    sizes = _batch_sizes(read, data.get("batching"))
    if len(sizes) > 1 and not all(batched):
        raise read.fail(
            "batching.compiled_batch_sizes", "several batch sizes need inputs with a batch axis (n or b)"
        )
    if "input_shapes" in data:
        raise read.fail(
            "input_shapes", "shape variants are not supported by hloserve yet; export one bundle per shape"
        )
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise read.fail("provenance", f"expected a mapping, got {provenance!r}")
    return Manifest(
        xla_options=_xla_options(read, data.get("xla_options")),
        name=bundle,
        format_version=str(version),
        executable_inputs=executable_inputs,
        executable_outputs=executable_outputs,
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        compiled_batch_sizes=sizes,
        description=str(data.get("description") or ""),
        provenance=dict(provenance),
    )


def _meta_manifest(
    read: _Reader, data: Mapping[str, Any], bundle: str, version: str, *, has_model_py: bool
) -> Manifest:
    """A `kind: meta` bundle: client tensors, `meta.calls`, and a model.py; no executable."""
    if not has_model_py:
        raise read.fail("kind", "a meta model needs a model.py that calls register_meta_model")
    for key in ("input_shapes", "batching", "xla_options"):
        if key in data:
            raise read.fail(key, "not allowed with kind: meta (a meta model has no executable)")
    client_inputs = read.tensors(data, "client_inputs", required=True)
    client_outputs = read.tensors(data, "client_outputs", required=True)
    assert client_inputs is not None and client_outputs is not None
    for key in ("executable_inputs", "executable_outputs"):  # upstream allows them; checked, unused
        read.tensors(data, key, required=False)
    meta = data.get("meta") or {}
    if not isinstance(meta, Mapping) or set(meta) - {"calls"}:
        raise read.fail("meta", f"expected a mapping with calls, got {meta!r}")
    calls = meta.get("calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, str) and c for c in calls):
        raise read.fail("meta.calls", f"expected a list of model names, got {calls!r}")
    if len(set(calls)) != len(calls):
        raise read.fail("meta.calls", f"{calls} names a model more than once")
    if bundle in calls:
        raise read.fail("meta.calls", "a meta model may not call itself")
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise read.fail("provenance", f"expected a mapping, got {provenance!r}")
    return Manifest(
        name=bundle,
        format_version=version,
        executable_inputs=(),
        executable_outputs=(),
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        description=str(data.get("description") or ""),
        provenance=dict(provenance),
        kind="meta",
        calls=tuple(calls),
    )


def _batch_sizes(read: _Reader, batching: Any) -> tuple[int, ...]:
    if batching is None:
        return ()
    if not isinstance(batching, Mapping) or set(batching) - {"compiled_batch_sizes"}:
        raise read.fail("batching", f"expected a mapping with compiled_batch_sizes, got {batching!r}")
    sizes = batching.get("compiled_batch_sizes") or []
    where = "batching.compiled_batch_sizes"
    if not isinstance(sizes, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes
    ):
        raise read.fail(where, f"expected a list of positive integers, got {sizes!r}")
    if len(set(sizes)) != len(sizes):
        raise read.fail(where, f"{sizes} repeats a size")
    return tuple(sorted(sizes))


def _xla_options(read: _Reader, data: Any) -> dict[str, dict[str, str | bool | int | float]]:
    """`xla_options`: platform → {XLA debug option: value}, and hloserve's own `kernels.OPTION`
    (true or false). Whether XLA knows an option and takes its value is checked where the module
    is compiled (it fails the load, naming it)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise read.fail("xla_options", f"expected a mapping of platform to options, got {data!r}")
    options: dict[str, dict[str, str | bool | int | float]] = {}
    for platform, values in data.items():
        where = f"xla_options.{platform}"
        if platform not in PLATFORMS:
            raise read.fail(where, f"unknown platform; expected one of {list(PLATFORMS)}")
        if not isinstance(values, Mapping):
            raise read.fail(where, f"expected a mapping of XLA option to value, got {values!r}")
        for option, value in values.items():
            if option == kernels.OPTION:
                if not isinstance(value, bool):
                    raise read.fail(f"{where}.{option}", f"expected true or false, got {value!r}")
                continue
            if not isinstance(option, str) or not _XLA_OPTION.match(option):
                raise read.fail(f"{where}.{option}", "expected an XLA option name: xla_ and lowercase words")
            if not isinstance(value, str | bool | int | float):
                raise read.fail(f"{where}.{option}", f"expected a string, number or boolean, got {value!r}")
        options[platform] = dict(values)
    return options


def _first(keys: set[Any]) -> str:
    """The first of some mapping keys, which YAML may make of any types, as text."""
    return min(map(str, keys))


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML was built with it: a tenth of the pure-Python one's time,
which a repository of thousands of bundles pays once per bundle at start-up."""


def load_manifest(path: Path, bundle: str, *, has_model_py: bool) -> Manifest:
    """Read and validate `manifest.yaml`."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_SAFE_LOADER)
    except yaml.YAMLError as e:
        raise BundleError(bundle, FILE, None, f"not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise BundleError(bundle, FILE, None, f"not UTF-8 text: {e}") from None
    except RecursionError:
        raise BundleError(bundle, FILE, None, "not valid YAML: nested too deeply") from None
    except OSError as e:
        raise BundleError(bundle, FILE, None, f"cannot read: {e.strerror}") from None
    return parse_manifest(data, bundle, has_model_py=has_model_py)
