"""The model format and its compilation: bundles, manifests, `model.py`, compiled
executables and their cache, shared host weights, load files and overrides, and every call
into JAX (`_xla`)."""
