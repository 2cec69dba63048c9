"""The zoo's models as `hloserve export` specs: real architectures from torchvision and timm,
built with random weights (fixed seed, no downloads), each a function returning the torch
exporter's arguments, run as `hloserve export tests/zoo/specs.py:resnet50 --out DIR`.

`hloserve export` makes torchvision importable beside a CPU torch before it loads a spec;
a process importing this file itself calls `prepare_torchvision_import` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
import torchvision
from torchvision.models.detection.image_list import ImageList

from hloserve.export.jax import InputSpec, OutputSpec

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


# --- the families issue 35 added: each an operator pattern the ones above do not cover -----------


def resnet18() -> dict[str, Any]:
    """Plain 3x3 residual blocks, no bottleneck."""
    return _classifier("resnet18")


def resnext50_32x4d() -> dict[str, Any]:
    """Grouped 3x3 convolutions of 32 groups of 4+ channels."""
    return _classifier("resnext50_32x4d")


def mobilenet_v2() -> dict[str, Any]:
    """Depthwise-separable inverted residuals without squeeze-excitation, ReLU6."""
    return _classifier("mobilenet_v2")


def shufflenet_v2_x1_0() -> dict[str, Any]:
    """Channel split, concatenation and shuffle (reshape-transpose) between depthwise blocks."""
    return _classifier("shufflenet_v2_x1_0")


def squeezenet1_1() -> dict[str, Any]:
    """Fire modules: 1x1 squeeze, then 1x1 and 3x3 expansions concatenated; max pooling."""
    return _classifier("squeezenet1_1")


def maxvit_t() -> dict[str, Any]:
    """Block and grid attention over MBConv stages (an attention variant)."""
    return _classifier("maxvit_t")


def timm_mixer_s16_224() -> dict[str, Any]:
    """An MLP-Mixer: token- and channel-mixing MLPs, no attention, no convolution but the stem."""
    return _classifier("timm_mixer_s16_224")


def timm_nf_resnet26() -> dict[str, Any]:
    """Normalization-free: convolutions whose weights are standardized in the forward pass."""
    return _classifier("timm_nf_resnet26")


# --- beyond classifiers: a dict result, a model.py's postprocess, a text encoder ----------------

SEGMENTER = "lraspp_mobilenet_v3_large"
ATROUS = "deeplabv3_mobilenet_v3_large"
DETECTOR = "ssdlite320_mobilenet_v3_large"
ENCODER = "bert_base"
DETECTOR_MODEL_PY = Path(__file__).resolve().parent / "ssdlite" / "model.py"
DETECTOR_SIZE = 320
TOKENS = 128  # BERT-base's dims (12 layers, 768 wide, 12 heads, 30522 words), 128 tokens


def lraspp_mobilenet_v3_large() -> dict[str, Any]:
    """A segmenter whose forward returns a dict ({"out": (N, 21, H, W)}): its key names the output."""
    return {
        "module": build_segmenter(),
        "example_inputs": (images(2),),
        "inputs": [IMAGE],
        "description": f"{SEGMENTER}, random weights (the hloserve zoo)",
    }


def build_segmenter(name: str = SEGMENTER) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {"aux_loss": False} if name == ATROUS else {}  # an auxiliary head would be a second output
    model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, **options)
    return model.eval()


def deeplabv3_mobilenet_v3_large() -> dict[str, Any]:
    """Atrous (dilated) convolutions: a dilated MobileNetV3 backbone and an ASPP head (rates 12, 24,
    36); a dict result."""
    return {
        "module": build_segmenter(ATROUS),
        "example_inputs": (images(2),),
        "inputs": [IMAGE],
        "description": f"{ATROUS}, random weights (the hloserve zoo)",
    }


class DecodedSSD(torch.nn.Module):
    """SSDLite's static part: backbone, head, and the decoding of its regressions against its
    fixed anchors (one image size), clipped to the image, with softmax scores; a dict result.
    What torchvision's SSD does next (threshold, top-k, NMS) is data-dependent: model.py's."""

    def __init__(self, ssd: torch.nn.Module) -> None:
        super().__init__()
        self.backbone, self.head, self.box_coder = ssd.backbone, ssd.head, ssd.box_coder
        size = (DETECTOR_SIZE, DETECTOR_SIZE)
        batch = ImageList(torch.zeros(1, 3, *size), [size])
        with torch.no_grad():
            features = list(self.backbone(batch.tensors).values())
            anchors = ssd.anchor_generator(batch, features)[0]
        self.register_buffer("anchors", anchors)

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        head = self.head(list(self.backbone(image).values()))
        regression, logits = head["bbox_regression"], head["cls_logits"]
        rows, count = regression.shape[:2]
        anchors = self.anchors.expand(rows, count, 4).reshape(-1, 4)
        boxes = self.box_coder.decode_single(regression.reshape(-1, 4), anchors).reshape(rows, count, 4)
        return {"boxes": boxes.clamp(0, DETECTOR_SIZE), "scores": torch.softmax(logits, dim=-1)}


def build_detector() -> torch.nn.Module:
    torch.manual_seed(0)
    ssd = torchvision.models.detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None)
    with torch.no_grad():  # as initialised, its features die in the backbone (all scores 1/91):
        for module in ssd.modules():  # batch norm's statistics from a few random images instead
            if isinstance(module, torch.nn.BatchNorm2d):
                module.reset_running_stats()
                module.momentum = None  # a plain average over the batches
        ssd.train()
        for seed in range(100, 104):
            ssd.backbone(detector_images(4, seed=seed))
            ssd.head(list(ssd.backbone(detector_images(4, seed=seed)).values()))
    return DecodedSSD(ssd.eval()).eval()


def detector_images(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, DETECTOR_SIZE, DETECTOR_SIZE, generator=generator)


def ssdlite320_mobilenet_v3_large() -> dict[str, Any]:
    """The seeds' pattern: the static part compiled, threshold and NMS in the bundle's model.py."""
    return {
        "module": build_detector(),
        "example_inputs": (detector_images(2),),
        "inputs": [
            InputSpec("IMAGE", (3, DETECTOR_SIZE, DETECTOR_SIZE), np.float32, letters="chw", format="NCHW")
        ],
        "model_py": DETECTOR_MODEL_PY,
        "client_outputs": [
            InputSpec("detection_boxes", (100, 4), np.float32, letters="dx"),
            InputSpec("detection_scores", (100,), np.float32, letters="d"),
            InputSpec("detection_labels", (100,), np.int64, letters="d"),
        ],
        "description": f"{DETECTOR}, random weights, detections by model.py (the hloserve zoo)",
    }


class Encoder(torch.nn.Module):
    """transformers' BertModel with a dict result of plain tensors (not a ModelOutput)."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, pooled = self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[:2]
        return {"last_hidden_state": hidden, "pooler_output": pooled}


def build_encoder() -> torch.nn.Module:
    """BERT-base from its configuration (BertConfig's defaults), random weights."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(attn_implementation="eager")
    return Encoder(transformers.BertModel(config, add_pooling_layer=True)).eval()


def tokens(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded token ids and an attention mask whose rows end in padding of varying length."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30522, (rows, TOKENS), generator=generator)
    lengths = torch.randint(TOKENS // 4, TOKENS + 1, (rows,), generator=generator)
    mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def bert_base() -> dict[str, Any]:
    return {
        "module": build_encoder(),
        "example_inputs": tokens(2),
        "inputs": [
            InputSpec("input_ids", (TOKENS,), np.int64, letters="t"),
            InputSpec("attention_mask", (TOKENS,), np.int64, letters="t"),
        ],
        "description": "BERT-base's shape from transformers' BertConfig, random weights (the hloserve zoo)",
    }
