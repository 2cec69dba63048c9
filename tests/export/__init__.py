"""hloserve.export: the JAX, Flax and PyTorch exporters and their verification."""
