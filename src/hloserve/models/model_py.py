"""A bundle's `model.py`: plain Python around the compiled graph, loaded in its own namespace.

A `model.py` registers what the bundle does beyond its executable:

    from hloserve import NamedTensor, register_model

    def postprocess(outputs: list[NamedTensor]) -> list[NamedTensor]:
        ...

    register_model("severity_grader", postprocess=postprocess)

or, for a bundle of `kind: meta` that chains other models, `register_meta_model(name, run=...)`.
Hooks take and return a list of `NamedTensor` (numpy arrays in wire order: row-major, batch axis
where the manifest puts it); an omitted hook is the identity. Each file is executed as a fresh
module of its own, so two bundles never share globals, and executing it again (hot reload)
replaces what it registered.
"""

from __future__ import annotations

import contextvars
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hloserve.errors import BundleError

__all__ = [
    "Hook",
    "MetaRun",
    "ModelHooks",
    "NamedTensor",
    "Registration",
    "load_model_py",
    "register_meta_model",
    "register_model",
]

FILE = "model.py"


@dataclass(frozen=True, slots=True)
class NamedTensor:
    """A tensor and its name, as hooks and meta models see them."""

    name: str
    data: np.ndarray


Hook = Callable[[list[NamedTensor]], Sequence[NamedTensor]]
MetaRun = Callable[[list[NamedTensor], Any], Sequence[NamedTensor]]
"""`run(inputs, call)`; `call` is a `hloserve.engine.meta.Call`."""


@dataclass(frozen=True, slots=True)
class ModelHooks:
    """What `register_model` registered: the hooks around one executable (None: identity)."""

    preprocess: Hook | None = None
    postprocess: Hook | None = None


@dataclass(frozen=True, slots=True)
class Registration:
    """What one execution of a `model.py` registered: hooks or a meta model's `run`."""

    hooks: ModelHooks | None = None
    meta_run: MetaRun | None = None


@dataclass(slots=True)
class _Loading:
    bundle: str
    registration: Registration | None = None


_loading: contextvars.ContextVar[_Loading] = contextvars.ContextVar("hloserve_model_py")


def _register(name: str, registration: Registration, call: str) -> None:
    loading = _loading.get(None)
    if loading is None:
        raise RuntimeError(f"{call} may only be called from a bundle's model.py while the server loads it")
    if name != loading.bundle:
        raise ValueError(f"{call}({name!r}) in bundle {loading.bundle!r}: the name must be the bundle's")
    if loading.registration is not None:
        raise ValueError(f"{call}({name!r}): the bundle already registered itself once")
    loading.registration = registration


def register_model(name: str, *, preprocess: Hook | None = None, postprocess: Hook | None = None) -> None:
    """Attach pre- and post-processing hooks to the bundle `name` (from its model.py only)."""
    for kind, hook in (("preprocess", preprocess), ("postprocess", postprocess)):
        if hook is not None and not callable(hook):
            raise TypeError(f"register_model({name!r}): {kind} must be callable, got {hook!r}")
    _register(name, Registration(hooks=ModelHooks(preprocess, postprocess)), "register_model")


def register_meta_model(name: str, *, run: MetaRun) -> None:
    """Make the bundle `name` (of `kind: meta`) a meta model: `run(inputs, call)` answers each
    request, calling other models with `call(model, inputs)` (from its model.py only)."""
    if not callable(run):
        raise TypeError(f"register_meta_model({name!r}): run must be callable, got {run!r}")
    _register(name, Registration(meta_run=run), "register_meta_model")


def load_model_py(bundle: str, path: Path, repository: Path) -> Registration:
    """Execute `path` as a new module and return what it registered.

    `path` must lie inside `repository` once links are followed, checked again at every
    execution (a hot reload runs it anew). Raises BundleError naming the bundle and the file
    when the file lies elsewhere, fails to run or registers nothing. Blocking (imports may be
    slow): call it in a worker thread.
    """
    from hloserve.models.bundle import check_inside  # here: a frontend uses NamedTensor, not JAX

    check_inside(path, repository, bundle)
    module_name = f"hloserve_bundles.{bundle}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    loading = _Loading(bundle)
    token = _loading.set(loading)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        # Compiled from the source each time, never from a cached .pyc: an edit within the same
        # second that keeps the size would otherwise be served stale, and no __pycache__ folder
        # is left in the bundle.
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    except Exception as e:
        if previous is not None:
            sys.modules[module_name] = previous
        else:
            del sys.modules[module_name]
        raise BundleError(bundle, FILE, None, f"raised {type(e).__name__}: {e}") from e
    finally:
        _loading.reset(token)
    if loading.registration is None:
        raise BundleError(
            bundle,
            FILE,
            None,
            f"registers nothing; call register_model({bundle!r}, ...) or register_meta_model",
        )
    return loading.registration
