"""A bundle on disk: manifest, StableHLO modules and weights, checked against each other.

Layout (ReactantServer.jl's format): `manifest.yaml`; `model.mlir` (one module) or `model.b{N}.mlir`
(one per compiled batch size), StableHLO text or portable-artifact bytecode; an optional
`weights.safetensors` whose `__metadata__.argument_order` lists the weights in argument order;
an optional `model.py` (a meta bundle has only the manifest and that). Every module's `main`
takes the executable inputs first, then the weights, and is checked here dtype by dtype and
shape by shape, because PJRT itself checks only byte sizes. Nothing is compiled here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import stat
import struct
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hloserve import dtypes
from hloserve.dtypes import DType
from hloserve.errors import BundleError, InvalidInput
from hloserve.models.aligned import host_buffer
from hloserve.models.manifest import FILE as MANIFEST
from hloserve.models.manifest import Manifest, TensorSpec, load_manifest
from hloserve.models.names import MAX_NAME_BYTES, MODEL_PY, check_model_name
from hloserve.models.signature import Signature, TensorType

if TYPE_CHECKING:
    from hloserve.models._xla import XlaOptions

__all__ = [
    "MAX_NAME_BYTES",
    "Bundle",
    "ModuleFile",
    "ModuleText",
    "WeightSpec",
    "bundle_directory",
    "check_inside",
    "check_model_name",
    "discover",
    "load_bundle",
    "read_weights",
]

WEIGHTS = "weights.safetensors"
_MODULE_NAME = re.compile(r"^model(?:\.b([1-9][0-9]*))?\.mlir$")
_BYTECODE_MAGIC = b"ML\xefR"
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "u8", "U16": "u16", "U32": "u32", "U64": "u64", "I8": "i8", "I16": "i16",
    "I32": "i32", "I64": "i64", "F16": "f16", "BF16": "bf16", "F32": "f32", "F64": "f64",
    "F8_E5M2": "f8_e5m2", "F8_E4M3": "f8_e4m3",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One tensor of `weights.safetensors`, where its bytes are in the file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, weakref_slot=True, eq=False)
class ModuleText:
    """A module's contents, parsed once: every bundle whose module file holds the same bytes
    shares one (the text is held once, and parsed once, however many variants of a model the
    repository has)."""

    digest: str
    """SHA-256 of the file's bytes: byte-identical modules are one program."""
    source: str | bytes
    """StableHLO text, or portable-artifact bytecode."""
    signature: Signature

    def __reduce__(self) -> tuple[Any, tuple[str, str | bytes, Signature]]:
        """Unpickled (in a frontend process) into that process's shared copy, as loaded ones are."""
        return _interned, (self.digest, self.source, self.signature)


def _interned(digest: str, source: str | bytes, signature: Signature) -> ModuleText:
    with _texts_lock:
        return _texts.setdefault(digest, ModuleText(digest, source, signature))


_texts: weakref.WeakValueDictionary[str, ModuleText] = weakref.WeakValueDictionary()
"""The module texts some bundle holds, by digest (an entry goes with the last bundle using it)."""
_texts_lock = threading.Lock()  # bundles load in worker threads


def _module_text(raw: bytes) -> ModuleText:
    """The shared, parsed text of a module file's bytes. Raises ValueError or KeyError as
    `_xla.main_signature` does."""
    digest = hashlib.sha256(raw).hexdigest()
    with _texts_lock:
        text = _texts.get(digest)
    if text is not None:
        return text
    source: str | bytes = raw if raw.startswith(_BYTECODE_MAGIC) else raw.decode("utf-8", errors="replace")
    from hloserve.models import _xla  # here: a frontend unpickles bundles and never parses one

    text = ModuleText(digest, source, _xla.main_signature(source))
    with _texts_lock:
        return _texts.setdefault(digest, text)


@dataclass(frozen=True, slots=True)
class ModuleFile:
    path: Path
    batch_size: int
    """The compiled batch size; 0 for a bundle's single `model.mlir`."""
    text: ModuleText

    @property
    def source(self) -> str | bytes:
        """StableHLO text, or portable-artifact bytecode."""
        return self.text.source

    @property
    def signature(self) -> Signature:
        return self.text.signature


