"""`precision=` / `--precision`: bf16 and fp16 bundles store half the weight bytes and compute in
that type, while clients send and get what they did (FP32 in, FP32 out), within the precision's
tolerance of the float32 model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch
import tritonclient.grpc as grpcclient
import yaml
from safetensors import safe_open
from support.clients import infer
from support.servers import make_config, start_worker

from hloserve import dtypes
from hloserve.cli import main
from hloserve.export.jax import InputSpec, OutputSpec, export_bundle
from hloserve.export.torch import export_torch_bundle
from hloserve.export.verification import (
    DEFAULT_TOLERANCES,
    Tolerance,
    _tolerance,
    compare,
    precision_tolerance,
)
from hloserve.models import _xla
from hloserve.models.bundle import load_bundle

jnp = _xla.jnp


def mlp(params: dict[str, Any], x: Any) -> Any:
    """A two-layer MLP with an integer weight (a class offset) that must stay an integer."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"] + params["offset"].astype(h.dtype)


def mlp_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((16, 64)) / 4).astype(np.float32),
        "b1": rng.standard_normal(64).astype(np.float32) / 10,
        "w2": (rng.standard_normal((64, 10)) / 8).astype(np.float32),
        "b2": rng.standard_normal(10).astype(np.float32) / 10,
        "offset": np.arange(10, dtype=np.int32),
    }


def weight_bytes(directory: Path) -> tuple[int, int, dict[str, str]]:
    """The weights file's size, its tensors' bytes (without the header) and each weight's dtype."""
    path = directory / "weights.safetensors"
    with safe_open(str(path), "np") as f:
        kinds = {name: str(f.get_slice(name).get_dtype()) for name in f.keys()}
    size = path.stat().st_size
    return size, size - 8 - int.from_bytes(path.read_bytes()[:8], "little"), kinds


def export_mlp(directory: Path, precision: str) -> Path:
    return export_bundle(
        mlp,
        mlp_params(),
        [InputSpec("X", (16,))],
        directory,
        batch_sizes=(1, 4),
        outputs=[OutputSpec("LOGITS")],
        precision=precision,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("precision", "stored"), [("bf16", "BF16"), ("fp16", "F16")])
def test_half_precision_halves_weight_bytes_and_keeps_client_dtypes(
    tmp_path: Path, precision: str, stored: str
) -> None:
    wide = export_mlp(tmp_path / "f32" / "mlp", "fp32")
    with structlog.testing.capture_logs() as logs:
        narrow = export_mlp(tmp_path / precision / "mlp", precision)
    (wide_size, wide_data, wide_kinds) = weight_bytes(wide)
    (narrow_size, narrow_data, narrow_kinds) = weight_bytes(narrow)
    assert wide_kinds == {"w1": "F32", "b1": "F32", "w2": "F32", "b2": "F32", "offset": "I32"}
    assert narrow_kinds == {"w1": stored, "b1": stored, "w2": stored, "b2": stored, "offset": "I32"}
    # 1,738 f32 floats and 10 int32: the floats' bytes halve, the header stays
    floats = 16 * 64 + 64 + 64 * 10 + 10
    assert (wide_data, narrow_data) == (floats * 4 + 40, floats * 2 + 40)
    assert narrow_size < 0.55 * wide_size
    manifests = [yaml.safe_load((d / "manifest.yaml").read_text()) for d in (wide, narrow)]
    for key in ("executable_inputs", "executable_outputs"):
        assert manifests[0][key] == manifests[1][key]
    assert manifests[1]["executable_inputs"][0]["dtype"] == "f32"
    assert manifests[1]["executable_outputs"][0]["dtype"] == "f32"
    assert manifests[1]["provenance"]["precision"] == precision
    assert "precision" not in manifests[0]["provenance"]
    token = dtypes.by_token("bf16" if precision == "bf16" else "f16").mlir
    module = (narrow / "model.b4.mlir").read_text()
    assert f"tensor<4x16x{token}>" in module and f"tensor<16x64x{token}>" in module  # computes narrow
    (verified,) = [e for e in logs if e["event"] == "bundle verified in a fresh process"]
    assert verified["top1_agreement_LOGITS"] >= 0.75
    assert (
        verified["max_relative_difference"]
        <= precision_tolerance(dtypes.by_token("bf16" if precision == "bf16" else "f16").numpy).atol + 0.05
    )


def test_bf16_bundle_served_answers_fp32_within_the_bf16_tolerance(tmp_path: Path) -> None:
    export_mlp(tmp_path / "mlp", "bf16")
    bundle = load_bundle(tmp_path / "mlp")
    assert {w.name: w.dtype.token for w in bundle.weights}["w1"] == "bf16"
    x = np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)
    want = np.asarray(mlp(mlp_params(), x))
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        served = infer(client, "mlp", {"X": x}).as_numpy("LOGITS")
        client.close()
    assert served.dtype == np.float32 and served.shape == (3, 10)
    tolerance = precision_tolerance(dtypes.by_token("bf16").numpy)
    difference = compare(served, want, tolerance)
    assert difference.ok, difference.describe()
    assert difference.max_abs > 0  # it did compute in bf16
    assert (np.argmax(served, axis=1) == np.argmax(want, axis=1)).all()


