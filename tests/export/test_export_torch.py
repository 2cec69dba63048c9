"""The PyTorch exporter: torch.export and torchax to a bundle that serves what the torch module computes.

torch and torchax are test dependencies (the `torch` extra): without them this file fails to
import, and so fails, instead of skipping.

Serving an exported bundle runs with one process: the exporter is under test, not the server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml
from support.numerics import assert_close
from support.servers import make_config, start_worker

from hloserve.cli import main
from hloserve.export.jax import InputSpec, OutputSpec
from hloserve.export.torch import LoweringError, export_torch_bundle
from hloserve.models import _xla
from hloserve.models.bundle import load_bundle, read_weights


class SmallCNN(torch.nn.Module):
    """conv, batch norm, relu, max pool and a linear head on NCHW images, and a float64 scalar
    buffer that x64 JAX would let promote the whole head to f64 unless it is demoted."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 4 * 4, 5)
        self.register_buffer("temperature", torch.tensor(0.5, dtype=torch.float64))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(image))), 2)
        return self.head(features.flatten(1)) * self.temperature


def small_cnn() -> SmallCNN:
    torch.manual_seed(0)
    model = SmallCNN()
    model.norm.running_mean.copy_(torch.linspace(-0.5, 0.5, 4))
    model.norm.running_var.copy_(torch.linspace(0.5, 2.0, 4))
    return model


def test_torch_cnn_exported_and_served_matches_torch(tmp_path: Path) -> None:
    model = small_cnn()
    examples = (torch.randn(3, 3, 8, 8),)
    export_torch_bundle(
        model,
        examples,
        tmp_path / "cnn",
        inputs=[InputSpec("IMAGE", (3, 8, 8), np.float32, letters="chw")],
        outputs=[OutputSpec("LOGITS", letters="k")],
        batch_sizes=(4, 1),
    )
    assert model.training, "the caller's module keeps its training mode"
    bundle = load_bundle(tmp_path / "cnn")
    assert [(w.name, w.dtype.token) for w in bundle.weights] == [
        ("conv.weight", "f32"), ("head.weight", "f32"), ("head.bias", "f32"), ("temperature", "f32"),
        ("norm.bias", "f32"),
    ]  # fmt: skip  # the batch norm folded into conv: its shift (and conv's bias) as norm.bias
    manifest = yaml.safe_load((tmp_path / "cnn" / "manifest.yaml").read_text())
    assert manifest["executable_inputs"] == [
        {"name": "IMAGE", "dtype": "f32", "shape": "whcn", "dims": {"c": 3, "h": 8, "w": 8}}
    ]
    assert manifest["executable_outputs"] == [
        {"name": "LOGITS", "dtype": "f32", "shape": "kn", "dims": {"k": 5}}
    ]
    assert {
        k: manifest["provenance"][k] for k in ("source_framework", "torch_version", "torchax_version")
    } == {
        "source_framework": "torch",
        "torch_version": str(torch.__version__),
        "torchax_version": "0.0.13",
    }

    model.eval()
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for rows in (4, 1):
            image = torch.randn(rows, 3, 8, 8)
            tensor = grpcclient.InferInput("IMAGE", [rows, 3, 8, 8], "FP32")
            tensor.set_data_from_numpy(image.numpy())
            served = client.infer("cnn", [tensor]).as_numpy("LOGITS")
            with torch.no_grad():
                assert_close(served, model(image).numpy())
        client.close()


def test_torch_bytecode_bundle_loads_and_verifies(tmp_path: Path) -> None:
    """Verification (on by default) ran the portable artifact against torch in a fresh process."""
    directory = export_torch_bundle(
        small_cnn(),
        (torch.randn(2, 3, 8, 8),),
        tmp_path / "cnn_bc",
        batch_sizes=(2,),
        module_format="bytecode",
    )
    (module,) = load_bundle(directory).modules
    assert isinstance(module.source, bytes) and module.source.startswith(b"ML\xefR")


