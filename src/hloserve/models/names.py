"""Names in a model repository: a model's (what a client may name) and a bundle's code file.
Apart from `bundle` so that a process that checks names and never loads a bundle (a frontend)
does not import JAX."""

from __future__ import annotations

from hloserve.errors import InvalidInput

__all__ = ["MAX_NAME_BYTES", "MODEL_PY", "check_model_name"]

MODEL_PY = "model.py"
"""A bundle's Python: hooks or a meta model, run only from the repository."""

MAX_NAME_BYTES = 255
"""The longest model name, in UTF-8 bytes: a directory name (NAME_MAX on Linux)."""


def check_model_name(name: str) -> str:
    """`name` if it is a plain model name, else InvalidInput naming the rule it breaks.

    A model name is the name of a directory inside the repository, never a path: a client that
    could name `/elsewhere` or `../x` would have the server execute any `model.py` it can reach.
    """
    shown = name if len(name) <= 64 else name[:64] + "..."  # the name is the client's: bounded
    size = len(name.encode("utf-8", errors="surrogatepass"))
    if not name:
        problem = "a model name must not be empty"
    elif size > MAX_NAME_BYTES:
        problem = f"a model name is at most {MAX_NAME_BYTES} bytes, this one is {size}"
    elif "/" in name or "\\" in name:
        problem = "a model name is a plain name, not a path: it may not contain '/' or '\\'"
    elif name in (".", ".."):
        problem = "a model name may not be '.' or '..'"
    elif not name.isprintable():
        problem = "a model name may hold only printable characters (no NUL or control characters)"
    else:
        return name
    raise InvalidInput(shown, problem)