def test_integer_inputs_stay_integers(tmp_path: Path) -> None:
    def scaled(params: dict[str, Any], image: Any) -> Any:
        return (image.astype(params["w"].dtype) / 255).reshape(image.shape[0], -1) @ params["w"]

    params = {"w": np.random.default_rng(1).standard_normal((12, 3)).astype(np.float32)}
    directory = export_bundle(
        scaled, params, [InputSpec("IMAGE", (2, 2, 3), np.uint8)], tmp_path / "u8", precision="bf16"
    )
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert manifest["executable_inputs"][0]["dtype"] == "u8"
    assert manifest["executable_outputs"][0]["dtype"] == "f32"


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8 * 4 * 4, 10)
        self.register_buffer("order", torch.arange(9, -1, -1))  # an integer weight the program reads

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(image))), 2)
        return self.head(features.flatten(1))[:, self.order]


def test_torch_bf16_bundle_halves_bytes_and_serves_fp32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    examples = (torch.randn(4, 3, 8, 8),)
    options: dict[str, Any] = {
        "inputs": [InputSpec("IMAGE", (3, 8, 8), np.float32, letters="chw")],
        "outputs": [OutputSpec("LOGITS", letters="k")],
        "batch_sizes": (1, 4),
    }
    wide = export_torch_bundle(model, examples, tmp_path / "f32" / "cnn", **options)
    with structlog.testing.capture_logs() as logs:
        narrow = export_torch_bundle(model, examples, tmp_path / "repo" / "cnn", precision="bf16", **options)
    (wide_size, wide_data, _), (narrow_size, narrow_data, kinds) = weight_bytes(wide), weight_bytes(narrow)
    assert kinds["conv.weight"] == "BF16" and kinds["order"] == "I64"
    floats = sum(int(np.prod(w.shape)) for w in load_bundle(wide).weights if w.dtype.token == "f32")
    assert wide_data - narrow_data == floats * 2  # every float's 4 bytes became 2
    assert narrow_size < 0.6 * wide_size  # 3,572 against 6,600 bytes: the header stays
    manifests = [yaml.safe_load((d / "manifest.yaml").read_text()) for d in (wide, narrow)]
    for key in ("executable_inputs", "executable_outputs"):
        assert manifests[0][key] == manifests[1][key]
    (verified,) = [e for e in logs if e["event"] == "bundle verified in a fresh process"]
    assert verified["top1_agreement_LOGITS"] >= 0.75

    image = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        want = model(image).numpy()
    with start_worker(make_config(tmp_path / "repo")) as server:
        client = grpcclient.InferenceServerClient(server.url)
        served = infer(client, "cnn", {"IMAGE": image.numpy()}).as_numpy("LOGITS")
        client.close()
    assert served.dtype == np.float32
    difference = compare(served, want, precision_tolerance(dtypes.by_token("bf16").numpy))
    assert difference.ok, difference.describe()


SPEC = (
    "import numpy as np\nfrom hloserve.export.jax import InputSpec\n\n"
    "def make():\n"
    "    return {'fn': lambda p, x: x @ p['w'], 'params': {'w': np.eye(4, dtype=np.float32)},"
    " 'inputs': [InputSpec('X', (4,))]}\n"
)


def test_a_bad_precision_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.py").write_text(SPEC)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["export", f"{tmp_path / 'spec.py'}:make", "--out", str(out), "--precision", "int8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--precision: invalid choice: 'int8'" in err and "bf16" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        export_bundle(
            lambda p, x: x,
            {},
            [InputSpec("X", (4,))],
            tmp_path / "x",
            precision="fp8",  # type: ignore[arg-type]
        )


def test_cli_export_precision_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without capsys: the CLI configures logging to the stderr it finds, which capsys closes."""
    (tmp_path / "spec.py").write_text(SPEC)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    assert main(["export", f"{tmp_path / 'spec.py'}:make", "--out", str(out), "--precision", "bf16"]) == 0
    assert weight_bytes(out)[2] == {"w": "BF16"}


def test_the_precision_tolerance_is_for_wider_float_outputs_only() -> None:
    bf16, f16 = dtypes.by_token("bf16").numpy, np.dtype(np.float16)
    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    assert _tolerance(f32, None, None, bf16) == DEFAULT_TOLERANCES["bf16"] == precision_tolerance(bf16)
    assert _tolerance(f32, None, None, f16) == DEFAULT_TOLERANCES["f16"]
    assert _tolerance(f16, None, None, bf16) == DEFAULT_TOLERANCES["f16"]  # as narrow: its own
    assert _tolerance(i64, None, None, bf16) == Tolerance(0.0, 0.0)  # integers stay exact
    assert _tolerance(f32, 1e-3, None, bf16) == Tolerance(1e-3, DEFAULT_TOLERANCES["bf16"].atol)
    assert _tolerance(f32, None, None) == DEFAULT_TOLERANCES["f32"]
