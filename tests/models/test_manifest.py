"""manifest.yaml: letter shapes, dtypes, batch sizes, and one test per validation rule."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hloserve.errors import BundleError
from hloserve.models.manifest import Axis, parse_manifest

GOOD: dict[str, Any] = {
    "format_version": "2.0",
    "name": "grader",
    "executable_inputs": [
        {"name": "IMAGE", "dtype": "u8", "shape": "cwhn", "dims": {"c": 3, "w": 8, "h": 6}}
    ],
    "executable_outputs": [{"name": "LOGITS", "dtype": "f32", "shape": "zn", "dims": {"z": 9}}],
    "batching": {"compiled_batch_sizes": [6, 1, 3]},
}


def parse(data: Any, has_model_py: bool = False) -> Any:
    return parse_manifest(data, "grader", has_model_py=has_model_py)


def test_shapes_are_column_major_with_the_batch_axis_last() -> None:
    manifest = parse(GOOD)
    image = manifest.executable_inputs[0]
    assert image.axes == (Axis("c", 3), Axis("w", 8), Axis("h", 6), Axis("n", None))
    assert image.batch_axis == 0
    assert image.metadata_shape == [-1, 6, 8, 3]
    assert image.wire_shape(4) == (4, 6, 8, 3)
    assert image.dtype.wire == "UINT8"
    assert manifest.compiled_batch_sizes == (1, 3, 6)
    assert manifest.batched
    assert manifest.inputs == manifest.executable_inputs


def test_shape_problem_names_the_axis() -> None:
    image = parse(GOOD).executable_inputs[0]
    assert image.shape_problem([2, 6, 8, 3]) is None
    assert "rank 3" in (image.shape_problem([6, 8, 3]) or "")
    assert (
        image.shape_problem([2, 6, 9, 3])
        == "shape [2, 6, 9, 3] does not match [-1, 6, 8, 3]: axis 2 must be 8"
    )


@pytest.mark.parametrize("token", ["bool", "bf16", "i64", "u16", "f16", "f64"])
def test_every_wire_dtype_token_is_accepted(token: str) -> None:
    data = copy.deepcopy(GOOD)
    data["executable_inputs"][0]["dtype"] = token
    assert parse(data).executable_inputs[0].dtype.token == token


def test_client_tensors_with_a_model_py() -> None:
    data = copy.deepcopy(GOOD)
    data["client_outputs"] = [{"name": "grade", "dtype": "i64", "shape": "yn", "dims": {"y": -1}}]
    manifest = parse(data, has_model_py=True)
    assert manifest.outputs[0].name == "grade"
    assert manifest.outputs[0].metadata_shape == [-1, -1]


def _with(path: str, value: Any) -> dict[str, Any]:
    """GOOD with one key changed; path like 'executable_inputs.0.dims.c'; value DELETE removes."""
    data = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node: Any = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()

BAD_MANIFESTS = [
    pytest.param(["not", "a", "mapping"], None, "expected a mapping", id="not-a-mapping"),
    pytest.param(_with("format_version", "1.0"), "format_version", 'expected "2.0"', id="format-version"),
    pytest.param(
        _with("format_version", DELETE), "format_version", 'expected "2.0"', id="format-version-missing"
    ),
    pytest.param(
        _with("name", "other"), "name", "must equal the bundle's directory name", id="name-mismatch"
    ),
    pytest.param(_with("colour", "red"), "colour", "unknown key", id="unknown-key"),
    pytest.param(_with("executable_inputs", DELETE), "executable_inputs", "missing", id="inputs-missing"),
    pytest.param(_with("executable_outputs", []), "executable_outputs", "non-empty list", id="outputs-empty"),
    pytest.param(
        _with("executable_inputs.0.dtype", "f128"),
        "executable_inputs[0].dtype",
        "unknown dtype token",
        id="dtype",
    ),
    pytest.param(
        _with("executable_inputs.0.shape", "cw1n"),
        "executable_inputs[0].shape",
        "ASCII letters",
        id="shape-chars",
    ),
    pytest.param(
        _with("executable_inputs.0.shape", "ccn"),
        "executable_inputs[0].shape",
        "more than once",
        id="letters-unique",
    ),
    pytest.param(
        _with("executable_inputs.0.shape", "cwhnb"),
        "executable_inputs[0].shape",
        "both batch letters",
        id="two-batch-letters",
    ),
    pytest.param(
        _with("executable_inputs.0.dims.h", DELETE),
        "executable_inputs[0].dims",
        "no size for letter 'h'",
        id="dims-missing",
    ),
    pytest.param(
        _with("executable_inputs.0.dims.x", 4), "executable_inputs[0].dims.x", "not in shape", id="dims-extra"
    ),
    pytest.param(
        _with("executable_inputs.0.dims.n", 4),
        "executable_inputs[0].dims.n",
        "batch axis and takes no size",
        id="dims-batch",
    ),
    pytest.param(
        _with("executable_inputs.0.dims.c", 0),
        "executable_inputs[0].dims.c",
        "positive integer or -1",
        id="dims-zero",
    ),
    pytest.param(
        _with("executable_inputs.0.dims.c", "3"),
        "executable_inputs[0].dims.c",
        "positive integer or -1",
        id="dims-string",
    ),
    pytest.param(
        _with("executable_inputs.0.dims.c", -1),
        "executable_inputs[0].dims.c",
        "only in client_inputs and client_outputs",
        id="variable-on-executable",
    ),
    pytest.param(
        _with("executable_outputs.0.name", "IMAGE")
        | {"executable_outputs": [GOOD["executable_outputs"][0], GOOD["executable_outputs"][0]]},
        "executable_outputs",
        "more than once",
        id="duplicate-names",
    ),
    pytest.param(
        _with("executable_inputs.0.dtype", "f8_e5m2"),
        "executable_inputs[0].dtype",
        "no KServe datatype",
        id="fp8-on-the-wire",
    ),
    pytest.param(
        _with("client_outputs", [{"name": "g", "dtype": "i64", "shape": "n"}]),
        "client_outputs",
        "only in a bundle with a model.py",
        id="client-without-model-py",
    ),
    pytest.param(
        _with("batching.compiled_batch_sizes", [0, 4]),
        "batching.compiled_batch_sizes",
        "positive integers",
        id="batch-size-zero",
    ),
    pytest.param(
        _with("batching.compiled_batch_sizes", [4, 4]),
        "batching.compiled_batch_sizes",
        "repeats",
        id="batch-size-repeated",
    ),
    pytest.param(
        _with("batching.compiled_batch_sizes", "4"),
        "batching.compiled_batch_sizes",
        "positive integers",
        id="batch-sizes-not-list",
    ),
    pytest.param(_with("batching.extra", 1), "batching", "compiled_batch_sizes", id="batching-unknown-key"),
    pytest.param(
        _with(
            "executable_inputs",
            [GOOD["executable_inputs"][0], {"name": "K", "dtype": "f32", "shape": "k", "dims": {"k": 2}}],
        ),
        "executable_inputs",
        "all or none",
        id="batch-all-or-none",
    ),
    pytest.param(
        _with("executable_inputs.0.dtype", "bytes"),
        "executable_inputs[0].dtype",
        "may appear only in client_inputs and client_outputs",
        id="bytes-on-an-executable",
    ),
    pytest.param(
        _with("executable_inputs.0.format", "HWC"), "executable_inputs[0].format", "NHWC", id="bad-format"
    ),
    pytest.param(
        _with("executable_outputs.0.format", "NHWC"),
        "executable_outputs[0].format",
        "three axes besides the batch",
        id="format-not-an-image",
    ),
    pytest.param(
        _with("executable_outputs.0.labels", "../labels.txt"),
        "executable_outputs[0].labels",
        "a file in the bundle",
        id="labels-outside",
    ),
    pytest.param(
        _with("executable_inputs.0.shape", "cwh")
        | {"executable_inputs": [{"name": "X", "dtype": "f32", "shape": "k", "dims": {"k": 2}}]},
        "batching.compiled_batch_sizes",
        "several batch sizes need inputs with a batch axis",
        id="sizes-without-batch-axis",
    ),
    pytest.param(
        _with("xla_options", ["xla_cpu_use_onednn"]), "xla_options", "mapping of platform", id="xla-list"
    ),
    pytest.param(
        _with("xla_options", {"tpu": {"xla_tpu_x": 1}}),
        "xla_options.tpu",
        "unknown platform",
        id="xla-platform",
    ),
    pytest.param(
        _with("xla_options", {"cpu": {"--xla_cpu_use_onednn": True}}),
        "xla_options.cpu.--xla_cpu_use_onednn",
        "an XLA option name",
        id="xla-flag-syntax",
    ),
    pytest.param(
        _with("xla_options", {"cpu": {"xla_cpu_use_onednn": None}}),
        "xla_options.cpu.xla_cpu_use_onednn",
        "a string, number or boolean",
        id="xla-no-value",
    ),
    pytest.param(
        _with("xla_options", {"cpu": {"hloserve_native_kernels": "yes"}}),
        "xla_options.cpu.hloserve_native_kernels",
        "expected true or false",
        id="native-kernels-not-a-boolean",
    ),
]


@pytest.mark.parametrize(("data", "field", "says"), BAD_MANIFESTS)
def test_bad_manifest_names_bundle_file_and_field(data: Any, field: str | None, says: str) -> None:
    with pytest.raises(BundleError) as raised:
        parse(data)
    message = str(raised.value)
    assert message.startswith("bundle 'grader', file 'manifest.yaml'")
    if field is not None:
        assert f"field {field!r}" in message
    assert says in message


def test_xla_options_are_read_per_platform() -> None:
    options = {
        "cpu": {
            "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
            "hloserve_native_kernels": True,
        }
    }
    assert parse(_with("xla_options", options)).xla_options == options
    assert parse(GOOD).xla_options == {}
    meta = {
        "format_version": "2.0",
        "kind": "meta",
        "client_inputs": GOOD["executable_inputs"],
        "client_outputs": GOOD["executable_outputs"],
        "xla_options": options,
    }
    with pytest.raises(BundleError, match=r"xla_options.*not allowed with kind: meta"):
        parse(meta, has_model_py=True)  # a meta model has no executable to compile


def test_an_image_input_declares_its_layout() -> None:
    manifest = parse(_with("executable_inputs.0.format", "NHWC"))
    assert manifest.inputs[0].format == "NHWC" and manifest.outputs[0].format is None
