"""The zoo through ONNX, as a Triton user arrives: real architectures (random weights) exported
with `torch.onnx.export` here, laid out as a Triton repository with hand-written `config.pbtxt`
files, imported with `hloserve import triton`, served by one real server under a weight budget
that holds one model at a time, queried with tritonclient and compared with ONNX Runtime running
the same files.

ResNet-50 (convolutions, batch norm), ConvNeXt-T (depthwise convolutions, layer norm, GELU),
Swin-T (shifted-window attention: pads, slices, rolls) and DeiT-Ti (a ViT: global attention,
class token). Exported with a dynamic batch axis, as Triton needs, the attention models compute
their reshapes from `Shape` at run time: the importer folds them at each compiled batch size.

The Triton repository and the import are cached under `$HLOSERVE_ZOO_CACHE` (default
`~/.cache/hloserve/zoo`) in a folder keyed by the configs above, the specs, the importer's and exporter's
sources and the library versions, written whole or not at all, so a second run only serves.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
import tritonclient.grpc as grpcclient
from support.numerics import assert_close
from support.servers import ROOT, ServerThread, residency, start_worker
from tritonclient.utils import InferenceServerException

from hloserve.config import load_config
from hloserve.export._torchvision import prepare_torchvision_import
from hloserve.models.bundle import load_bundle

prepare_torchvision_import()
import specs  # noqa: E402  # imports torchvision and timm: after the line above

pytestmark = pytest.mark.timeout(1800)  # the first run exports and imports every model

CLASSES = 1000
CONFIGS = {
    # dims given in full; labels; preferred size 2 beside the max 4: compiled sizes 2 and 4
    "resnet50": """
        name: "resnet50"
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "IMAGE", data_type: TYPE_FP32, format: FORMAT_NCHW, dims: [ 3, 224, 224 ] } ]
        output [ { name: "LOGITS", data_type: TYPE_FP32, dims: [ 1000 ], label_filename: "labels.txt" } ]
        dynamic_batching {
          preferred_batch_size: [ 2 ]
          max_queue_delay_microseconds: 2000
          default_queue_policy { max_queue_size: 32 }
        }
        instance_group [ { count: 2, kind: KIND_CPU } ]
    """,
    # -1 dims that the ONNX file fixes; the backend's name instead of the platform
    "convnext_tiny": """
        backend: "onnxruntime"
        max_batch_size: 4
        input [ { name: "IMAGE", data_type: TYPE_FP32, dims: [ 3, -1, -1 ] } ]
        output [ { name: "LOGITS", data_type: TYPE_FP32, dims: [ -1 ] } ]
        dynamic_batching { preferred_batch_size: [ 4 ] }
        parameters { key: "intra_op_thread_count" value { string_value: "1" } }
    """,
    # one compiled size (the preferred is the max): 1 and 3 rows padded to 4
    "swin_t": """
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "IMAGE", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]
        output [ { name: "LOGITS", data_type: TYPE_FP32, dims: [ 1000 ] } ]
        dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }
    """,
    "timm_deit_tiny_patch16_224": """
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "IMAGE", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]
        output [ { name: "LOGITS", data_type: TYPE_FP32, dims: [ 1000 ] } ]
        dynamic_batching { preferred_batch_size: [ 2 ] }
    """,
}
BATCH_SIZES = {
    "resnet50": (2, 4),
    "convnext_tiny": (4,),
    "swin_t": (4,),
    "timm_deit_tiny_patch16_224": (2, 4),
}
REQUESTS = {"batch 1": 1, "padded (3 on 4)": 3}
OVER_MAX_ROWS = 6
"""Rows past config.pbtxt's max_batch_size 4: refused, as Triton refuses them (the exported zoo,
which sets no max_batch_size, checks a split request)."""
_SOURCES = (
    Path(specs.__file__),
    *sorted(
        path
        for package in ("importers", "export", "models")
        for path in (ROOT / "src" / "hloserve" / package).glob("*.py")
    ),
)
_PACKAGES = ("torch", "torchvision", "timm", "torchax", "jax", "jaxlib", "onnx", "onnxruntime", "onnx2torch")


def _cache_root() -> Path:
    """The Triton repository and its import for these sources, with these libraries."""
    digest = hashlib.sha256(repr(sorted(CONFIGS.items())).encode())
    for path in _SOURCES:
        digest.update(path.read_bytes())
    for package in _PACKAGES:
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    base = os.environ.get("HLOSERVE_ZOO_CACHE") or Path.home() / ".cache" / "hloserve" / "zoo"
    return Path(base) / f"onnx-{digest.hexdigest()[:16]}"


def _triton_repository(repository: Path) -> None:
    """Each model as a Triton user has it: `1/model.onnx` with a dynamic batch axis, its config,
    its labels."""
    for name, config in CONFIGS.items():
        directory = repository / name
        (directory / "1").mkdir(parents=True)
        (directory / "config.pbtxt").write_text(textwrap.dedent(config).lstrip())
        with torch.no_grad(), warnings.catch_warnings():
            # The TorchScript-based exporter at opset 17 (onnx2torch 1.5.15 has no converters for
            # some opset 19 operators); torch deprecates it, in warnings about torch itself.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                specs.build(name),
                (specs.images(2),),
                str(directory / "1" / "model.onnx"),
                dynamo=False,
                opset_version=17,
                input_names=["IMAGE"],
                output_names=["LOGITS"],
                dynamic_axes={"IMAGE": {0: "batch"}, "LOGITS": {0: "batch"}},
            )
    (repository / "resnet50" / "labels.txt").write_text("".join(f"class_{k}\n" for k in range(CLASSES)))


def imported_repository() -> tuple[Path, int, str]:
    """The cached Triton repository and `hloserve import triton`'s exit status and report, made
    (in a staging folder, then moved into place) unless cached. `benches imports` times them."""
    root = _cache_root()
    if not (root / "report.txt").exists():
        staging = root.with_name(root.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        _triton_repository(staging / "triton")
        command = [sys.executable, "-m", "hloserve.cli", "import", "triton", str(staging / "triton")]
        done = subprocess.run(
            [*command, "--out", str(staging / "hloserve")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )
        (staging / "status").write_text(str(done.returncode))
        (staging / "report.txt").write_text(done.stdout + done.stderr[-4000:])
        staging.rename(root)
    return root, int((root / "status").read_text()), (root / "report.txt").read_text()


@pytest.fixture(scope="module", name="imported")
def _imported() -> tuple[Path, int, str]:
    return imported_repository()


def _report_lines(report: str) -> dict[str, str]:
    """Each model's line of the report (two-space indent), by model name."""
    found = {}
    for line in report.splitlines():
        if line.startswith("  ") and not line.startswith("    ") and ": " in line:
            name, _, rest = line.strip().partition(": ")
            found[name] = rest
    return found


