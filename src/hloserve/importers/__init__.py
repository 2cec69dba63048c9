"""Models brought in from other servers' formats, as bundles.

- `hloserve.importers.triton_config`: a Triton `config.pbtxt` read with protobuf's text format and
  turned into an import plan (tensors, batch sizes, scheduling settings, labels, ignored fields);
- `hloserve.importers.onnx_model`: one ONNX file to a bundle (onnx2torch, then the torch.export
  exporter), verified against ONNX Runtime;
- `hloserve.importers.triton_repository`: a whole Triton model repository, model by model, with a
  report of what converted and what did not.

The ONNX tools are the `onnx` extra (`pip install hloserve[onnx]`); nothing here imports them
until a model is converted.
"""

from hloserve.importers.onnx_model import ImportedBundle as ImportedBundle
from hloserve.importers.onnx_model import import_onnx as import_onnx
from hloserve.importers.onnx_model import import_onnx_file as import_onnx_file
from hloserve.importers.triton_config import NotConvertible as NotConvertible
from hloserve.importers.triton_config import TritonConfigError as TritonConfigError
from hloserve.importers.triton_repository import ImportReport as ImportReport
from hloserve.importers.triton_repository import import_triton_repository as import_triton_repository

__all__ = [
    "ImportReport",
    "ImportedBundle",
    "NotConvertible",
    "TritonConfigError",
    "import_onnx",
    "import_onnx_file",
    "import_triton_repository",
]
