"""The path 0.1.0 documented for the PyTorch exporter, kept for the spec files and scripts that
import it: the code is `hloserve.export.torch`'s (docs/api.md)."""

from hloserve.export.torch import LoweringError as LoweringError
from hloserve.export.torch import export_torch_bundle as export_torch_bundle
from hloserve.export.torch import prepare_torchvision_import as prepare_torchvision_import

__all__ = ["LoweringError", "export_torch_bundle", "prepare_torchvision_import"]