class ResidualBlock(torch.nn.Module):
    """ResNet's and MobileNet's shapes: conv and batch norm (with and without a conv bias), a
    depthwise conv (lowered as shifted slices), a residual add and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_norm = torch.nn.BatchNorm2d(8)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.depthwise_norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem_norm(self.stem(image)))
        x = torch.relu(x + self.depthwise_norm(self.depthwise(x)))
        return self.head(x.mean((2, 3)))


def _entry_transposes_of_weights(hlo: str, n_inputs: int) -> list[str]:
    """The instructions of the optimized entry computation that transpose or copy a weight (a
    parameter after the inputs) before anything reads it: work each execution would repeat."""
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    weights = {
        line.split(" = ")[0].strip().removeprefix("ROOT ")
        for line in entry.splitlines()
        if " parameter(" in line and int(line.rsplit("parameter(", 1)[1].split(")")[0]) >= n_inputs
    }
    found = []
    for line in entry.splitlines():
        if " = " not in line or not any(op in line for op in ("transpose", "copy")):
            continue
        operands = line.split("(", 1)[1].split(")", 1)[0].split(", ")
        if operands and all(o.strip() in weights for o in operands):
            found.append(line.strip()[:120])
    return found


def test_torch_export_folds_batch_norm_and_stores_weights_as_xla_reads_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualBlock()
    for norm in (model.stem_norm, model.depthwise_norm):
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.data.uniform_(0.5, 2)
        norm.bias.data.uniform_(-1, 1)
    directory = export_torch_bundle(model, (torch.randn(2, 3, 12, 12),), tmp_path / "block", batch_sizes=(2,))
    bundle = load_bundle(directory)
    shapes = {w.name: w.shape for w in bundle.weights}
    assert shapes == {
        "stem.weight": (3, 3, 3, 8),  # HWIO, not torch's OIHW
        "depthwise.weight": (3, 3, 1, 8),
        "head.weight": (8, 5),  # (in, out), not torch's (out, in)
        "head.bias": (5,),
        "stem_norm.bias": (8,),  # each batch norm's shift: its convolution's bias now
        "depthwise_norm.bias": (8,),
    }
    provenance = yaml.safe_load((directory / "manifest.yaml").read_text())["provenance"]
    assert provenance["folded_batch_norms"] == ["stem_norm", "depthwise_norm"]
    assert provenance["weights_stored_transposed"] == ["stem.weight", "depthwise.weight", "head.weight"]

    (module,) = bundle.modules
    executable = _xla.compile_module(module.source)
    assert _entry_transposes_of_weights(executable.hlo_modules()[0].to_string(), 1) == []
    image = torch.randn(2, 3, 12, 12)
    arguments = _xla.put_all([image.numpy(), *read_weights(bundle)])
    (result,) = _xla.to_numpy(_xla.run(executable, arguments))
    model.eval()
    with torch.no_grad():
        assert_close(result, model(image).numpy())


class Standardized(torch.nn.Module):
    """A convolution whose weight is standardized per filter in the forward pass (timm's
    ScaledStdConv2d, the NF-ResNets'), then scaled by a gain; a class token expanded to the batch
    (weights alone, but multiplied out by the batch size: never folded)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 2.0, 8).reshape(8, 1, 1, 1))
        self.token = torch.nn.Parameter(torch.randn(1, 8))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        weight = self.conv.weight
        mean = weight.mean((1, 2, 3), keepdim=True)
        std = weight.var((1, 2, 3), keepdim=True, unbiased=False).add(1e-5).rsqrt()
        y = torch.nn.functional.conv2d(image, (weight - mean) * std * self.gain, self.conv.bias, padding=1)
        return y.mean((2, 3)) + self.token.expand(image.shape[0], -1)


def test_torch_export_computes_weight_standardization_once_at_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Standardized().eval()
    directory = export_torch_bundle(model, (torch.randn(2, 3, 8, 8),), tmp_path / "std", batch_sizes=(1, 2))
    bundle = load_bundle(directory)
    shapes = {w.name: w.shape for w in bundle.weights}
    # the standardized weight stored once, HWIO; the raw weight and the gain no longer stored
    assert shapes == {"conv.weight.folded": (3, 3, 3, 8), "conv.bias": (8,), "token": (1, 8)}
    provenance = yaml.safe_load((directory / "manifest.yaml").read_text())["provenance"]
    assert provenance["weights_computed_at_export"] == ["conv.weight.folded"]
    for module in bundle.modules:  # nothing left of the standardization in the program
        hlo = _xla.compile_module(module.source).hlo_modules()[0].to_string()
        assert "rsqrt" not in hlo, module.batch_size
        image = torch.randn(module.batch_size, 3, 8, 8)
        arguments = _xla.put_all([image.numpy(), *read_weights(bundle)])
        (result,) = _xla.to_numpy(_xla.run(_xla.compile_module(module.source), arguments))
        with torch.no_grad():
            assert_close(result, model(image).numpy())


