"""hloserve.models: bundles, manifests, programs, executables and model.py hooks."""
