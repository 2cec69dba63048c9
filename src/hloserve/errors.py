"""Every error hloserve raises on purpose, each building its own sentence.

Raise sites stay one line; the adapters map each class to a gRPC status in one table
(`hloserve.api.status`). Messages name the model, the tensor and what was expected, because the
person reading them is a client author with only the message to go on. Whatever a client sent
is quoted through `clip`, so a message stays short however long the client's strings are.
"""

from __future__ import annotations

__all__ = [
    "CLIP_CHARS",
    "BatchTooLarge",
    "BundleError",
    "CannotMeetDeadline",
    "ConfigError",
    "DeadlineExceeded",
    "ExecutionFailed",
    "HloserveError",
    "HookFailed",
    "InvalidInput",
    "ModelNotFound",
    "ModelNotReady",
    "NotResident",
    "Overloaded",
    "QueueFull",
    "ResidencyRefused",
    "ShmDisabled",
    "ShmLimit",
    "ShmRegionError",
    "ShmRegionExists",
    "ShmRegionNotFound",
    "ShuttingDown",
    "Unimplemented",
    "UnknownTensor",
    "clip",
]

CLIP_CHARS = 200
"""How many characters of a client's string a message or log line quotes."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text` quoted as `{text!r}` would, or, when longer than `limit`, its quoted prefix, an
    ellipsis and its length.

    A client's name can be a megabyte; every message quoting one ends up in a gRPC header (and
    in logs), so client text goes through here and never verbatim.
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class HloserveError(Exception):
    """Base of every error hloserve raises deliberately."""


class BundleError(HloserveError):
    """A bundle on disk is malformed; raised while loading, never on the request path.

    The message starts with ``bundle 'name', file 'manifest.yaml', field 'x':`` so an operator
    can open the file and go straight to the field.
    """

    def __init__(self, bundle: str, file: str, field: str | None, problem: str) -> None:
        self.bundle, self.file, self.field, self.problem = bundle, file, field, problem
        where = f"bundle {clip(bundle)}, file {clip(file)}"
        if field:
            where += f", field {clip(field)}"
        super().__init__(f"{where}: {problem}")


class ConfigError(HloserveError):
    """A configuration value is invalid; names the field (or variable) and what it accepts."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"config {field}: {problem}")


class ModelNotFound(HloserveError):
    """The request names a model (or version) the server does not serve, or no longer does.

    The message begins with Triton's words, which clients match on."""

    def __init__(self, model: str, detail: str = "", version: str = "") -> None:
        self.model = model
        which = f"{clip(model)} version {version}" if version else clip(model)
        super().__init__(
            f"Request for unknown model: {which} is not found" + (f": {detail}" if detail else "")
        )


class ModelNotReady(HloserveError):
    """The model is known but failed to load; the reason says why."""

    def __init__(self, model: str, reason: str) -> None:
        self.model, self.reason = model, reason
        super().__init__(f"model {clip(model)} is not ready: {reason}")


class InvalidInput(HloserveError):
    """The request itself is wrong: a tensor's name, dtype, shape or size, or a batch size.

    Differs from `ModelNotFound` (wrong model) and `ShmRegionError` (wrong region reference).
    """

    def __init__(self, model: str, problem: str, tensor: str | None = None) -> None:
        self.model, self.tensor, self.problem = model, tensor, problem
        where = f"model {clip(model)}" + (f", tensor {clip(tensor)}" if tensor else "")
        super().__init__(f"{where}: {problem}")


class BatchTooLarge(InvalidInput):
    """A request of more rows than the model's `max_batch_size` setting (a load's config override
    or `scheduler.models`); the message is Triton's, which clients match on. Without the setting
    nothing is too large: a request above the largest compiled size is split into executions."""

    def __init__(self, model: str, rows: int, limit: int) -> None:
        self.model, self.tensor = model, None
        self.problem = f"batch of {rows} rows exceeds max_batch_size {limit}"
        HloserveError.__init__(self, f"inference request batch-size must be <= {limit} for {clip(model)}")


class UnknownTensor(InvalidInput):
    """A request names an input or requested output the model does not have; the message
    begins with Triton's words, which clients match on."""

    def __init__(self, model: str, kind: str, tensor: str, expected: list[str]) -> None:
        self.model, self.tensor, self.problem = model, tensor, f"unknown {kind}"
        HloserveError.__init__(
            self,
            f"unexpected inference {kind} {clip(tensor)} for model {clip(model)}: expected one of {expected}",
        )


class MixedContents(InvalidInput):
    """An input holds typed `contents` in a request with `raw_input_contents` (the KServe V2
    protocol forbids mixing them); the message is Triton's, which its clients match on."""

    def __init__(self, model: str, tensor: str) -> None:
        self.model, self.tensor, self.problem = model, tensor, "typed contents with raw_input_contents"
        HloserveError.__init__(
            self,
            f"contents field must not be specified when using raw_input_contents for {clip(tensor)} "
            f"for model {clip(model)}",
        )