class ChannelsLastShapes(torch.nn.Module):
    """What the channels-last lowering computes on NHWC arrays, beside what it hands back to torch's
    layout: strided and grouped convolutions, a dilated strided depthwise one, a batch norm it
    cannot fold, ConvNeXt's permutes around a layer norm, a squeeze-excite mean, means over the
    channel axis and over every axis, broadcasts of 3-D and 4-D tensors, an interpolation and a flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=8)
        self.pointwise = torch.nn.Conv2d(8, 12, 1, stride=2)
        self.norm = torch.nn.BatchNorm2d(8)  # after an add: not folded
        self.layer_norm = torch.nn.LayerNorm(12)
        self.linear = torch.nn.Linear(12, 12)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 12).reshape(12, 1, 1))
        self.excite = torch.nn.Conv2d(12, 12, 1)
        self.head = torch.nn.Linear(12 * 2 * 2, 5)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.nn.functional.hardswish(self.stem(image))
        x = self.norm(x + self.grouped(x)) - x.mean(1, keepdim=True)
        x = torch.relu(self.depthwise(x)) * torch.sigmoid(image[:, :1, ::4, ::4] + 1)
        y = self.pointwise(x)
        z = self.linear(self.layer_norm(y.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        y = y + torch.nn.functional.gelu(z) * self.scale
        y = y * torch.sigmoid(self.excite(y.mean((2, 3), keepdim=True)))
        segmentation = torch.nn.functional.interpolate(y, size=(8, 8), mode="bilinear")
        logits = self.head(y.flatten(1)) + y.mean((2, 3)).sum(1, keepdim=True)
        return segmentation, logits + torch.mean(y, dim=None, keepdim=True).flatten(1)


def test_torch_export_keeps_activations_channels_last(tmp_path: Path) -> None:
    """Activations stay NHWC between convolutions (XLA:CPU's NCHW path was 3x slower on
    EfficientNet), and the bundle still computes what torch does, outputs in torch's layout."""
    torch.manual_seed(0)
    model = ChannelsLastShapes()
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.running_var.uniform_(0.5, 2)
    directory = export_torch_bundle(model, (torch.randn(2, 3, 16, 16),), tmp_path / "nhwc", batch_sizes=(2,))
    bundle = load_bundle(directory)
    (module,) = bundle.modules
    executable = _xla.compile_module(module.source)
    hlo = executable.hlo_modules()[0].to_string()
    # NCHW all through, XLA:CPU transposes around each convolution: 15 transposes (jaxlib
    # 0.10.2); channels-last, only where torch's layout is asked for (input, interpolation,
    # flatten, outputs)
    assert hlo.count("transpose(") <= 8, hlo
    image = torch.randn(2, 3, 16, 16)
    arguments = _xla.put_all([image.numpy(), *read_weights(bundle)])
    results = _xla.to_numpy(_xla.run(executable, arguments))
    model.eval()
    with torch.no_grad():
        expected = model(image)
    assert [r.shape for r in results] == [(2, 12, 8, 8), (2, 5)]
    for result, reference in zip(results, expected, strict=True):
        assert_close(result, reference.numpy())


class Pools(torch.nn.Module):
    """Max pools as ResNets, SqueezeNet (ceil mode) and a padded, dilated one use them; with
    `indices`, one whose indices the model reads (computed as torchax does, on the NCHW tensor)."""

    def __init__(self, indices: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.indices = indices

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(image))
        x = torch.nn.functional.max_pool2d(x, 3, stride=2, ceil_mode=True)
        x = torch.nn.functional.max_pool2d(x, 3, stride=1, padding=1) - x
        y = torch.nn.functional.max_pool2d(x, 2, stride=2, padding=1, dilation=2, ceil_mode=True)
        if self.indices:
            values, indices = torch.nn.functional.max_pool2d(-x, 2, return_indices=True)
            y = y[:, :, :3, :3] + values * 2 + indices.float()
        return y


@pytest.mark.parametrize("indices", [False, True])
def test_torch_export_pools_channels_last_in_the_activations_dtype(tmp_path: Path, indices: bool) -> None:
    """torchax's max pool ran NCHW in float64 (x64 widens its -inf), two transposes and two
    conversions per pool; channels-last it is one reduce-window in f32."""
    torch.manual_seed(0)
    model = Pools(indices).eval()
    directory = export_torch_bundle(model, (torch.randn(2, 3, 15, 15),), tmp_path / "pools", batch_sizes=(2,))
    bundle = load_bundle(directory)
    (module,) = bundle.modules
    executable = _xla.compile_module(module.source)
    hlo = executable.hlo_modules()[0].to_string()
    if not indices:
        assert "f64" not in hlo and hlo.count("transpose(") <= 2, hlo  # in and out of NHWC
    image = torch.randn(2, 3, 15, 15)
    (result,) = _xla.to_numpy(_xla.run(executable, _xla.put_all([image.numpy(), *read_weights(bundle)])))
    with torch.no_grad():
        assert_close(result, model(image).numpy())


def _exported_beside_torch(
    model: torch.nn.Module, shape: tuple[int, ...], directory: Path
) -> tuple[str, list[np.ndarray], tuple[torch.Tensor, ...]]:
    """`model` (eval, seeded) exported at batch `shape[0]`: XLA's optimized HLO of its module,
    and what the bundle and torch compute on a fresh input of `shape`."""
    bundle = load_bundle(
        export_torch_bundle(model, (torch.randn(*shape),), directory, batch_sizes=(shape[0],))
    )
    (module,) = bundle.modules
    executable = _xla.compile_module(module.source)
    image = torch.randn(*shape)
    results = _xla.to_numpy(_xla.run(executable, _xla.put_all([image.numpy(), *read_weights(bundle)])))
    with torch.no_grad():
        expected = model(image)
    return executable.hlo_modules()[0].to_string(), results, expected


