"""The GPU suite's real models as `hloserve export` specs (`benches/gpu_models.py:resnet50`):
ResNet-50 and ViT-B/16 from torchvision, random weights from a fixed seed (no downloads), as
the zoo builds them, and `small_cnn`, a stand-in that a CPU dry run exports in seconds.

Not tests/zoo/specs.py: that file also imports timm, which the GPU image lacks (torchvision and
torchax travel as wheels, benches/gpu-wheels.txt), and the zoo's export cache is keyed by it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hloserve.export.jax import InputSpec, OutputSpec

LOGITS = OutputSpec("LOGITS", letters="k")


def _classifier(module: torch.nn.Module, size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        "module": module.eval(),
        "example_inputs": (torch.randn(2, 3, size, size, generator=generator),),
        "inputs": [InputSpec("IMAGE", (3, size, size), np.float32, letters="chw", format="NCHW")],
        "outputs": [LOGITS],
    }


def _torchvision(name: str) -> torch.nn.Module:
    import torchvision  # here, not at the top: the dry run's small_cnn needs no torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    with torch.no_grad():  # ViT starts its head and class token at zero: all its logits would be 0
        for parameter in model.parameters():
            if parameter.ndim >= 2 and not parameter.any():
                parameter.normal_(std=0.02)
    return model


def resnet50() -> dict[str, Any]:
    return _classifier(_torchvision("resnet50"), 224)


def vit_b_16() -> dict[str, Any]:
    return _classifier(_torchvision("vit_b_16"), 224)


def small_cnn() -> dict[str, Any]:
    """Two convolutions, batch norm and a linear head on 32x32 images: the dry run's stand-in."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )
    return _classifier(module, 32)
