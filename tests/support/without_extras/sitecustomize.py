"""Put on PYTHONPATH, makes the modules named in TEST_ABSENT_MODULES (comma-separated) and their
submodules fail to import, as on a machine without them: a meta-path finder, first in line,
raises ModuleNotFoundError for them (for `import` and `importlib.util.find_spec` alike)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

ABSENT = tuple(name for name in os.environ.get("TEST_ABSENT_MODULES", "").split(",") if name)


class _Absent:
    @staticmethod
    def find_spec(
        name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if any(name == absent or name.startswith(f"{absent}.") for absent in ABSENT):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if ABSENT:
    sys.meta_path.insert(0, _Absent())
