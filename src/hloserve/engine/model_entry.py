"""A model's entry in the model table, and the four states it can be in: `Loaded` (compiled, its
queue running, the dispatcher executing it), `Remote` (a frontend's view of a model the engine
serves: checked and admitted there, executed by the engine), `Meta` (a meta model's `run`) or
`Failed` (why it could not be loaded). Apart from the table (`model_table`), which compiles and
queues, so that a frontend holds entries without importing JAX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hloserve.errors import BundleError, InvalidInput
from hloserve.models.bundle import Bundle
from hloserve.models.model_py import MetaRun, ModelHooks, Registration, load_model_py
from hloserve.models.names import MODEL_PY

if TYPE_CHECKING:
    from hloserve.actors.model_queue import ModelQueueHandle
    from hloserve.models.compiled import CompiledModel

__all__ = ["Failed", "Loaded", "Meta", "ModelEntry", "ModelState", "Remote", "registration_of"]


@dataclass(frozen=True, slots=True)
class Loaded:
    """Compiled and serving: requests go to `queue`, the dispatcher executes `compiled`."""

    bundle: Bundle
    compiled: CompiledModel
    queue: ModelQueueHandle
    registration: Registration | None
    """What its model.py registered (None without one); hot reload swaps it."""


@dataclass(frozen=True, slots=True)
class Remote:
    """A model the engine serves, seen from a frontend: what its planes read of it (its
    requests' checks, admission, ModelConfig); executing it is the engine's."""

    bundle: Bundle
    batch_sizes: tuple[int, ...]
    coalescable: bool
    registration: Registration | None


@dataclass(frozen=True, slots=True)
class Meta:
    """A meta model: its model.py's `run` calls the models its manifest names."""

    bundle: Bundle
    registration: Registration
    """Holds its `meta_run`; hot reload swaps it."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A bundle that could not be loaded, and why (RepositoryIndex shows it)."""

    reason: str


ModelState = Loaded | Remote | Meta | Failed


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model of the table. The properties read its state; a request reads its entry once,
    so a reload swapping the entry never changes a request under way."""

    name: str
    state: ModelState

    @property
    def ready(self) -> bool:
        return not isinstance(self.state, Failed)

    @property
    def error(self) -> str | None:
        return self.state.reason if isinstance(self.state, Failed) else None

    @property
    def bundle(self) -> Bundle | None:
        return None if isinstance(self.state, Failed) else self.state.bundle

    @property
    def compiled(self) -> CompiledModel | None:
        return self.state.compiled if isinstance(self.state, Loaded) else None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes it is compiled for (none for a meta model)."""
        if isinstance(self.state, Remote):
            return self.state.batch_sizes
        return self.state.compiled.batch_sizes if isinstance(self.state, Loaded) else ()

    @property
    def coalescable(self) -> bool:
        """Whether requests can share an execution (and one can be split)."""
        if isinstance(self.state, Remote):
            return self.state.coalescable
        return isinstance(self.state, Loaded) and self.state.compiled.coalescable

    @property
    def queue(self) -> ModelQueueHandle | None:
        return self.state.queue if isinstance(self.state, Loaded) else None

    @property
    def registration(self) -> Registration | None:
        return None if isinstance(self.state, Failed) else self.state.registration

    @property
    def hooks(self) -> ModelHooks | None:
        return None if self.registration is None else self.registration.hooks

    @property
    def meta_run(self) -> MetaRun | None:
        return None if self.registration is None else self.registration.meta_run

    @property
    def calls(self) -> tuple[str, ...]:
        """The models it calls, if it is a meta model."""
        return () if self.bundle is None else self.bundle.manifest.calls

    @property
    def max_rows(self) -> int | None:
        """The most executable rows one request may carry; None: any (split if need be)."""
        sizes, bundle = self.batch_sizes, self.bundle
        if not sizes or self.coalescable or bundle is None or not bundle.manifest.batched:
            return None
        return sizes[-1]

    def check_rows(self, rows: int, source: str) -> None:
        """InvalidInput unless one request of `rows` executable rows (made by `source`: a hook,
        a meta model's call) can be queued; the request decoder checks the client's own."""
        if rows == 0:
            raise InvalidInput(self.name, f"{source} made a batch of 0 rows")
        if self.max_rows is not None and rows > self.max_rows:
            raise InvalidInput(
                self.name, f"{source} made {rows} rows; the largest compiled batch size is {self.max_rows}"
            )


def registration_of(bundle: Bundle) -> Registration | None:
    """Execute the bundle's model.py, if any, and check it registered the bundle's kind."""
    if bundle.model_py is None:
        return None
    registration = load_model_py(bundle.name, bundle.model_py, bundle.path.parent)
    if bundle.manifest.is_meta and registration.meta_run is None:
        raise BundleError(bundle.name, MODEL_PY, None, "a bundle of kind: meta must call register_meta_model")
    if not bundle.manifest.is_meta and registration.hooks is None:
        raise BundleError(
            bundle.name, MODEL_PY, None, "calls register_meta_model, but the manifest has no kind: meta"
        )
    return registration
