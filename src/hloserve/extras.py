"""The optional extras (pyproject's `[project.optional-dependencies]`) that a setting or a command
needs, checked before anything starts: a missing one is a `ConfigError` naming the setting and
the `pip install` that fixes it, not a traceback after every model has loaded.

Only the modules are looked up (`importlib.util.find_spec`), not imported: torch takes seconds to
import, and the code that needs it imports it anyway.
"""

from __future__ import annotations

import importlib.util

from hloserve.errors import ConfigError

__all__ = ["EXTRAS", "require_extra"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "otel": ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
    "torch": ("torch", "torchax"),
    "onnx": ("onnx", "onnxruntime", "onnx2torch", "torch", "torchax"),
    "node": ("envoy",),
}
"""Each extra and the modules whose absence means it is not installed."""


def _missing(module: str) -> str | None:
    """Why `module` cannot be imported, or None when it can be found."""
    try:
        found = importlib.util.find_spec(module)
    except ImportError as e:  # a parent package is missing, or a finder refuses it
        return str(e)
    except ValueError:  # in sys.modules without a spec: imported, so present
        return None
    return None if found is not None else f"No module named {module!r}"


def require_extra(extra: str, setting: str, needs: str) -> None:
    """Raise a `ConfigError` on `setting` when a module of `extra` is not installed.

    `needs` says what asked for it, e.g. "tracing.exporter otlp"; the message ends with the fix.
    """
    for module in EXTRAS[extra]:
        why = _missing(module)
        if why is not None:
            raise ConfigError(
                setting,
                f"{needs} needs the `{extra}` extra, which is not installed ({why}): "
                f"pip install 'hloserve[{extra}]'",
            )
