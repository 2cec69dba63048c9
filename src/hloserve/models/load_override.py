"""RepositoryModelLoad's `parameters`: Triton's `config` override, mapped onto a model's settings.

A Triton client reloads a model with a JSON ModelConfig in the load parameter `config`. hloserve
applies the fields that map onto a bundle's serving settings (`scheduler.models.<name>`) and
refuses, naming the field, everything else rather than ignore it: a bundle's tensors, backend
and version are fixed by its manifest. `file:` overrides (a bundle sent in the request) are
`hloserve.models.load_files`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hloserve.config import ModelSettings
from hloserve.errors import InvalidInput, clip

__all__ = ["CONFIG_PARAM", "SUPPORTED", "apply_config"]

CONFIG_PARAM = "config"
SUPPORTED = (
    "name",
    "max_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preferred_batch_size",
    "dynamic_batching.default_queue_policy.max_queue_size",
)
"""The config fields a load applies (dotted for nested ones)."""
_MAX_CONFIG_CHARS = 1 << 16


def apply_config(
    model: str, parameters: Mapping[str, str | None], settings: ModelSettings
) -> ModelSettings | None:
    """`settings` with the load parameters' config applied; None when there is no config.

    `parameters` maps each parameter's key to its string value (None: not a string). A config
    that is no JSON object is refused with "failed to load" in the message, Triton's words, which
    its clients match on."""
    for key in sorted(parameters):
        if key != CONFIG_PARAM:
            raise InvalidInput(
                model,
                f"load parameter {clip(key, 64)} is not supported; hloserve takes {CONFIG_PARAM!r}, "
                "a JSON model config, and 'file:<path>' parameters, a bundle's files",
            )
    if CONFIG_PARAM not in parameters:
        return None
    text = parameters[CONFIG_PARAM]
    if text is None or len(text) > _MAX_CONFIG_CHARS:
        raise InvalidInput(
            model,
            f"failed to load: load parameter 'config' must be a JSON string of at most {_MAX_CONFIG_CHARS} "
            "characters",
        )
    try:
        config = json.loads(text)
    except ValueError as e:
        raise InvalidInput(model, f"failed to load: load parameter 'config' is not JSON: {e}") from None
    except RecursionError:
        raise InvalidInput(
            model, "failed to load: load parameter 'config' nests arrays or objects too deeply"
        ) from None
    if not isinstance(config, dict):
        raise InvalidInput(
            model, "failed to load: load parameter 'config' must be a JSON object (a Triton ModelConfig)"
        )
    changes: dict[str, Any] = {}
    for field, value in config.items():
        if field == "name":
            if value != model:
                raise _field(model, "name", f"is {clip(str(value), 64)}, the model loaded is {model!r}")
        elif field == "max_batch_size":
            changes["max_batch_size"] = _count(model, "max_batch_size", value, minimum=1)
        elif field == "dynamic_batching":
            changes.update(_dynamic_batching(model, value))
        else:
            raise _unsupported(model, str(field))
    return dataclasses.replace(settings, **changes)


def _dynamic_batching(model: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _field(model, "dynamic_batching", "must be an object")
    changes: dict[str, Any] = {}
    for key, item in value.items():
        field = f"dynamic_batching.{key}"
        if key == "max_queue_delay_microseconds":
            changes["max_queue_delay_us"] = _count(model, field, item, minimum=0)
        elif key == "preferred_batch_size":  # checked against the compiled sizes once compiled
            if not isinstance(item, list):
                raise _field(model, field, "must be a list of integers")
            sizes = sorted({_count(model, field, size, minimum=1) for size in item})
            changes["preferred_batch_sizes"] = tuple(sizes) or None  # empty: no preference
        elif key == "default_queue_policy" and isinstance(item, dict) and set(item) <= {"max_queue_size"}:
            if "max_queue_size" in item:
                depth = _count(model, f"{field}.max_queue_size", item["max_queue_size"], minimum=0)
                changes["max_queue_depth"] = depth or None  # 0: no limit of its own, as Triton
        else:
            raise _unsupported(model, field if key != "default_queue_policy" else f"{field}.{_first(item)}")
    return changes


def _first(value: Any) -> str:
    return str(next(iter(k for k in value if k != "max_queue_size"), "")) if isinstance(value, dict) else ""


def _count(model: str, field: str, value: Any, minimum: int) -> int:
    """An integer field (JSON protobuf writes 64-bit integers as strings)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field(model, field, f"must be an integer >= {minimum}, got {clip(str(value), 64)}")
    return value


def _field(model: str, field: str, problem: str) -> InvalidInput:
    return InvalidInput(model, f"load parameter 'config', field {field!r}: {problem}")


def _unsupported(model: str, field: str) -> InvalidInput:
    return _field(
        model,
        clip(field, 64).strip("'"),
        f"is not supported; a load applies {', '.join(SUPPORTED)} "
        "(a bundle's tensors, backend and version are fixed by its manifest)",
    )
