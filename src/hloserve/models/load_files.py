"""A bundle sent in RepositoryModelLoad: Triton's `file:<path>` parameters, checked and written.

Triton loads a model from files a client sends (`load_model(name, config=..., files={...})`):
each `file:<path>` parameter carries one file's bytes, and a `config` parameter must come with
them. hloserve takes them as one bundle (`manifest.yaml`, its modules, weights and label files,
the paths relative to the bundle directory, as `hloserve export` writes them), written into a
private directory only the server can read (mode 0700) and checked as any repository bundle is,
confined to that directory. A `model.py` is refused: no code from the network runs here.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from hloserve.errors import InvalidInput, clip
from hloserve.models.names import MAX_NAME_BYTES, MODEL_PY

__all__ = ["FILE_PREFIX", "check_files", "remove", "write_bundle"]

FILE_PREFIX = "file:"
_MAX_DEPTH = 8
"""Directories a sent file may lie in, nested (a bundle is flat but for its label files)."""


def check_files(
    model: str, files: Mapping[str, bytes | None], *, has_config: bool, max_files: int, max_bytes: int
) -> dict[str, bytes]:
    """`files` (path to bytes; None: a value that is not bytes) if they can form a bundle, else
    InvalidInput naming the parameter at fault."""

    def refuse(path: str | None, problem: str) -> InvalidInput:
        key = "" if path is None else f"load parameter {clip(FILE_PREFIX + path, 80)}: "
        return InvalidInput(model, f"{key}{problem}")

    if max_files == 0:
        raise refuse(None, "loading a bundle from files is turned off (server.max_load_files is 0)")
    if not has_config:
        raise refuse(None, "file overrides need a 'config' parameter too, as Triton's do ('{}' will do)")
    if len(files) > max_files:
        raise refuse(None, f"{len(files)} files sent; at most {max_files} (server.max_load_files)")
    checked: dict[str, bytes] = {}
    total = 0
    seen: set[PurePosixPath] = set()
    for path, content in sorted(files.items()):
        if content is None:
            raise refuse(path, "a file's contents are bytes (bytes_param), not a string or number")
        problem = _path_problem(path)
        if problem is not None:
            raise refuse(path, problem)
        parts = PurePosixPath(path)
        if parts.name == MODEL_PY:
            raise refuse(
                path,
                "a model.py is not accepted over the network (no code from a client runs in the "
                "server); put a bundle with a model.py in the repository",
            )
        if parts in seen or any(p in seen for p in parts.parents) or any(parts in s.parents for s in seen):
            raise refuse(path, "names a file twice, or a file and a directory of the same path")
        seen.add(parts)
        checked[path] = content
        total += len(content)
        if total > max_bytes:
            raise refuse(None, f"the files sent exceed {max_bytes} bytes (server.max_load_file_bytes)")
    return checked


def _path_problem(path: str) -> str | None:
    """Why `path` cannot name a file inside the bundle directory, or None."""
    if not path:
        return "the path is empty"
    if not path.isprintable():
        return "the path may hold only printable characters"
    if path.startswith("/") or "\\" in path:
        return "the path must be relative to the bundle directory, with '/' between its parts"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "the path may not hold '..', '.' or empty parts: it must stay inside the bundle"
    if len(parts) > _MAX_DEPTH or any(len(part.encode()) > MAX_NAME_BYTES for part in parts):
        return f"the path may have at most {_MAX_DEPTH} parts of at most {MAX_NAME_BYTES} bytes each"
    return None


def write_bundle(root: Path, model: str, files: Mapping[str, bytes]) -> Path:
    """A new private directory under `root` holding `files` as the bundle `model` (returned:
    the directory to remove once the model no longer serves from it; the bundle is `model` in it).
    """
    private = Path(tempfile.mkdtemp(prefix="load-", dir=root))  # mode 0700: the server's alone
    directory = private / model
    try:
        directory.mkdir()
        for path, content in files.items():
            target = directory / path
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("xb") as f:  # exclusive: never through something already there
                f.write(content)
    except BaseException:
        remove(private)
        raise
    return private


def remove(private: Path) -> None:
    """Remove a private directory and everything in it (gone already: nothing to do)."""
    shutil.rmtree(private, ignore_errors=True)