def test_import_converts_every_model_verified_against_onnx_runtime(imported: tuple[Path, int, str]) -> None:
    _, status, report = imported
    lines = _report_lines(report)
    assert status == 0, report
    for name, sizes in BATCH_SIZES.items():
        verified = f"version 1, batch sizes {', '.join(map(str, sizes))}, agrees with ONNX Runtime (LOGITS "
        assert lines[name].startswith(verified), report
    assert "    ignored config.pbtxt fields: instance_group[0].count, instance_group[0].kind" in report
    assert '    ignored config.pbtxt fields: parameters["intra_op_thread_count"].string_value' in report


def test_import_writes_the_configs_settings_and_labels(imported: tuple[Path, int, str]) -> None:
    root, _, _ = imported
    out = root / "hloserve"
    for name, sizes in BATCH_SIZES.items():
        bundle = load_bundle(out / name)
        assert bundle.manifest.compiled_batch_sizes == sizes
        onnx_bytes = (root / "triton" / name / "1" / "model.onnx").stat().st_size
        assert bundle.weight_nbytes < 1.05 * onnx_bytes, "one copy of the weights for every batch size"
        manifest = bundle.manifest
        assert [a.size for a in manifest.executable_inputs[0].axes] == [224, 224, 3, None]
    assert load_bundle(out / "resnet50").manifest.executable_outputs[0].labels == "labels.txt"
    assert load_config(out / "hloserve.yaml", environ={}).scheduler.models["resnet50"].max_queue_depth == 32


@pytest.fixture(scope="module", name="server")
def _server(imported: tuple[Path, int, str]) -> Iterator[ServerThread]:
    """The import served with the config it wrote, under a weight budget that holds the largest
    model and no more: the models take turns on the device."""
    root, _, _ = imported
    out = root / "hloserve"
    sizes = [load_bundle(out / name).weight_nbytes for name in BATCH_SIZES]
    config = load_config(out / "hloserve.yaml", environ={})
    config = config.replace(
        "server",
        model_repository=out,
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        executable_cache=root / "executables",
    )
    config = config.replace("weights", budget_bytes=int(max(sizes) * 1.1))
    assert int(max(sizes) * 1.1) < sum(sizes), "the budget must not hold every model"
    with start_worker(config, timeout=900) as server:
        yield server


@pytest.mark.parametrize("name", BATCH_SIZES)
def test_imported_model_serves_what_onnx_runtime_computes(
    name: str, imported: tuple[Path, int, str], server: ServerThread
) -> None:
    root, _, _ = imported
    session = onnxruntime.InferenceSession(
        str(root / "triton" / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    client = grpcclient.InferenceServerClient(server.url)
    try:
        for seed, (request, rows) in enumerate(REQUESTS.items(), 1):
            image = specs.images(rows, seed=seed).numpy()
            tensor = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
            tensor.set_data_from_numpy(image)
            served = client.infer(name, [tensor], client_timeout=600).as_numpy("LOGITS")
            (expected,) = session.run(["LOGITS"], {"IMAGE": image})
            assert served is not None and served.shape == (rows, CLASSES), (request, served)
            assert abs(expected).max() > 0, "all 0: the comparison would prove nothing"
            assert_close(served, expected)
            difference, scale = float(abs(served - expected).max()), float(abs(expected).max())
            print(f"{name} {request}: max |served - ONNX Runtime| {difference:.2g}, largest {scale:.3g}")
        over = grpcclient.InferInput("IMAGE", [OVER_MAX_ROWS, 3, 224, 224], "FP32")
        over.set_data_from_numpy(specs.images(OVER_MAX_ROWS, seed=0).numpy())
        with pytest.raises(InferenceServerException) as refused:
            client.infer(name, [over], client_timeout=600)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"batch-size must be <= 4 for '{name}'" in str(refused.value.message())
        if name == "resnet50":
            top = client.infer(
                name, [tensor], outputs=[grpcclient.InferRequestedOutput("LOGITS", class_count=1)]
            ).as_numpy("LOGITS")
            best = int(np.argmax(expected[-1]))
            assert top[-1][0].decode().endswith(f":{best}:class_{best}")
    finally:
        client.close()


def test_imported_models_took_turns_under_the_budget(server: ServerThread) -> None:
    """Four models served under a budget for the largest: serving them evicted some."""
    state = residency(server)
    budget = server.config.weights.budget_bytes
    print(f"budget {budget / 1e6:.0f} MB; (resident, loads, evictions) by model: {state}")
    assert sum(evictions for _, _, evictions in state.values()) > 0, state
