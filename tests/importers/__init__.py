"""hloserve.importers: Triton repositories and ONNX models imported as bundles."""
