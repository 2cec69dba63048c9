"""The path the docs gave for the exporter's tolerances before the move into packages, kept for
the scripts that import it: the code is `hloserve.export.verification`'s (docs/api.md)."""

from hloserve.export.verification import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES
from hloserve.export.verification import Tolerance as Tolerance
from hloserve.export.verification import VerificationError as VerificationError
from hloserve.export.verification import default_tolerance as default_tolerance
from hloserve.export.verification import precision_tolerance as precision_tolerance
from hloserve.export.verification import verify_bundle as verify_bundle

__all__ = [
    "DEFAULT_TOLERANCES",
    "Tolerance",
    "VerificationError",
    "default_tolerance",
    "precision_tolerance",
    "verify_bundle",
]