class QueueFull(HloserveError):
    """The model's queue holds `max_queue_depth` requests; retry later (UNAVAILABLE)."""

    def __init__(self, model: str, depth: int) -> None:
        self.model, self.depth = model, depth
        super().__init__(
            f"model {clip(model)}: queue is full ({depth} requests, scheduler max_queue_depth); retry later"
        )


class CannotMeetDeadline(HloserveError):
    """Admission: the work queued ahead of a request outlasts its deadline; refused on arrival
    (UNAVAILABLE) so that a retry, later or with a longer deadline, can succeed."""

    def __init__(
        self,
        model: str,
        expected_s: float,
        remaining_s: float,
        ahead: int,
        rows: int,
        s_per_row: float,
        loop_lag_s: float,
        load_s: float = 0.0,
    ) -> None:
        self.model, self.expected_s, self.remaining_s = model, expected_s, remaining_s
        load = f", its weights {load_s * 1e3:.1f} ms to load" if load_s else ""
        super().__init__(
            f"model {model!r}: refused on arrival, it cannot meet its deadline: it would be "
            f"answered in about {expected_s * 1e3:.1f} ms ({ahead} rows ahead of its {rows} at "
            f"{s_per_row * 1e3:.3f} ms per row{load}, the server {loop_lag_s * 1e3:.1f} ms behind) and "
            f"{max(remaining_s, 0.0) * 1e3:.1f} ms are left; retryable: retry later or with a "
            "longer deadline"
        )


class Overloaded(HloserveError):
    """The server holds its global cap of in-flight requests; retry later (UNAVAILABLE)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(
            f"server is overloaded: {limit} requests in flight (server max_inflight_requests); retry later"
        )


class ShuttingDown(HloserveError):
    """The server is stopping and takes no new work."""

    def __init__(self) -> None:
        super().__init__("server is shutting down")


class DeadlineExceeded(HloserveError):
    """The request's deadline passed before it could run; it was never executed."""

    def __init__(self, model: str, late_by_s: float) -> None:
        self.model, self.late_by_s = model, late_by_s
        super().__init__(
            f"model {clip(model)}: deadline passed {late_by_s * 1e3:.3f} ms before execution; request dropped"
        )


class NotResident(HloserveError):
    """Externally managed residency: the model's weights are not on the device."""

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(
            f"model {clip(model)} is not resident and residency is externally managed; "
            "load it with SetModelResidency first"
        )


class ResidencyRefused(HloserveError):
    """A residency change the worker's mode does not allow (FAILED_PRECONDITION)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)


class ShmRegionError(HloserveError):
    """A shared-memory region reference is unknown, out of bounds or the wrong size."""

    def __init__(self, region: str, problem: str) -> None:
        self.region, self.problem = region, problem
        super().__init__(f"shared memory region {clip(region)}: {problem}")


class ShmRegionExists(ShmRegionError):
    """The name is registered already; unregister it first (as Triton: ALREADY_EXISTS)."""

    def __init__(self, region: str) -> None:
        super().__init__(region, "is already registered; unregister it first to register it again")


class ShmRegionNotFound(ShmRegionError):
    """The status of a region that is not registered was asked for (as Triton: NOT_FOUND)."""

    def __init__(self, region: str) -> None:
        super().__init__(region, "is not registered")


class ShmLimit(ShmRegionError):
    """Registering would pass a cap on regions or their bytes (RESOURCE_EXHAUSTED)."""

    def __init__(self, region: str, problem: str, config_key: str) -> None:
        self.config_key = config_key
        super().__init__(region, f"{problem} ({config_key}); unregister a region first")


class ShmDisabled(HloserveError):
    """A client asked for system shared memory, which the server does not allow by default."""

    def __init__(self) -> None:
        super().__init__(
            "system shared memory is disabled: a client region makes the server map memory it names; "
            "start hloserve with --allow-client-shm (config server.allow_client_shm: true) to allow it"
        )


class ExecutionFailed(HloserveError):
    """XLA raised; the message carries the cause, the server keeps serving."""

    def __init__(self, model: str, cause: str) -> None:
        self.model, self.cause = model, cause
        super().__init__(f"model {clip(model)}: execution failed: {cause}")


class HookFailed(HloserveError):
    """A model.py hook (or a meta model's run) raised, or returned tensors that do not fit the
    manifest; the message carries the hook's own words, the server keeps serving."""

    def __init__(self, model: str, hook: str, cause: str) -> None:
        self.model, self.hook, self.cause = model, hook, cause
        super().__init__(f"model {clip(model)}: {hook} failed: {cause}")


class Unimplemented(HloserveError):
    """An RPC hloserve does not provide (yet); says which."""

    def __init__(self, rpc: str, detail: str = "") -> None:
        self.rpc = rpc
        super().__init__(f"{rpc} is not implemented by hloserve" + (f": {detail}" if detail else ""))