class AveragePools(torch.nn.Module):
    """Average pools as DenseNet's transitions (2x2, stride 2), NF-ResNet's shortcuts (ceil mode,
    padding not counted) and padded, ceil-mode and divisor-overriding ones use them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.mix = torch.nn.Conv2d(8, 4, 3)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = torch.relu(self.conv(image))
        pool = torch.nn.functional.avg_pool2d
        pools = (
            pool(x, 2, stride=2),
            pool(x, 2, stride=2, ceil_mode=True, count_include_pad=False),
            pool(x, 3, stride=2, padding=1, ceil_mode=True),
            pool(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
            pool(x, (3, 2), stride=(1, 2), padding=(1, 0), divisor_override=4),
        )
        return tuple(self.mix(p).mean((2, 3)) for p in pools)


def test_torch_export_averages_channels_last(tmp_path: Path) -> None:
    """An average pool of an NHWC activation stays NHWC, divided by torch's count of each window
    (padding counted or not, ceil mode's clipped last windows); it used to run NCHW, a transpose
    each way (DenseNet's three transitions, NF-ResNet's shortcuts)."""
    torch.manual_seed(0)
    hlo, results, expected = _exported_beside_torch(AveragePools().eval(), (2, 3, 15, 15), tmp_path / "avg")
    # the input's (XLA copies it into the fusions that read it): 8 when the pools ran NCHW
    # (jaxlib 0.10.2)
    assert hlo.count("transpose(") <= 2, hlo
    assert [r.shape for r in results] == [tuple(e.shape) for e in expected]
    for result, reference in zip(results, expected, strict=True):
        assert_close(result, reference.numpy())


class Concatenations(torch.nn.Module):
    """torch.cat as SqueezeNet's fire modules (then a ceil-mode pool) and DenseNet's layers use
    it, beside one with the NCHW input image among its operands, one along a spatial axis, and
    one (two dtypes) that it leaves to torch's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.squeeze = torch.nn.Conv2d(3, 4, 1)
        self.expand1x1 = torch.nn.Conv2d(4, 6, 1)
        self.expand3x3 = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(15)
        self.dense = torch.nn.Conv2d(15, 5, 3, padding=1)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.relu(self.squeeze(image))
        fire = torch.cat([torch.relu(self.expand1x1(x)), torch.relu(self.expand3x3(x))], 1)
        pooled = torch.nn.functional.max_pool2d(fire, 3, stride=2, ceil_mode=True)
        features = torch.cat([image, fire], dim=1)  # 3 + 12 channels, DenseNet-style
        dense = torch.cat([features, self.dense(torch.relu(self.norm(features)))], 1)
        spatial = torch.cat([dense, dense[:, :, :2]], dim=-2)
        mixed = torch.cat([pooled, pooled.double()], 1).float()
        return spatial, mixed.sum((2, 3))


def test_torch_export_concatenates_channels_last(tmp_path: Path) -> None:
    """Concatenations of NHWC activations stay NHWC: each operand used to be transposed to NCHW
    and the result back, and the pool after SqueezeNet's fire modules ran NCHW in float64."""
    torch.manual_seed(0)
    model = Concatenations()
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.running_var.uniform_(0.5, 2)
    hlo, results, expected = _exported_beside_torch(model.eval(), (2, 3, 9, 9), tmp_path / "cat")
    # the input's (XLA copies it into each fusion that reads it), the slice's there and back, the
    # results' and the float64 cat's: 12, and the pool in float64, when every cat ran NCHW
    # (jaxlib 0.10.2)
    assert hlo.count("transpose(") <= 8, hlo
    assert "reduce-window(" in hlo and re.search(r"= f64\[[^\n]*reduce-window\(", hlo) is None, hlo
    assert [r.shape for r in results] == [(2, 20, 11, 9), (2, 24)]
    for result, reference in zip(results, expected, strict=True):
        assert_close(result, reference.numpy())


class ChannelShuffles(torch.nn.Module):
    """ShuffleNetV2's units: a chunk of the channels in two, one half through convolutions, the
    halves joined and shuffled (a view into two channel axes, a transpose, a copy and a view
    back), beside views it leaves to torch's layout (one over the spatial axes, a flatten)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.branch = torch.nn.Sequential(
            torch.nn.Conv2d(4, 4, 1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
        )
        self.head = torch.nn.Conv2d(8, 6, 1)

    @staticmethod
    def shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
        n, c, h, w = x.size()
        x = x.view(n, groups, -1, h, w)
        return torch.transpose(x, 1, 2).contiguous().view(n, c, h, w)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.stem(image)
        for _ in range(2):
            kept, through = x.chunk(2, dim=1)
            x = self.shuffle(torch.cat((kept, self.branch(through)), dim=1), 2)
        first, rest = torch.split(x, [3, 5], dim=1)
        x = self.head(torch.cat((rest, first), 1))
        return x, x.view(x.shape[0], 6, -1).softmax(-1), self.shuffle(x, 3).flatten(1)


def test_torch_export_shuffles_channels_channels_last(tmp_path: Path) -> None:
    """ShuffleNet's chunks and channel shuffles stay NHWC: a slice and a reshape of the array's
    channel axis; each used to transpose the activation to NCHW and back."""
    torch.manual_seed(0)
    hlo, results, expected = _exported_beside_torch(
        ChannelShuffles().eval(), (2, 3, 8, 8), tmp_path / "shuffle"
    )
    # the shuffles' own (of the array's two channel axes), the input's, the outputs' and the
    # spatial view's: 23 when every shuffle ran NCHW (jaxlib 0.10.2)
    assert hlo.count("transpose(") <= 13, hlo
    assert [r.shape for r in results] == [(2, 6, 8, 8), (2, 6, 64), (2, 384)]
    for result, reference in zip(results, expected, strict=True):
        assert_close(result, reference.numpy())


class Upsamplings(torch.nn.Module):
    """Bilinear upsampling as LR-ASPP's and DeepLabV3's heads use it (to a size, of NHWC
    activations, to the input's own size), beside scale factors (integer, fractional, one that
    shrinks), corners aligned, and an NCHW tensor's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = torch.relu(self.conv(image))
        resize = torch.nn.functional.interpolate
        return (
            resize(x, size=image.shape[-2:], mode="bilinear", align_corners=False),
            resize(x, size=(7, 13), mode="bilinear", align_corners=True),
            resize(x, size=x.shape[-2:], mode="bilinear", align_corners=False),
            resize(x, scale_factor=2, mode="bilinear") * 2,
            resize(x, scale_factor=(1.7, 0.6), mode="bilinear", align_corners=False),
            resize(image, scale_factor=(0.5, 3), mode="bilinear", align_corners=True),
        )


def test_torch_export_upsamples_channels_last(tmp_path: Path) -> None:
    """Bilinear upsampling is kept whole and runs on NHWC arrays, one pass per axis, as torch
    computes it: its decomposition gathered each output pixel's four corners in torch's layout.
    LR-ASPP and DeepLabV3 ran 1.2x-1.5x faster for it."""
    torch.manual_seed(0)
    hlo, results, expected = _exported_beside_torch(Upsamplings().eval(), (2, 3, 11, 10), tmp_path / "up")
    assert [r.shape for r in results] == [tuple(e.shape) for e in expected]
    assert [r.shape for r in results][:2] == [(2, 5, 11, 10), (2, 5, 7, 13)]
    for result, reference in zip(results, expected, strict=True):
        assert_close(result, reference.numpy())
    # each pass gathers whole rows of one axis (indices s32[rows,1]); torch's decomposition
    # gathered every output pixel's corners by (row, column) pairs, s32[h,w,2] (jaxlib 0.10.2)
    assert "gather(" in hlo and re.search(r"s32\[\d+,\d+,2\]", hlo) is None, hlo


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.uint8])
def test_bilinear_upsampling_computes_in_torch_s_precision(dtype: torch.dtype) -> None:
    """Half precisions are interpolated in float32 and rounded back, float64 with float64
    weights, integers rounded to the nearest (torch's integer kernel may round one the other way)."""
    from hloserve.export import _channels_last

    torch.manual_seed(0)
    image = (torch.rand(2, 3, 9, 7) * 200).to(dtype)
    array = _xla.jnp.asarray(image.float().numpy()).astype(str(dtype).removeprefix("torch."))
    for size, corners in (((20, 5), False), ((4, 15), True)):
        expected = torch.nn.functional.interpolate(image, size=size, mode="bilinear", align_corners=corners)
        result = _channels_last.upsample_bilinear(array, size, corners, (None, None))
        assert result.dtype == array.dtype
        if dtype == torch.uint8:
            assert np.abs(np.asarray(result, np.int64) - expected.numpy().astype(np.int64)).max() <= 1
        else:  # 16 rounding steps of the largest value, 200
            atol = 16 * torch.finfo(dtype).eps * 200
            np.testing.assert_allclose(np.asarray(result, np.float64), expected.double().numpy(), atol=atol)


