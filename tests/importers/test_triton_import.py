"""`hloserve import`: a Triton repository's ONNX models (and one ONNX file) become served bundles
that agree with ONNX Runtime; other platforms, unsupported operators, dynamic shapes and bad
configs are reported, never half-written.

onnx, onnxruntime, onnx2torch, torch and torchvision are test dependencies (the `onnx` extra):
without them this file fails to import, and so fails, instead of skipping.
"""

from __future__ import annotations

import contextlib
import io
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml
from onnx import TensorProto, helper
from support.servers import start_worker

from hloserve.cli import main
from hloserve.config import load_config
from hloserve.export import verification
from hloserve.export._torchvision import prepare_torchvision_import
from hloserve.importers import NotConvertible, TritonConfigError, import_onnx_file, onnx_model
from hloserve.importers.triton_config import plan_model, read_model_config
from hloserve.models.bundle import load_bundle

prepare_torchvision_import()
import torchvision  # noqa: E402  (after the schemas it needs beside a CPU torch)

SQUEEZENET_CONFIG = """
name: "squeezenet"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "IMAGE", data_type: TYPE_FP32, format: FORMAT_NCHW, dims: [ 3, -1, -1 ] } ]
output [ { name: "LOGITS", data_type: TYPE_FP32, dims: [ 10 ], label_filename: "labels.txt" } ]
dynamic_batching {
  preferred_batch_size: [ 2 ]
  max_queue_delay_microseconds: 500
  default_queue_policy { max_queue_size: 16 }
}
instance_group [ { count: 2, kind: KIND_CPU } ]
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
"""

TABULAR_CONFIG = """
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "features", data_type: TYPE_FP32, dims: [ 3, 8 ] } ]
output [ { name: "probs", data_type: TYPE_FP32, dims: [ 3, 4 ] } ]
"""


