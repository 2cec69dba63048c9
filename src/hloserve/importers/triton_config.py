"""A Triton model directory read into an import plan: what its bundle will be, or why it cannot be.

`read_model_config` parses `config.pbtxt` with protobuf's text format against Triton's
`model_config.proto` (compiled as `hloserve_triton`, see proto/generate.py). `plan_model` then
checks the platform, picks the highest numbered version, and maps each field onto a bundle or a
serving setting (`scheduler.models.<name>`), as a load's `config` override does
(`hloserve.models.load_override`): `max_batch_size` and `dynamic_batching`'s preferred sizes give the
compiled batch sizes, its queue delay and queue size the settings, `label_filename` a labels file.
Fields that cannot be honoured and would change what a client gets (sequence batching, ensembles,
reshapes, batch inputs) refuse the model; the others set in the file are listed as ignored.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format
from google.protobuf.message import Message

from hloserve import dtypes
from hloserve._proto.triton import triton_model_config_pb2 as pb

__all__ = [
    "CONFIG_FILE",
    "ModelPlan",
    "NotConvertible",
    "TensorPlan",
    "TritonConfigError",
    "autocomplete_config",
    "empty_config",
    "plan_model",
    "read_model_config",
]

CONFIG_FILE = "config.pbtxt"
ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
ONNX_FILE = "model.onnx"
VARIABLE = -1
DEFAULT_MAX_BATCH_SIZE = 4
"""Triton's `--backend-config=default-max-batch-size`, used when it auto-completes a config."""

HANDLED = frozenset(
    {
        "name",
        "platform",
        "backend",
        "max_batch_size",
        "default_model_filename",
        "version_policy.specific.versions",
        "version_policy.latest.num_versions",
        "input.name",
        "input.data_type",
        "input.dims",
        "input.format",
        "output.name",
        "output.data_type",
        "output.dims",
        "output.label_filename",
        "dynamic_batching.preferred_batch_size",
        "dynamic_batching.max_queue_delay_microseconds",
        "dynamic_batching.default_queue_policy.max_queue_size",
    }
)
"""Config fields (dotted, without indices) that become part of the bundle or its settings."""

REFUSED = {
    "sequence_batching": "sequence batching (a stateful model): a bundle is a stateless function",
    "ensemble_scheduling": "an ensemble: write a meta model (model.py calling the converted models)",
    "batch_input": "batch inputs: a bundle's inputs are what the client sends",
    "batch_output": "batch outputs: a bundle's outputs are what the model computes",
    "input.reshape": "a reshaped input: the bundle's input shape is the model's",
    "output.reshape": "a reshaped output: the bundle's output shape is the model's",
    "input.is_shape_tensor": "a shape tensor (TensorRT's)",
    "output.is_shape_tensor": "a shape tensor (TensorRT's)",
    "model_transaction_policy.decoupled": "a decoupled (streaming) model",
}
"""Fields that, when set, would change what a client gets: the model is not converted."""

_PLATFORMS = {  # Triton platforms and backends other than ONNX Runtime, in the user's words
    "tensorrt_plan": "TensorRT plan",
    "tensorrt": "TensorRT plan",
    "pytorch_libtorch": "TorchScript (libtorch)",
    "pytorch": "TorchScript (libtorch)",
    "tensorflow_savedmodel": "TensorFlow SavedModel",
    "tensorflow_graphdef": "TensorFlow GraphDef",
    "tensorflow": "TensorFlow",
    "python": "Python backend",
    "ensemble": "ensemble",
    "openvino": "OpenVINO",
    "fil": "FIL (tree models)",
    "dali": "DALI pipeline",
}


class TritonConfigError(Exception):
    """A `config.pbtxt` that protobuf's text format cannot read as a Triton ModelConfig: names
    the file, the line and column, and what the parser expected."""


class NotConvertible(Exception):
    """A model hloserve cannot import, with the reason in the user's terms (its platform, an
    operator without a converter, a dynamic shape, a field that cannot be honoured)."""


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One input or output as the client sees it: name, dtype, dims without the batch axis
    (-1 where the config leaves an axis variable), an image format, a labels file."""

    name: str
    dtype: np.dtype
    dims: tuple[int, ...] | None
    """None: the config does not list this tensor's dims (they come from the ONNX model)."""
    format: str | None = None
    labels: Path | None = None


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """What one Triton model directory becomes."""

    name: str
    model_file: Path
    version: int
    inputs: tuple[TensorPlan, ...]
    """Empty: the config lists none; every input of the ONNX model, as Triton's auto-complete."""
    outputs: tuple[TensorPlan, ...]
    """Empty: every output of the ONNX model."""
    batch_sizes: tuple[int, ...] | None
    """Compiled batch sizes; None for `max_batch_size: 0` (no batch axis, whole shapes)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Its `scheduler.models.<name>` entries."""
    ignored: tuple[str, ...] = ()
    """The config fields set in the file that hloserve does not honour (dotted, with indices)."""


