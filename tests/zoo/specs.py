"""The zoo's models as `hloserve export` specs: real architectures from torchvision and timm,
built with random weights (fixed seed, no downloads), each a function returning the torch
exporter's arguments, run as `hloserve export tests/zoo/specs.py:resnet50 --out DIR`.

`hloserve export` makes torchvision importable beside a CPU torch before it loads a spec;
a process importing this file itself calls `prepare_torchvision_import` first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import timm
import torch
import torchvision

from hloserve.export import InputSpec, OutputSpec

IMAGE = InputSpec("IMAGE", (3, 224, 224), np.float32, letters="chw", format="NCHW")
LOGITS = OutputSpec("LOGITS", letters="k")


def images(rows: int, seed: int = 0) -> torch.Tensor:
    """Seeded, ImageNet-normalised-looking images (N, 3, 224, 224)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 224, 224, generator=generator)


def build(name: str) -> torch.nn.Module:
    """The zoo model `name`, random weights from a fixed seed, in eval mode."""
    torch.manual_seed(0)
    if name.startswith("timm_"):
        model = timm.create_model(name.removeprefix("timm_"), pretrained=False)
    else:
        model = getattr(torchvision.models, name)(weights=None)
    with torch.no_grad():  # ViT starts its head and class token at zero: all its logits would be 0
        for parameter in model.parameters():
            if parameter.ndim >= 2 and not parameter.any():
                parameter.normal_(std=0.02)
    return model.eval()


def _classifier(name: str) -> dict[str, Any]:
    return {
        "module": build(name),
        "example_inputs": (images(2),),
        "inputs": [IMAGE],
        "outputs": [LOGITS],
        "description": f"{name}, random weights (the hloserve zoo)",
    }


def resnet50() -> dict[str, Any]:
    return _classifier("resnet50")


def mobilenet_v3_large() -> dict[str, Any]:
    return _classifier("mobilenet_v3_large")


def efficientnet_b0() -> dict[str, Any]:
    return _classifier("efficientnet_b0")


def convnext_tiny() -> dict[str, Any]:
    return _classifier("convnext_tiny")


def vit_b_16() -> dict[str, Any]:
    return _classifier("vit_b_16")


def swin_t() -> dict[str, Any]:
    return _classifier("swin_t")


def densenet121() -> dict[str, Any]:
    return _classifier("densenet121")


def regnet_y_400mf() -> dict[str, Any]:
    return _classifier("regnet_y_400mf")


def timm_deit_tiny_patch16_224() -> dict[str, Any]:
    return _classifier("timm_deit_tiny_patch16_224")
