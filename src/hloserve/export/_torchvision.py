"""Let torchvision's pure-Python models import when its C++ ops cannot load.

torchvision's Linux wheels on the package index link CUDA libraries, so beside the CPU build of
torch its `_C` extension does not load; torchvision then still imports its models, but its
`_meta_registrations` registers fake kernels for `torchvision::nms` and `torchvision::qnms`,
which fails ("operator torchvision::nms does not exist") and takes `import torchvision` (and
timm, which imports it) down with it. Defining the two schemas first lets the import finish;
the models need no C++ op, and calling nms then says the op has no kernel.

This is the one place that knows; the exporter's SPEC loading and the zoo tests call it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["prepare_torchvision_import"]

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the torch.library.Library holding the schemas: dropping it undefines them


def prepare_torchvision_import() -> bool:
    """Make `import torchvision` work beside a CPU torch; returns whether schemas were defined.

    Does nothing when torchvision is not installed, is already imported, or its C++ extension
    loads (then the real ops are there). Call it before the first `import torchvision` or
    `import timm`; calling it again is harmless.
    """
    global _library
    if _library is not None or "torchvision" in sys.modules:
        return False
    try:
        found = importlib.util.find_spec("torchvision")
    except ImportError:  # torch itself missing, or a finder refusing it: nothing to prepare
        return False
    if found is None or not found.submodule_search_locations:
        return False
    import torch

    extension = next(Path(found.submodule_search_locations[0]).glob("_C.*"), None)
    if extension is not None:
        try:
            torch.ops.load_library(str(extension))
            return False
        except (ImportError, OSError):
            pass  # links libraries this machine lacks (CUDA's): define the schemas instead
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        _library.define(schema)
    return True