@pytest.mark.parametrize(("per_group", "fused"), [(4, True), (8, True), (16, False)])
def test_grouped_convolutions_fuse_only_few_inputs_per_group(per_group: int, fused: bool) -> None:
    """A 3x3 grouped convolution with up to 8 inputs per group runs as one element-wise fusion;
    with 16 (ResNeXt-50's third stage) it took 17x XLA's convolution: XLA's."""
    from hloserve.export import _channels_last

    groups = 4
    x = np.zeros((1, 6, 6, groups * per_group), np.float32)
    weight = np.zeros((groups * per_group, per_group, 3, 3), np.float32)
    lowered = _xla.jax.jit(
        lambda x, w: (
            _channels_last.convolution(_channels_last.ChannelsLast(x), w, None, [1], [1], [1], groups).array
        )
    ).lower(x, weight)
    assert ("convolution" not in lowered.as_text()) == fused


@pytest.mark.parametrize(
    ("in_channels", "kernel", "fused"),
    [(3, 3, False), (16, 1, True), (27, 1, True), (28, 1, False), (3, 7, False), (16, 3, False)],
    ids=["rgb-stem-3x3", "1x1-from-16", "1x1-from-27", "1x1-from-28", "rgb-stem-7x7", "3x3-from-16"],
)
def test_1x1_convolutions_from_few_channels_run_as_one_loop(
    in_channels: int, kernel: int, fused: bool
) -> None:
    """A 1x1 convolution from at most 27 channels is a loop XLA fuses with what is around it; one
    from more, and any with taps (an RGB stem's 3x3 included: YNNPACK would take its loop into
    the next convolution's fusion), is XLA's dot or convolution. Both give XLA's numbers."""
    from hloserve.export import _channels_last

    rng = np.random.default_rng(in_channels * kernel)
    x = rng.standard_normal((2, 9, 9, in_channels), np.float32)
    weight = rng.standard_normal((5, in_channels, kernel, kernel), np.float32)
    stride, padding = [2 if kernel > 1 else 1], [kernel // 2]

    def lowered(x: Any, w: Any) -> Any:
        return _channels_last.convolution(
            _channels_last.ChannelsLast(x), w, None, stride, padding, [1], 1
        ).array

    text = _xla.jax.jit(lowered).lower(x, weight).as_text()
    assert ("convolution" not in text and "dot_general" not in text) == fused, text[-2000:]
    expected = _xla.jax.lax.conv_general_dilated(
        x,
        np.transpose(weight, (2, 3, 1, 0)),
        stride * 2,
        [(padding[0], padding[0])] * 2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=_xla.jax.lax.Precision.HIGHEST,
    )
    got = _xla.jax.jit(lowered)(x, weight)
    terms = in_channels * kernel * kernel
    scale = float(np.max(np.abs(np.asarray(expected))))
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(expected), rtol=0, atol=4 * terms * np.finfo(np.float32).eps * scale
    )