@dataclass(frozen=True, slots=True)
class Bundle:
    name: str
    path: Path
    manifest: Manifest
    modules: tuple[ModuleFile, ...]
    """Ascending by batch size."""
    weights: tuple[WeightSpec, ...]
    """In `argument_order`."""
    weights_path: Path | None
    model_py: Path | None
    labels: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Class labels by output name, read from the files the manifest's outputs name."""

    @property
    def weight_nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def program_digest(self) -> str:
        """What its executables are compiled from: bundles with the same digest (byte-identical
        modules for the same batch sizes, the same XLA options here) share one loaded program.
        Empty for a meta bundle."""
        if not self.modules:
            return ""
        digest = hashlib.sha256()
        for module in self.modules:
            digest.update(f"{module.batch_size}:{module.text.digest};".encode())
        if self.xla_options:
            digest.update(f"XLA options {sorted(self.xla_options.items())!r}".encode())
        return digest.hexdigest()

    @property
    def xla_options(self) -> XlaOptions:
        """The manifest's XLA options for the platform this machine compiles for."""
        from hloserve.models import _xla  # here: only a process that compiles asks

        return self.manifest.xla_options.get(_xla.compile_platform(), {})

    def module_for(self, batch_size: int) -> ModuleFile:
        for module in self.modules:
            if module.batch_size == batch_size:
                return module
        raise KeyError(f"bundle {self.name!r} has no module for batch size {batch_size}")


def check_inside(path: Path, repository: Path, bundle: str) -> None:
    """BundleError unless `path`, links followed, lies inside `repository` (links followed):
    bundles, and the files they are read from, load only from inside the repository."""
    file = f"{path.name}/" if path.is_dir() else path.name
    try:
        inside = path.resolve().is_relative_to(repository.resolve())
    except (OSError, RuntimeError):  # a loop of links raises RuntimeError
        raise BundleError(
            bundle, file, None, "is a link that cannot be followed (a loop of links?)"
        ) from None
    if not inside:
        raise BundleError(
            bundle,
            file,
            None,
            "is a link leading outside the model repository; bundles load only from inside it",
        )


def _check_entry(path: Path, repository: Path, bundle: str) -> None:
    """`check_inside` for an entry directly in a bundle directory that was checked already: one
    `lstat` when it is no link (it lies where its directory does), the whole check when it is."""
    try:
        if not stat.S_ISLNK(path.lstat().st_mode):
            return
    except OSError:
        pass  # gone meanwhile: the full check says so, or the read that follows does
    check_inside(path, repository, bundle)


def bundle_directory(repository: Path, name: str) -> Path:
    """The directory of bundle `name` in `repository`: InvalidInput for a name that is not a
    plain name, BundleError for a directory that is a link leading outside the repository."""
    directory = repository / check_model_name(name)
    check_inside(directory, repository, name)
    return directory