def read_model_config(path: Path) -> Any:
    """Parse a `config.pbtxt` into a ModelConfig message (of `hloserve_triton`).

    Raises:
        TritonConfigError: unreadable, or not a ModelConfig in text format (with line and column).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TritonConfigError(f"{path}: cannot read: {e}") from None
    try:
        return text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as e:
        raise TritonConfigError(f"{path}:{e}") from None


def empty_config() -> Any:
    """A ModelConfig with nothing set (a model directory without config.pbtxt)."""
    return pb.ModelConfig()


def autocomplete_config(signature: tuple[Sequence[TensorPlan], Sequence[TensorPlan]]) -> Any:
    """The config Triton's auto-complete gives an ONNX model without config.pbtxt, from its
    (inputs, outputs): a batch axis when every tensor's first axis is dynamic, then
    `max_batch_size` 4 (Triton's default) and the dynamic batcher; whole shapes otherwise."""
    inputs, outputs = signature
    batched = all(t.dims and t.dims[0] == VARIABLE for t in (*inputs, *outputs))
    config = pb.ModelConfig(platform=ONNX_PLATFORM, max_batch_size=DEFAULT_MAX_BATCH_SIZE if batched else 0)
    if batched:
        config.dynamic_batching.SetInParent()
    for kind, tensors in ((config.input, inputs), (config.output, outputs)):
        for t in tensors:
            dims = (t.dims or ())[1 if batched else 0 :]
            wire = dtypes.by_numpy(np.dtype(t.dtype)).wire
            kind.add(name=t.name, data_type=pb.DataType.Value(f"TYPE_{wire}"), dims=dims)
    return config


def plan_model(directory: Path, config: Any) -> ModelPlan:
    """The import plan of the Triton model `directory` whose parsed config is `config`.

    Raises:
        NotConvertible: not an ONNX model, no model file in its highest version, a field that
            cannot be honoured, an inconsistent config (as Triton would refuse it).
    """
    name = directory.name
    if config.name and config.name != name:
        raise NotConvertible(f"config.pbtxt names the model {config.name!r}, its directory is {name!r}")
    platform = config.platform or config.backend
    if platform not in (ONNX_PLATFORM, ONNX_BACKEND, ""):  # "": the model file decides, as in Triton
        kind = _PLATFORMS.get(platform, platform)
        raise NotConvertible(
            f"platform {platform!r} ({kind}): only ONNX models convert; export the model's source "
            "with `hloserve export`"
        )
    set_fields = list(_set_fields(config, indexed=True))
    refused = sorted({REFUSED[r] for f in set_fields if (r := _within(f, REFUSED)) is not None})
    if refused:
        raise NotConvertible("; ".join(refused))
    version, model_file = _model_file(directory, config)
    if config.max_batch_size < 0:
        raise NotConvertible(f"max_batch_size is {config.max_batch_size}; expected 0 or more")
    batch_sizes = _batch_sizes(config)
    inputs = tuple(_tensor(t, f"input {t.name!r}", directory, is_input=True) for t in config.input)
    outputs = tuple(_tensor(t, f"output {t.name!r}", directory, is_input=False) for t in config.output)
    for kind, tensors in (("input", inputs), ("output", outputs)):
        names = [t.name for t in tensors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise NotConvertible(f"config.pbtxt lists {kind}(s) {duplicates} more than once")
    ignored = tuple(f for f in set_fields if _within(f, HANDLED) is None)
    if config.version_policy.latest.num_versions > 1:  # only the highest version is served
        ignored += ("version_policy.latest.num_versions",)
    return ModelPlan(name, model_file, version, inputs, outputs, batch_sizes, _settings(config), ignored)


# --- the pieces -----------------------------------------------------------------------------------


def _model_file(directory: Path, config: Any) -> tuple[int, Path]:
    """The highest numbered version allowed by the version policy, and its ONNX file."""
    filename = config.default_model_filename or ONNX_FILE
    platform = config.platform or config.backend
    versions = sorted(
        (int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True
    )
    if config.version_policy.WhichOneof("policy_choice") == "specific":
        allowed = set(config.version_policy.specific.versions)
        versions = [v for v in versions if v in allowed]
    if not versions:
        raise NotConvertible("no numbered version directory (such as 1/) holding the model")
    version = versions[0]
    path = directory / str(version) / filename
    if path.is_dir():  # Triton allows model.onnx/ holding model.onnx and its external data
        path = path / ONNX_FILE
    if not path.is_file():
        present = sorted(p.name for p in (directory / str(version)).iterdir())
        if not platform:
            raise NotConvertible(
                f"no platform or backend named, and no {filename} in version {version} "
                f"(it holds {present}): only ONNX models convert"
            )
        raise NotConvertible(f"version {version} has no {filename} (it holds {present})")
    return version, path


def _batch_sizes(config: Any) -> tuple[int, ...] | None:
    """Compiled sizes: dynamic_batching's preferred sizes and max_batch_size (1 and max_batch_size
    without preferred sizes); None without a batch axis."""
    largest = config.max_batch_size
    preferred = list(config.dynamic_batching.preferred_batch_size)
    if largest == 0:
        if preferred:
            raise NotConvertible("dynamic_batching.preferred_batch_size needs max_batch_size > 0")
        return None
    wrong = sorted({s for s in preferred if s < 1 or s > largest})
    if wrong:
        raise NotConvertible(
            f"dynamic_batching.preferred_batch_size {wrong} must lie within 1..max_batch_size ({largest})"
        )
    return tuple(sorted({*preferred, largest} if preferred else {1, largest}))


def _settings(config: Any) -> dict[str, Any]:
    """`scheduler.models.<name>`: what load_override maps from the same fields."""
    settings: dict[str, Any] = {}
    if config.max_batch_size > 0:
        settings["max_batch_size"] = int(config.max_batch_size)
    if config.WhichOneof("scheduling_choice") == "dynamic_batching":
        batching = config.dynamic_batching
        if batching.max_queue_delay_microseconds:
            settings["max_queue_delay_us"] = int(batching.max_queue_delay_microseconds)
        if batching.default_queue_policy.max_queue_size:  # 0: no limit of its own, as Triton
            settings["max_queue_depth"] = int(batching.default_queue_policy.max_queue_size)
    return settings


def _tensor(tensor: Any, where: str, directory: Path, *, is_input: bool) -> TensorPlan:
    if not tensor.name:
        raise NotConvertible(f"a{'n input' if is_input else 'n output'} in config.pbtxt has no name")
    type_name = pb.DataType.Name(tensor.data_type)
    if type_name == "TYPE_STRING":
        raise NotConvertible(
            f"{where} is TYPE_STRING: an executable takes numbers; strings need a model.py to turn them "
            "into numbers (export the model's source with `hloserve export`)"
        )
    if type_name == "TYPE_INVALID":
        raise NotConvertible(f"{where} has no data_type")
    dtype = dtypes.by_wire(type_name.removeprefix("TYPE_")).numpy
    dims = tuple(int(d) for d in tensor.dims)
    if any(d < 1 and d != VARIABLE for d in dims):
        raise NotConvertible(f"{where} has dims {list(dims)}; expected sizes >= 1 or -1")
    layout = None
    labels = None
    if is_input and tensor.format:
        layout = pb.ModelInput.Format.Name(tensor.format).removeprefix("FORMAT_")
        layout = None if layout == "NONE" else layout
    if not is_input and tensor.label_filename:
        labels = directory / tensor.label_filename
        if not labels.resolve().is_relative_to(directory.resolve()) or not labels.is_file():
            raise NotConvertible(
                f"{where}: label_filename {tensor.label_filename!r} is not a file in {directory}"
            )
    return TensorPlan(tensor.name, dtype, dims, layout, labels)


def _set_fields(message: Message, *, indexed: bool, prefix: str = "") -> Iterator[str]:
    """The dotted paths of every field set in `message` (leaves; indices with `indexed`)."""
    for descriptor, value in message.ListFields():
        path = f"{prefix}{descriptor.name}"
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            for key in sorted(value):
                entry = f'{path}["{key}"]' if indexed else path
                inner = list(_set_fields(value[key], indexed=indexed, prefix=f"{entry}."))
                yield from inner if isinstance(value[key], Message) and inner else [entry]
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            items: Sequence[Any] = value if _repeated(descriptor) else [value]
            for k, item in enumerate(items):
                item_path = f"{path}[{k}]" if indexed and _repeated(descriptor) else path
                fields = list(_set_fields(item, indexed=indexed, prefix=f"{item_path}."))
                yield from fields or [item_path]  # an empty message that is set (`all {}`)
        else:
            yield path


def _repeated(descriptor: Any) -> bool:
    # protobuf 6 deprecates `label`; `is_repeated` is newer than the oldest protobuf allowed
    if hasattr(type(descriptor), "is_repeated"):
        return bool(descriptor.is_repeated)
    return bool(descriptor.label == descriptor.LABEL_REPEATED)


def _within(path: str, fields: Collection[str]) -> str | None:
    """The entry of `fields` that `path` (indexed) is or lies inside, if any."""
    parts = re.sub(r"\[[^\]]*\]", "", path).split(".")
    return next((f for k in range(1, len(parts) + 1) if (f := ".".join(parts[:k])) in fields), None)
