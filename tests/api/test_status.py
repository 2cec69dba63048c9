"""One table maps every hloserve error to its gRPC status; anything else is INTERNAL."""

from __future__ import annotations

import pytest
from grpclib.const import Status

from hloserve import errors
from hloserve.api.status import STATUS_BY_ERROR, to_grpc_error

CASES = [
    (errors.ModelNotFound("m"), Status.NOT_FOUND),
    (errors.ModelNotReady("m", "bad manifest"), Status.UNAVAILABLE),
    (errors.BundleError("m", "manifest.yaml", "name", "wrong"), Status.INVALID_ARGUMENT),
    (errors.InvalidInput("m", "wrong", "T"), Status.INVALID_ARGUMENT),
    (errors.ShmRegionError("r", "out of bounds"), Status.INVALID_ARGUMENT),
    (errors.ShmRegionNotFound("r"), Status.NOT_FOUND),
    (errors.UnknownTensor("m", "input", "X", ["INPUT0"]), Status.INVALID_ARGUMENT),
    (errors.ShmDisabled(), Status.FAILED_PRECONDITION),
    (errors.QueueFull("m", 8), Status.UNAVAILABLE),
    (errors.Overloaded(64), Status.UNAVAILABLE),
    (errors.ShuttingDown(), Status.UNAVAILABLE),
    (errors.DeadlineExceeded("m", 0.01), Status.DEADLINE_EXCEEDED),
    (errors.NotResident("m"), Status.FAILED_PRECONDITION),
    (errors.ResidencyRefused("self-managed"), Status.FAILED_PRECONDITION),
    (errors.ExecutionFailed("m", "XLA said no"), Status.INTERNAL),
    (errors.Unimplemented("TraceSetting"), Status.UNIMPLEMENTED),
]


@pytest.mark.parametrize(("error", "status"), CASES, ids=lambda c: type(c).__name__)
def test_every_error_has_its_status_and_keeps_its_message(error: Exception, status: Status) -> None:
    grpc_error = to_grpc_error(error, "ModelInfer")
    assert grpc_error.status == status
    assert grpc_error.message == str(error)


def test_the_table_covers_every_request_path_error() -> None:
    load_time = {errors.ConfigError, errors.HloserveError}
    defined = {e for n in errors.__all__ if isinstance(e := getattr(errors, n), type)} - load_time
    assert defined == set(STATUS_BY_ERROR)


def test_an_unexpected_error_is_internal_with_its_type() -> None:
    grpc_error = to_grpc_error(ZeroDivisionError("division by zero"), "ModelInfer")
    assert grpc_error.status == Status.INTERNAL
    assert grpc_error.message == "ModelInfer failed: ZeroDivisionError: division by zero"