class Atrous(torch.nn.Module):
    """DeepLabV3's atrous pyramid on a map smaller than its rates: rate 9 over 6x6 reads padding
    alone outside its centre tap; rate 4 reads the input for 31% of a full convolution's work;
    rate 2 with every tap, mostly; a depthwise one of rate 9 and a strided one of rate 4 (whose
    first and last taps miss the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.far = torch.nn.Conv2d(4, 5, 3, padding=9, dilation=9)
        self.near = torch.nn.Conv2d(4, 5, 3, padding=2, dilation=2)
        self.mid = torch.nn.Conv2d(4, 5, 3, padding=4, dilation=4)
        self.depthwise = torch.nn.Conv2d(4, 4, 3, padding=9, dilation=9, groups=4)
        self.strided = torch.nn.Conv2d(4, 5, 3, stride=2, padding=4, dilation=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.far(x) + self.near(x) + self.mid(x) + self.depthwise(x).sum(1, keepdim=True)
        return y + torch.nn.functional.interpolate(self.strided(x), size=(6, 6))


def test_torch_export_drops_atrous_taps_that_read_padding_only(tmp_path: Path) -> None:
    """YNNPACK computed DeepLabV3's rate-36 convolution over its 14x14 map in full: 1 s of 2.2 at
    batch 4, for a centre tap's 1x1 convolution; every other tap multiplies padding."""
    torch.manual_seed(0)
    model = Atrous().eval()
    directory = export_torch_bundle(model, (torch.randn(2, 4, 6, 6),), tmp_path / "atrous", batch_sizes=(2,))
    bundle = load_bundle(directory)
    (module,) = bundle.modules
    executable = _xla.compile_module(module.source)
    # `near` and `strided` convolve; `far` is one dot, `mid` a dot per tap over what it reads,
    # `depthwise` one product per channel
    assert executable.hlo_modules()[0].to_string().count("convolution(") <= 2
    image = torch.randn(2, 4, 6, 6)
    (result,) = _xla.to_numpy(_xla.run(executable, _xla.put_all([image.numpy(), *read_weights(bundle)])))
    with torch.no_grad():
        assert_close(result, model(image).numpy())


class OnePerSize(torch.nn.Module):
    """An ONNX import's shape of module: one model per batch size, each reading its own weights."""

    def __init__(self) -> None:
        super().__init__()
        self.one = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        self.two = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.one(image) if image.shape[0] == 1 else self.two(image)


def test_torch_export_prepares_no_weights_when_batch_sizes_read_different_ones(tmp_path: Path) -> None:
    """Weights folded for one batch size's program would be wrong for the other's: all stay as
    torch has them (the ONNX-imported DeiT-Ti of tests/zoo failed to export otherwise)."""
    torch.manual_seed(0)
    directory = export_torch_bundle(
        OnePerSize(), (torch.randn(2, 3, 6, 6),), tmp_path / "two", batch_sizes=(1, 2)
    )
    shapes = {w.name: w.shape for w in load_bundle(directory).weights}
    assert shapes["one.0.weight"] == shapes["two.0.weight"] == (4, 3, 3, 3)
    assert "one.1.running_mean" in shapes and "two.1.running_var" in shapes
    provenance = yaml.safe_load((directory / "manifest.yaml").read_text())["provenance"]
    assert "folded_batch_norms" not in provenance and "weights_stored_transposed" not in provenance


