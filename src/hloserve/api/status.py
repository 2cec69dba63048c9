"""The one place where exceptions become gRPC statuses.

Handlers raise hloserve errors and let them go; `to_grpc_error` walks the exception's classes
through `STATUS_BY_ERROR`. Anything unexpected becomes INTERNAL with the cause's type and text,
logged once with its traceback; BaseException (cancellation) is never caught here. Every status
message is cut to `MAX_STATUS_MESSAGE_CHARS`: it travels in a header, which clients cap (grpcio
at 8 KiB of metadata by default) and which costs the server time to encode.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve import errors

__all__ = ["MAX_STATUS_MESSAGE_CHARS", "STATUS_BY_ERROR", "grpc_errors", "status_of", "to_grpc_error"]

log = structlog.get_logger("hloserve.grpc")

MAX_STATUS_MESSAGE_CHARS = 1024
"""Longest status message sent; a longer one keeps its head and says how long it was."""

STATUS_BY_ERROR: dict[type[Exception], Status] = {
    errors.ModelNotFound: Status.NOT_FOUND,
    errors.BundleError: Status.INVALID_ARGUMENT,
    errors.ModelNotReady: Status.UNAVAILABLE,
    errors.InvalidInput: Status.INVALID_ARGUMENT,
    errors.UnknownTensor: Status.INVALID_ARGUMENT,
    errors.BatchTooLarge: Status.INVALID_ARGUMENT,
    errors.ShmRegionError: Status.INVALID_ARGUMENT,
    errors.ShmRegionExists: Status.ALREADY_EXISTS,
    errors.ShmRegionNotFound: Status.NOT_FOUND,
    errors.ShmLimit: Status.RESOURCE_EXHAUSTED,
    errors.ShmDisabled: Status.FAILED_PRECONDITION,
    errors.QueueFull: Status.UNAVAILABLE,
    errors.Overloaded: Status.UNAVAILABLE,
    errors.CannotMeetDeadline: Status.UNAVAILABLE,
    errors.ShuttingDown: Status.UNAVAILABLE,
    errors.DeadlineExceeded: Status.DEADLINE_EXCEEDED,
    errors.NotResident: Status.FAILED_PRECONDITION,
    errors.ResidencyRefused: Status.FAILED_PRECONDITION,
    errors.ExecutionFailed: Status.INTERNAL,
    errors.HookFailed: Status.INTERNAL,
    errors.Unimplemented: Status.UNIMPLEMENTED,
}


def status_of(error: Exception) -> Status | None:
    """The status `error` stands for (a GRPCError's own, or by `STATUS_BY_ERROR`); None when it
    is unexpected (INTERNAL to the client)."""
    if isinstance(error, GRPCError):
        return error.status
    for cls in type(error).__mro__:
        status = STATUS_BY_ERROR.get(cls)
        if status is not None:
            return status
    return None


def to_grpc_error(error: Exception, rpc: str) -> GRPCError:
    """The GRPCError a client should see for `error` raised while serving `rpc`."""
    if isinstance(error, GRPCError):
        return GRPCError(error.status, error.message and _bounded(error.message), error.details)
    status = status_of(error)
    if status is not None:
        return GRPCError(status, _bounded(str(error)))
    cause = _bounded(f"{type(error).__name__}: {error}")
    # The frames without the exception's own text, which may quote a client's megabyte.
    frames = "".join(traceback.format_tb(error.__traceback__))
    log.error("unexpected error", rpc=rpc, error=cause, traceback=frames)
    return GRPCError(Status.INTERNAL, _bounded(f"{rpc} failed: {cause}"))


def _bounded(message: str) -> str:
    if len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return message
    note = f"… ({len(message)} characters in all)"
    return message[: MAX_STATUS_MESSAGE_CHARS - len(note)] + note


P = ParamSpec("P")
R = TypeVar("R")


def grpc_errors(
    rpc: str,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorate a generated-message handler so whatever it raises becomes its gRPC status."""

    def wrap(handler: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(handler)
        async def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return await handler(*args, **kwargs)
            except Exception as e:
                raise to_grpc_error(e, rpc) from None

        return wrapped

    return wrap
