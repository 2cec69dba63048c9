"""Producing bundles: the JAX exporter, the PyTorch one and the verification of a bundle
in a fresh process."""