def _read_safetensors_header(path: Path, bundle: str) -> tuple[list[WeightSpec], list[str] | None]:
    """The tensors of a safetensors file (absolute offsets) and its argument_order, if any."""

    def fail(field: str | None, problem: str) -> BundleError:
        return BundleError(bundle, WEIGHTS, field, problem)

    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise fail(None, f"not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise fail(None, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    order: list[str] | None = None
    if "argument_order" in metadata:
        try:
            order = json.loads(metadata["argument_order"])
        except (TypeError, ValueError):
            order = None
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            raise fail(
                "__metadata__.argument_order",
                f"expected a JSON list of tensor names, got {metadata['argument_order']!r}",
            )
    data_start = 8 + length
    specs = []
    for name, info in header.items():
        try:
            dtype = dtypes.by_token(_SAFETENSORS_DTYPES[info["dtype"]])
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise fail(name, f"unsupported or malformed tensor entry {info!r}") from None
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise fail(
                name, f"data_offsets span {end - begin} bytes, {dtype.token}{list(shape)} needs more or less"
            )
        specs.append(WeightSpec(name, dtype, shape, data_start + begin, end - begin))
    return specs, order


def _weights(directory: Path, bundle: str) -> tuple[tuple[WeightSpec, ...], Path | None]:
    path = directory / WEIGHTS
    if not path.exists():
        return (), None
    _check_entry(path, directory.parent, bundle)
    specs, order = _read_safetensors_header(path, bundle)
    if not specs:
        return (), path
    field = "__metadata__.argument_order"
    if order is None:
        raise BundleError(
            bundle,
            WEIGHTS,
            field,
            f"missing; {len(specs)} tensors need an order to be bound to the module's arguments",
        )
    by_name = {s.name: s for s in specs}
    repeated = sorted({n for n in order if order.count(n) > 1})
    unknown = [n for n in order if n not in by_name]
    unlisted = sorted(set(by_name) - set(order))
    if repeated or unknown or unlisted:
        problem = f"repeated {repeated}, not in the file {unknown}, unlisted {unlisted}"
        raise BundleError(bundle, WEIGHTS, field, f"must list every tensor exactly once ({problem})")
    return tuple(by_name[n] for n in order), path


def _modules(directory: Path, bundle: str, manifest: Manifest) -> tuple[ModuleFile, ...]:
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = _MODULE_NAME.match(path.name)
        if match:
            _check_entry(path, directory.parent, bundle)
            found[int(match.group(1) or 0)] = path
    if not found:
        raise BundleError(bundle, "model.mlir", None, "no module: expected model.mlir or model.b{N}.mlir")
    if 0 in found and len(found) > 1:
        raise BundleError(
            bundle, "model.mlir", None, "found beside model.b{N}.mlir files; use one layout or the other"
        )
    missing = [n for n in manifest.compiled_batch_sizes if n not in found and 0 not in found]
    if missing:
        raise BundleError(
            bundle, MANIFEST, "batching.compiled_batch_sizes", f"no module file for batch size(s) {missing}"
        )
    modules = []
    for size, path in sorted(found.items()):
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise BundleError(bundle, path.name, None, f"cannot be read: {e.strerror}") from None
        try:
            text = _module_text(raw)
        except (ValueError, KeyError) as e:
            raise BundleError(bundle, path.name, None, str(e.args[0])) from None
        modules.append(ModuleFile(path, size, text))
    return tuple(modules)


def _batch_of(module: ModuleFile, specs: tuple[TensorSpec, ...]) -> int | None:
    """The batch extent a module was compiled for: its file's size, or read from its signature."""
    if module.batch_size:
        return module.batch_size
    for spec, arg in zip(specs, module.signature.inputs, strict=False):
        if spec.batch_axis is not None and len(arg.shape) == len(spec.axes):
            return arg.shape[spec.batch_axis]
    return None


def _check_signature(
    bundle: str, module: ModuleFile, manifest: Manifest, weights: tuple[WeightSpec, ...]
) -> None:
    def fail(problem: str) -> BundleError:
        return BundleError(bundle, module.path.name, "main", problem)

    signature = module.signature
    if signature.donated:
        raise fail(
            f"donation attribute on argument(s) {list(signature.donated)}; export without donate_argnums"
        )
    inputs = manifest.executable_inputs
    expected_count = len(inputs) + len(weights)
    if len(signature.inputs) != expected_count:
        raise fail(
            f"takes {len(signature.inputs)} arguments, the manifest and weights need {expected_count} "
            f"({len(inputs)} inputs first, then {len(weights)} weights)"
        )
    batch = _batch_of(module, inputs)
    if manifest.batched and batch is None:
        raise fail("cannot tell the batch size of a single model.mlir from its signature")

    def check(kind: str, i: int, name: str, got: TensorType, dtype: DType, shape: tuple[int, ...]) -> None:
        if got.dtype != dtype or got.shape != shape:
            raise fail(f"{kind} {i} ({name!r}) is {got}, expected {dtype.token}[{','.join(map(str, shape))}]")

    for i, spec in enumerate(inputs):
        check("argument", i, spec.name, signature.inputs[i], spec.dtype, spec.wire_shape(batch or 0))
    for j, weight in enumerate(weights):
        check(
            "argument",
            len(inputs) + j,
            weight.name,
            signature.inputs[len(inputs) + j],
            weight.dtype,
            weight.shape,
        )
    outputs = manifest.executable_outputs
    if len(signature.outputs) != len(outputs):
        raise fail(f"returns {len(signature.outputs)} results, executable_outputs declares {len(outputs)}")
    for i, spec in enumerate(outputs):
        check("result", i, spec.name, signature.outputs[i], spec.dtype, spec.wire_shape(batch or 0))


def load_bundle(directory: Path) -> Bundle:
    """Read and check one bundle of the repository `directory.parent`; raises BundleError
    naming the file and field at fault. Every file read must lie inside the repository once
    links are followed (links within it are fine: a Kubernetes volume is made of them)."""
    name = directory.name
    repository = directory.parent
    check_inside(directory, repository, name)
    model_py = directory / MODEL_PY
    has_model_py = model_py.is_file()
    for path in (directory / MANIFEST, model_py):
        if path.exists():
            _check_entry(path, repository, name)
    manifest = load_manifest(directory / MANIFEST, name, has_model_py=has_model_py)
    labels = _labels(directory, name, manifest)
    if manifest.is_meta:
        return Bundle(name, directory, manifest, (), (), None, model_py, labels)
    weights, weights_path = _weights(directory, name)
    modules = _modules(directory, name, manifest)
    for module in modules:
        _check_signature(name, module, manifest, weights)
    if manifest.batched and modules[0].batch_size == 0:
        # A single batched model.mlir is compiled for the batch extent in its signature.
        extent = _batch_of(modules[0], manifest.executable_inputs)
        assert extent is not None  # _check_signature refused a batched module without one
        modules = (dataclasses.replace(modules[0], batch_size=extent),)
    return Bundle(
        name, directory, manifest, modules, weights, weights_path, model_py if has_model_py else None, labels
    )


MAX_LABELS_BYTES = 16 << 20
"""Largest labels file read (a million classes of 16 characters fit)."""


def _labels(directory: Path, name: str, manifest: Manifest) -> dict[str, tuple[str, ...]]:
    labels = {}
    for spec in manifest.outputs:
        if spec.labels is None:
            continue
        path = directory / spec.labels
        if not path.is_file():
            raise BundleError(
                name, MANIFEST, f"outputs.{spec.name}.labels", f"no file {spec.labels!r} in the bundle"
            )
        check_inside(path, directory.parent, name)
        with path.open("rb") as file:
            data = file.read(MAX_LABELS_BYTES + 1)
        if len(data) > MAX_LABELS_BYTES:
            raise BundleError(name, spec.labels, None, f"larger than {MAX_LABELS_BYTES} bytes")
        labels[spec.name] = tuple(data.decode("utf-8", "replace").splitlines())
    return labels


def discover(repository: Path) -> list[tuple[str, Bundle | BundleError]]:
    """Every subdirectory holding a manifest.yaml, loaded; one bad bundle never stops the rest."""
    found: list[tuple[str, Bundle | BundleError]] = []
    for directory in sorted(p for p in repository.iterdir() if (p / MANIFEST).is_file()):
        try:
            check_model_name(directory.name)
            found.append((directory.name, load_bundle(directory)))
        except BundleError as e:
            found.append((directory.name, e))
        except InvalidInput as e:
            found.append((directory.name, BundleError(directory.name, MANIFEST, None, e.problem)))
    return found


def read_weights(bundle: Bundle) -> list[np.ndarray]:
    """Every weight in argument order, each read once into its own 64-byte aligned array."""
    if bundle.weights_path is None:
        return []
    arrays = []
    with bundle.weights_path.open("rb", buffering=0) as f:
        for spec in bundle.weights:
            buffer = host_buffer(spec.nbytes)
            f.seek(spec.offset)
            if f.readinto(buffer.data) != spec.nbytes:
                raise BundleError(bundle.name, WEIGHTS, spec.name, "file is shorter than its header says")
            arrays.append(buffer.view(spec.dtype.numpy).reshape(spec.shape))
    return arrays
