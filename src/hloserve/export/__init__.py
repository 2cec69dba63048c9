"""Producing bundles: the JAX exporter, the PyTorch one and the verification of a bundle
in a fresh process.

The spec types and the JAX exporter are importable from here, where 0.1.0 documented them
(`from hloserve.export import InputSpec, OutputSpec, export_bundle`), and the tolerances of
verification too; the PyTorch exporter stays in `hloserve.export.torch`, so that exporting
from JAX never imports torch. docs/api.md lists the public names.
"""

from hloserve.export.jax import PRECISIONS as PRECISIONS
from hloserve.export.jax import InputSpec as InputSpec
from hloserve.export.jax import OutputSpec as OutputSpec
from hloserve.export.jax import Precision as Precision
from hloserve.export.jax import export_bundle as export_bundle
from hloserve.export.verification import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES
from hloserve.export.verification import Tolerance as Tolerance
from hloserve.export.verification import VerificationError as VerificationError
from hloserve.export.verification import default_tolerance as default_tolerance
from hloserve.export.verification import precision_tolerance as precision_tolerance
from hloserve.export.verification import verify_bundle as verify_bundle

__all__ = [
    "DEFAULT_TOLERANCES",
    "PRECISIONS",
    "InputSpec",
    "OutputSpec",
    "Precision",
    "Tolerance",
    "VerificationError",
    "default_tolerance",
    "export_bundle",
    "precision_tolerance",
    "verify_bundle",
]
