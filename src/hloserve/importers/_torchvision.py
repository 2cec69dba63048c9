"""Import torchvision (which onnx2torch imports) beside a CPU-only torch.

torchvision's wheel on the package index links CUDA; beside the CPU build of torch its C
extension does not load, and `import torchvision` then fails registering fake kernels for two
operators the extension would have defined (`torchvision::nms`, `torchvision::qnms`). Where the
extension does not load, those two schemas are defined here first, so that the Python half (the
model definitions and the ops onnx2torch names) imports; calling them raises, as it would have.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

__all__ = ["import_torchvision"]

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None  # kept alive: dropping it removes the definitions


@functools.cache
def import_torchvision() -> Any:
    """`import torchvision`, defining the operators its C extension would have if it cannot load."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    extension = next(Path(spec.origin).parent.glob("_C*.so"), None)
    try:
        if extension is None:
            raise OSError("torchvision has no C extension")
        torch.ops.load_library(str(extension))
    except OSError:
        if not hasattr(torch.ops.torchvision, "nms"):
            _library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                _library.define(schema)
    import torchvision

    return torchvision