class SharedPerSize(torch.nn.Module):
    """An ONNX import's module as `hloserve import` builds it: one model per batch size, the
    weights equal across sizes shared (the same tensors), and a constant of each size's own."""

    def __init__(self) -> None:
        super().__init__()
        self.one = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 5, 1))
        self.two = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 5, 1))
        for k in (0, 2):
            self.two[k].weight, self.two[k].bias = self.one[k].weight, self.one[k].bias
        self.register_buffer("shift_one", torch.tensor([0.5]))
        self.register_buffer("shift_two", torch.tensor([0.5]))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if image.shape[0] == 1:
            return self.one(image) + self.shift_one
        return self.two(image) + self.shift_two


def test_torch_export_stores_weights_transposed_that_every_batch_size_shares(tmp_path: Path) -> None:
    """Each size's program reads its own constant, so their weights differed and none were
    prepared: every convolution weight of an imported model was transposed in every execution
    (an imported ResNet-18 took 119 ms at batch 1 where its export took 43). Each size now stores
    what any size reads, and the shared weights are stored as the convolutions read them."""
    torch.manual_seed(0)
    model = SharedPerSize().eval()
    example = (torch.randn(2, 3, 6, 6),)
    directory = export_torch_bundle(model, example, tmp_path / "shared", batch_sizes=(1, 2))
    provenance = yaml.safe_load((directory / "manifest.yaml").read_text())["provenance"]
    assert provenance["weights_stored_transposed"] == ["one.0.weight", "one.2.weight"]
    bundle = load_bundle(directory)
    shapes = {w.name: w.shape for w in bundle.weights}
    assert shapes["one.0.weight"] == (3, 3, 3, 4) and "two.0.weight" not in shapes  # one copy, HWIO
    assert "shift_one" in shapes and "shift_two" in shapes
    for rows in (1, 2):
        executable = _xla.compile_module(bundle.module_for(rows).source)
        assert not _entry_transposes_of_weights(executable.hlo_modules()[0].to_string(), 1)
        image = torch.randn(rows, 3, 6, 6)
        (result,) = _xla.to_numpy(_xla.run(executable, _xla.put_all([image.numpy(), *read_weights(bundle)])))
        with torch.no_grad():
            assert_close(result, model(image).numpy())


def test_weight_transposes_are_found_in_unprepared_weights() -> None:
    """The check above finds the transposes when they are there: an OIHW weight as a parameter."""
    source = """
func.func public @main(%x: tensor<1x3x8x8xf32>, %w: tensor<4x3x3x3xf32>) -> tensor<1x4x6x6xf32> {
  %y = stablehlo.convolution(%x, %w) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1],
    window = {} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
    : (tensor<1x3x8x8xf32>, tensor<4x3x3x3xf32>) -> tensor<1x4x6x6xf32>
  return %y : tensor<1x4x6x6xf32>
}
"""
    executable = _xla.compile_module(source)
    assert len(_entry_transposes_of_weights(executable.hlo_modules()[0].to_string(), 1)) == 1


class SignDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_torch_export_refuses_a_branch_on_input_values(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"^torch.export cannot trace SignDependent at batch size 1: GuardOnDataDependentSymNode: "
        r"Could not guard on data-dependent expression",
    ):
        export_torch_bundle(SignDependent(), (torch.ones(2, 3),), tmp_path / "branchy")
    assert not (tmp_path / "branchy").exists()


def test_torch_export_refuses_inputs_unlike_the_examples(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^input 0 \('X'\) is float32\[4\] but its example is float32\[3\]"):
        export_torch_bundle(
            SignDependent(), (torch.ones(2, 3),), tmp_path / "x", inputs=[InputSpec("X", (4,))]
        )


def test_cli_refuses_a_torch_spec_with_an_option_neither_exporter_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.py").write_text(
        "import torch\n\n"
        "def make():\n"
        "    return {'module': torch.nn.Linear(3, 2), 'example_inputs': (torch.ones(1, 3),), 'rtool': 1e-3}\n"
    )
    assert main(["export", f"{tmp_path / 'spec.py'}:make", "--out", str(tmp_path / "linear")]) == 2
    assert capsys.readouterr().err == (
        f"hloserve export: {tmp_path / 'spec.py'}:make returned arguments export_torch_bundle cannot take: "
        "unexpected keyword argument(s) ['rtool']\n"
    )


