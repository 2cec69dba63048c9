"""The one place where exceptions become gRPC statuses.

Handlers raise hloserve errors and let them go; `to_grpc_error` walks the exception's classes
through `STATUS_BY_ERROR`. Anything unexpected becomes INTERNAL with the cause's type and text,
logged once with its traceback; BaseException (cancellation) is never caught here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from hloserve import errors

__all__ = ["STATUS_BY_ERROR", "grpc_errors", "to_grpc_error"]

log = structlog.get_logger("hloserve.grpc")

STATUS_BY_ERROR: dict[type[Exception], Status] = {
    errors.ModelNotFound: Status.NOT_FOUND,
    errors.BundleError: Status.INVALID_ARGUMENT,
    errors.ModelNotReady: Status.UNAVAILABLE,
    errors.InvalidInput: Status.INVALID_ARGUMENT,
    errors.ShmRegionError: Status.INVALID_ARGUMENT,
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


def to_grpc_error(error: Exception, rpc: str) -> GRPCError:
    """The GRPCError a client should see for `error` raised while serving `rpc`."""
    if isinstance(error, GRPCError):
        return error
    for cls in type(error).__mro__:
        status = STATUS_BY_ERROR.get(cls)
        if status is not None:
            return GRPCError(status, str(error))
    log.error("unexpected error", rpc=rpc, exc_info=error)
    return GRPCError(Status.INTERNAL, f"{rpc} failed: {type(error).__name__}: {error}")


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
