"""Writing a bundle where nothing half-written can be seen: beside its destination, then moved."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["write_staged"]

T = TypeVar("T")


def write_staged(directory: Path, write: Callable[[Path], T]) -> T:
    """Call `write(path)` with a fresh path named like `directory`, then move it to `directory`.

    The path lies in a hidden folder beside `directory` (same filesystem, so the move is one
    rename; a repository scan sees no manifest there), removed whatever happens. If `write`
    raises, `directory` is left as it was.

    Raises:
        FileExistsError: `directory` already exists.
    """
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; remove it or choose another --out")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".importing-{directory.name}-", dir=directory.parent))
    try:
        result = write(staging / directory.name)
        (staging / directory.name).replace(directory)
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)