class Gram(torch.nn.Module):
    """A function of one whole matrix (no rows to batch): its Gram matrix, scaled by a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.T @ x) * self.scale


def test_torch_export_without_a_batch_axis_serves_what_torch_computes(tmp_path: Path) -> None:
    """batch_axis=False: the examples are whole inputs; one model.mlir, verified, served with
    max_batch_size 0."""
    model = Gram()
    x = torch.randn(4, 3)
    export_torch_bundle(model, (x,), tmp_path / "gram", inputs=[InputSpec("X", (4, 3))], batch_axis=False)
    assert [m.batch_size for m in load_bundle(tmp_path / "gram").modules] == [0]
    with start_worker(make_config(tmp_path)) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert client.get_model_config("gram").config.max_batch_size == 0
        other = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
        tensor = grpcclient.InferInput("X", [4, 3], "FP32")
        tensor.set_data_from_numpy(other)
        with torch.no_grad():
            expected = model(torch.from_numpy(other)).numpy()
        assert_close(client.infer("gram", [tensor]).as_numpy("output_0"), expected)
        client.close()


class Shifted(torch.nn.Module):
    """A buffer, then a constant made in forward (lifted by torch.export), in each of two blocks:
    torch 2.13 interleaves the two kinds in the program's arguments (Swin-T's case)."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.register_buffer("index", torch.tensor([2, 0, 1]))
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.index] + torch.tensor([self.offset, 0.0, -self.offset])


def test_torch_export_binds_buffers_and_lifted_constants_in_the_programs_order(tmp_path: Path) -> None:
    model = torch.nn.Sequential(Shifted(1.0), Shifted(10.0))
    directory = export_torch_bundle(model, (torch.randn(2, 3),), tmp_path / "shifted", batch_sizes=(2,))
    names = [w.name for w in load_bundle(directory).weights]
    assert names == ["0.index", "0.lifted_tensor_0", "1.index", "1.lifted_tensor_1"]


class Tied(torch.nn.Module):
    """One weight under two names: an encoder and a decoder sharing a matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(3, 3, bias=False)
        self.decode = torch.nn.Linear(3, 3, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x).tanh())


def test_torch_export_keeps_a_tied_weight_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    example = torch.randn(2, 3)
    directory = export_torch_bundle(model, (example,), tmp_path / "tied", batch_sizes=(1, 2))
    bundle = load_bundle(directory)
    assert [w.name for w in bundle.weights] == ["encode.weight"]
    assert bundle.weight_nbytes == 3 * 3 * 4


class TwoHeads(torch.nn.Module):
    """A segmentation model's shape of result: a dict of tensors, keys out of alphabetical order."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.body(x)
        return {"out": features.relu(), "aux": features.sum(dim=1, keepdim=True)}


def test_torch_export_names_a_dict_result_by_its_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    directory = export_torch_bundle(model, (torch.randn(2, 3),), tmp_path / "heads", batch_sizes=(1, 2))
    manifest = yaml.safe_load((directory / "manifest.yaml").read_text())
    assert [o["name"] for o in manifest["executable_outputs"]] == ["out", "aux"]
    named = export_torch_bundle(
        model, (torch.randn(2, 3),), tmp_path / "named", outputs=[OutputSpec("A"), OutputSpec("B")]
    )
    manifest = yaml.safe_load((named / "manifest.yaml").read_text())
    assert [o["name"] for o in manifest["executable_outputs"]] == ["A", "B"]


def test_torch_linear_on_a_transposed_input_keeps_its_weight_2d(tmp_path: Path) -> None:
    """nn.MultiheadAttention (batch_first) projects a transposed input: torch's decomposition
    would broadcast the in-projection weight across the tokens (ViT-B/16's 1.39 GB per layer)."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    class SelfAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = attention

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    directory = export_torch_bundle(
        SelfAttention(), (torch.randn(3, 5, 8),), tmp_path / "mha", batch_sizes=(3,)
    )
    (module,) = load_bundle(directory).modules
    assert isinstance(module.source, str)
    assert "x8x24x" not in module.source and "x24x8x" not in module.source  # no per-token weight


@torch.library.custom_op("hloserve_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _twice_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return twice(x) + 1


def test_torch_export_names_an_operation_without_lowering_and_its_source_line(tmp_path: Path) -> None:
    with pytest.raises(LoweringError) as refused:
        export_torch_bundle(Twice(), (torch.ones(2, 3),), tmp_path / "twice")
    assert str(refused.value).startswith(
        "cannot lower hloserve_test.twice.default (graph node twice) called at "
        f"{__file__}:{Twice.forward.__code__.co_firstlineno + 1} in forward (`return twice(x) + 1`): "
        "torchax has no JAX lowering for it. Rewrite that line with other torch operations, or pass "
        "export_torch_bundle lowerings={torch.ops.hloserve_test.twice.default: fn}"
    )
    assert not (tmp_path / "twice").exists()
    export_torch_bundle(
        Twice(),
        (torch.ones(2, 3),),
        tmp_path / "twice",
        lowerings={torch.ops.hloserve_test.twice.default: lambda x: x * 2},
    )