class Tabular(torch.nn.Module):
    """Two outputs, of which the config serves one."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.layer(torch.tanh(features))
        return logits, torch.softmax(logits, dim=-1)


def _onnx_export(module: torch.nn.Module, example: torch.Tensor, path: Path, **names: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # The TorchScript-based exporter (the dynamo one needs onnxscript) at opset 17, which
        # onnx2torch 1.5.15 has converters for (Identity 19 has none); torch deprecates it, and
        # its own internals, in DeprecationWarnings about torch, not about hloserve.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module.eval(), (example,), str(path), dynamo=False, opset_version=17, **names)
    return path


def _one_node_model(path: Path, op: str, node_name: str, dims: list[Any]) -> Path:
    """A graph of one node `op` from X to Y, both FP32 of `dims`."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, dims)
    graph = helper.make_graph([helper.make_node(op, ["X"], ["Y"], name=node_name)], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _model_dir(repository: Path, name: str, config: str) -> Path:
    directory = repository / name
    directory.mkdir(parents=True)
    (directory / "config.pbtxt").write_text(textwrap.dedent(config))
    return directory


def _triton_repository(root: Path) -> Path:
    repository = root / "triton"
    torch.manual_seed(0)
    squeezenet = _model_dir(repository, "squeezenet", SQUEEZENET_CONFIG)
    (squeezenet / "1").mkdir()
    (squeezenet / "1" / "model.onnx").write_bytes(b"an older version, never read")
    _onnx_export(
        torchvision.models.squeezenet1_1(num_classes=10),
        torch.randn(2, 3, 32, 32),
        squeezenet / "3" / "model.onnx",
        input_names=["IMAGE"],
        output_names=["LOGITS"],
        dynamic_axes={"IMAGE": {0: "batch"}, "LOGITS": {0: "batch"}},
    )
    (squeezenet / "labels.txt").write_text("".join(f"class_{k}\n" for k in range(10)))
    tabular = _model_dir(repository, "tabular", TABULAR_CONFIG)
    _onnx_export(
        Tabular(),
        torch.randn(3, 8),
        tabular / "1" / "model.onnx",
        input_names=["features"],
        output_names=["logits", "probs"],
    )
    engine = _model_dir(repository, "engine", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n')
    (engine / "1").mkdir()
    (engine / "1" / "model.plan").write_bytes(b"\x00serialized engine")
    python = _model_dir(repository, "preprocess", 'backend: "python"\nmax_batch_size: 8\n')
    (python / "1").mkdir()
    (python / "1" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    dynamic = _model_dir(
        repository,
        "sequence",
        'platform: "onnxruntime_onnx"\nmax_batch_size: 2\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ -1 ] } ]\n',
    )
    _one_node_model(dynamic / "1" / "model.onnx", "Relu", "relu", ["batch", "seq"])
    unsupported = _model_dir(repository, "hardmax", 'platform: "onnxruntime_onnx"\nmax_batch_size: 2\n')
    _one_node_model(unsupported / "1" / "model.onnx", "Hardmax", "pick_max", ["batch", 5])
    _one_node_model(repository / "autoconf" / "2" / "model.onnx", "Relu", "relu", ["batch", 5])  # no config
    broken = _model_dir(
        repository, "broken", 'platform: "onnxruntime_onnx"\nmax_batch_size: 2\ninput [ { nme: "X" } ]\n'
    )
    _one_node_model(broken / "1" / "model.onnx", "Relu", "relu", ["batch", 5])
    return repository


@pytest.fixture(scope="module", name="imported")
def _imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, str]:
    root = tmp_path_factory.mktemp("import")
    repository = _triton_repository(root)
    out = root / "hloserve"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["import", "triton", str(repository), "--out", str(out)])
    return repository, out, status, printed.getvalue()


def _report_lines(report: str) -> dict[str, str]:
    """Each model's line of the report (two-space indent), by model name."""
    found = {}
    for line in report.splitlines():
        if line.startswith("  ") and not line.startswith("    ") and ":" in line:
            name, _, rest = line.strip().partition(": ")
            found[name] = rest
    return found


@pytest.mark.slow
def test_import_triton_converts_the_onnx_models_and_reports_the_others(
    imported: tuple[Path, Path, int, str],
) -> None:
    """Exit 1 (some did not convert); each refusal says why; only whole bundles are in --out."""
    _, out, status, report = imported
    assert status == 1, report
    lines = _report_lines(report)
    assert "converted (3):" in report and "not converted (5):" in report, report
    assert lines["squeezenet"].startswith("version 3, batch sizes 2, 4, agrees with ONNX Runtime (LOGITS "), (
        report
    )
    assert lines["tabular"].startswith(
        "version 1, batch sizes none (whole shapes), agrees with ONNX Runtime"
    ), report
    assert lines["autoconf"].startswith("version 2, batch sizes 1, 4, agrees with ONNX Runtime (Y 0 <= "), (
        report
    )
    assert "    no config.pbtxt: config completed from the ONNX model, as Triton does" in report.splitlines()
    assert lines["engine"] == (
        "platform 'tensorrt_plan' (TensorRT plan): only ONNX models convert; "
        "export the model's source with `hloserve export`"
    )
    assert lines["preprocess"].startswith("platform 'python' (Python backend): only ONNX models convert")
    assert lines["sequence"] == (
        "input 'X' axis 0 is dynamic in both the ONNX model and the config (dims [-1]): "
        "hloserve compiles static shapes; give its size in config.pbtxt's dims"
    )
    assert lines["hardmax"] == (
        "unsupported operator: Hardmax (opset 17) at node 'pick_max' (onnx2torch has no converter)"
    )
    assert lines["broken"].endswith(
        'broken/config.pbtxt:3:11 : Message type "hloserve_triton.ModelInput" has no field named "nme".'
    ), lines["broken"]
    assert (
        "    ignored config.pbtxt fields: instance_group[0].count, instance_group[0].kind, "
        'parameters["intra_op_thread_count"].string_value'
    ) in report.splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["autoconf", "hloserve.yaml", "squeezenet", "tabular"]


@pytest.mark.slow
def test_import_triton_writes_manifests_and_settings_from_the_config(
    imported: tuple[Path, Path, int, str],
) -> None:
    """Dims, format, labels, compiled sizes and the dynamic batcher's settings carry over."""
    _, out, _, _ = imported
    squeezenet = load_bundle(out / "squeezenet").manifest
    assert squeezenet.compiled_batch_sizes == (2, 4)
    (image,) = squeezenet.executable_inputs
    assert (image.name, image.format, image.dtype.token) == ("IMAGE", "NCHW", "f32")
    assert [a.size for a in image.axes] == [32, 32, 3, None]  # column-major, batch last
    assert squeezenet.executable_outputs[0].labels == "labels.txt"
    assert (out / "squeezenet" / "labels.txt").read_text().splitlines()[3] == "class_3"
    tabular = load_bundle(out / "tabular").manifest
    assert not tabular.batched and [t.name for t in tabular.executable_outputs] == ["probs"]
    assert yaml.safe_load((out / "hloserve.yaml").read_text()) == {
        "server": {"model_repository": str(out.resolve())},
        "scheduler": {
            "models": {
                "autoconf": {"max_batch_size": 4},
                "squeezenet": {"max_batch_size": 4, "max_queue_delay_us": 500, "max_queue_depth": 16},
            }
        },
    }


def _assert_agrees(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    difference = verification.compare(got, want, verification.default_tolerance(want.dtype))
    assert difference.ok, difference.describe()


@pytest.mark.slow
def test_imported_models_served_agree_with_onnx_runtime(imported: tuple[Path, Path, int, str]) -> None:
    """Served with the written config and queried with tritonclient, as a Triton client would."""
    repository, out, _, _ = imported
    config = load_config(out / "hloserve.yaml", environ={})
    config = config.replace("server", grpc_port=0, http_port=0, metrics_port=0)
    squeezenet = onnxruntime.InferenceSession(str(repository / "squeezenet" / "3" / "model.onnx"))
    tabular = onnxruntime.InferenceSession(str(repository / "tabular" / "1" / "model.onnx"))
    rng = np.random.default_rng(7)
    with start_worker(config) as worker:
        client = grpcclient.InferenceServerClient(worker.url)
        served = client.get_model_config("squeezenet").config
        assert served.max_batch_size == 4 and list(served.input[0].dims) == [3, 32, 32]
        for rows in (1, 3):  # 3 is not compiled: padded to 4
            image = rng.standard_normal((rows, 3, 32, 32)).astype(np.float32)
            request = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
            request.set_data_from_numpy(image)
            result = client.infer("squeezenet", [request])
            _assert_agrees(result.as_numpy("LOGITS"), squeezenet.run(["LOGITS"], {"IMAGE": image})[0])
        top = client.infer(
            "squeezenet", [request], outputs=[grpcclient.InferRequestedOutput("LOGITS", class_count=1)]
        ).as_numpy("LOGITS")
        best = int(np.argmax(squeezenet.run(["LOGITS"], {"IMAGE": image})[0][0]))
        assert top[0][0].decode().endswith(f":{best}:class_{best}")
        features = rng.standard_normal((3, 8)).astype(np.float32)
        request = grpcclient.InferInput("features", [3, 8], "FP32")
        request.set_data_from_numpy(features)
        result = client.infer("tabular", [request])
        assert result.as_numpy("logits") is None
        _assert_agrees(result.as_numpy("probs"), tabular.run(["probs"], {"features": features})[0])


class SmallConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.norm(self.conv(image))).mean(dim=(2, 3))
        return self.head(features)


@pytest.mark.slow
def test_import_onnx_file_with_dims_for_dynamic_axes(tmp_path: Path) -> None:
    """Height and width dynamic in the file: --dims fixes them; without, a clear refusal."""
    torch.manual_seed(0)
    model = _onnx_export(
        SmallConvNet(),
        torch.randn(2, 3, 8, 8),
        tmp_path / "conv.onnx",
        input_names=["IMAGE"],
        output_names=["SCORES"],
        dynamic_axes={"IMAGE": {0: "n", 2: "h", 3: "w"}, "SCORES": {0: "n"}},
    )
    out = tmp_path / "repo" / "conv"
    with pytest.raises(
        NotConvertible,
        match=r"^input 'IMAGE' axis 1 is dynamic in both the ONNX model and the config "
        r"\(dims \[3, -1, -1\]\): hloserve compiles static shapes",
    ):
        import_onnx_file(model, out, batch_sizes=[1, 2])
    printed = io.StringIO()
    args = ["import", "onnx", str(model), "--out", str(out), "--batch-sizes", "1,2", "--dims", "IMAGE=3,8,8"]
    with contextlib.redirect_stdout(printed):
        assert main(args) == 0
    assert printed.getvalue().startswith(f"{out}: written, agrees with ONNX Runtime (SCORES ")
    manifest = load_bundle(out).manifest
    assert manifest.compiled_batch_sizes == (1, 2)
    assert [a.size for a in manifest.executable_inputs[0].axes] == [8, 8, 3, None]
    with pytest.raises(FileExistsError, match=r"already exists; remove it or choose another --out$"):
        import_onnx_file(model, out, dims={"IMAGE": (3, 8, 8)})
    assert sorted(p.name for p in out.parent.iterdir()) == ["conv"]


class Windows(torch.nn.Module):
    """What a transformer's dynamic-batch ONNX export computes from `Shape` at run time: a
    reshape by the batch size, pads, slices, a split and one row taken by its index."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        padded = torch.nn.functional.pad(self.norm(tokens), (0, 0, 1, 1))  # (N, 8, 4)
        windows = padded.reshape(rows, 2, 4, 4)[:, :, 1:3]  # (N, 2, 2, 4)
        left, right = windows.split(2, dim=-1)
        return (left * right).reshape(rows, 2, -1)[:, 1] + tokens[:, 0, :1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Constant folding - Only steps=1 can be constant folded:UserWarning")
def test_import_onnx_folds_shapes_computed_at_run_time(tmp_path: Path) -> None:
    """A dynamic batch axis the graph reads with `Shape`: folded and converted at each batch
    size (onnx2torch's module alone cannot be traced by torch.export), agreeing with ONNX Runtime."""
    torch.manual_seed(0)
    model = _onnx_export(
        Windows(),
        torch.randn(2, 6, 4),
        tmp_path / "windows.onnx",
        input_names=["TOKENS"],
        output_names=["MIXED"],
        dynamic_axes={"TOKENS": {0: "n"}, "MIXED": {0: "n"}},
    )
    assert {"Shape", "Reshape", "Slice", "Pad"} <= {n.op_type for n in onnx.load(str(model)).graph.node}
    bundle = import_onnx_file(model, tmp_path / "repo" / "windows", batch_sizes=[1, 3])
    assert bundle.batch_sizes == (1, 3)
    assert [c.name for c in bundle.checks] == ["MIXED"]
    assert load_bundle(tmp_path / "repo" / "windows").manifest.compiled_batch_sizes == (1, 3)


def test_an_export_failure_names_the_onnx_node_it_stopped_at() -> None:
    """onnx2torch names each module after its node; the failure inside one is reported there."""

    class OnnxReshape(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise TypeError("torch.Size() takes an iterable of 'int'")

    converted = torch.nn.Module()
    converted.add_module("blocks/0/attn/Reshape", OnnxReshape())
    module = torch.nn.ModuleDict({"model": converted})
    try:
        try:
            module["model"].get_submodule("blocks/0/attn/Reshape")(torch.zeros(1))
        except TypeError as e:
            raise ValueError("torch.export cannot trace Selected at batch size 2") from e
    except ValueError as e:
        assert onnx_model._at_node(e, module) == " at node 'blocks/0/attn/Reshape' (Reshape)"
        assert onnx_model._at_node(ValueError("elsewhere"), module) == ""
    else:
        pytest.fail("the module did not raise")


@pytest.mark.slow
def test_import_onnx_that_does_not_verify_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle that differs from ONNX Runtime is reported and never moved into its place."""
    model = _one_node_model(tmp_path / "tanh.onnx", "Tanh", "squash", ["batch", 6])
    monkeypatch.setitem(verification.DEFAULT_TOLERANCES, "f32", verification.Tolerance(-1.0, -1.0))
    out = tmp_path / "repo" / "tanh"
    with pytest.raises(
        NotConvertible, match=r"^differs from ONNX Runtime: bundle 'tanh', output 'Y', batch size 1"
    ):
        import_onnx_file(model, out, batch_sizes=[1, 3])
    assert list(out.parent.iterdir()) == []


def test_bad_config_pbtxt_names_the_file_line_and_field(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_text('name: "m"\nmax_batch_size: "eight"\n')
    with pytest.raises(
        TritonConfigError,
        match=r"^.*/config\.pbtxt:2:17 : 'max_batch_size: \"eight\"': Couldn't parse integer: \"eight\"$",
    ):
        read_model_config(tmp_path / "config.pbtxt")


def _plan(tmp_path: Path, config: str) -> Any:
    directory = tmp_path / "m"
    (directory / "1").mkdir(parents=True)
    (directory / "1" / "model.onnx").write_bytes(b"")
    (directory / "config.pbtxt").write_text(config)
    return plan_model(directory, read_model_config(directory / "config.pbtxt"))


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            'platform: "onnxruntime_onnx" sequence_batching { max_sequence_idle_microseconds: 5 }',
            "sequence batching (a stateful model): a bundle is a stateless function",
        ),
        (
            'platform: "tensorrt_plan" input [ { name: "x", data_type: TYPE_INT32, is_shape_tensor: true } ]',
            "platform 'tensorrt_plan' (TensorRT plan): only ONNX models convert; "
            "export the model's source with `hloserve export`",
        ),
        (
            'backend: "onnxruntime" max_batch_size: 4 '
            'input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ], reshape { shape: [ 1, 2 ] } } ]',
            "a reshaped input: the bundle's input shape is the model's",
        ),
        (
            'backend: "onnxruntime" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 2, 8 ] }',
            "dynamic_batching.preferred_batch_size [8] must lie within 1..max_batch_size (4)",
        ),
        (
            'name: "other" backend: "onnxruntime"',
            "config.pbtxt names the model 'other', its directory is 'm'",
        ),
        (
            'backend: "onnxruntime" input [ { name: "text", data_type: TYPE_STRING, dims: [ 1 ] } ]',
            "input 'text' is TYPE_STRING: an executable takes numbers; strings need a model.py to turn them "
            "into numbers (export the model's source with `hloserve export`)",
        ),
        (
            'backend: "onnxruntime" output [ { name: "y", data_type: TYPE_FP32, dims: [ 3 ], '
            'label_filename: "../labels.txt" } ]',
            "output 'y': label_filename '../labels.txt' is not a file in ",
        ),
    ],
)
def test_plan_refuses_what_a_bundle_cannot_honour(tmp_path: Path, config: str, reason: str) -> None:
    with pytest.raises(NotConvertible) as refused:
        _plan(tmp_path, config)
    assert str(refused.value).startswith(reason)


def test_plan_lists_every_field_it_ignores_by_its_path(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        'backend: "onnxruntime" max_batch_size: 8 version_policy { all {} }\n'
        "dynamic_batching { preferred_batch_size: [ 4 ] priority_levels: 2 default_queue_policy { "
        "max_queue_size: 3 default_timeout_microseconds: 100 } }\n"
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 2 ], optional: true } ]\n'
        'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }\n'
        'model_warmup [ { name: "w", batch_size: 1 } ]\n',
    )
    assert plan.batch_sizes == (4, 8)
    assert plan.settings == {"max_batch_size": 8, "max_queue_depth": 3}
    assert plan.ignored == (
        "version_policy.all",
        "input[0].optional",
        "dynamic_batching.priority_levels",
        "dynamic_batching.default_queue_policy.default_timeout_microseconds",
        "optimization.execution_accelerators.cpu_execution_accelerator[0].name",
        "model_warmup[0].name",
        "model_warmup[0].batch_size",
    )
