"""Typed client exceptions for the gRPC status codes the expert server answers with.

Every exception carries the server's message (``.message``), its gRPC code (``.code``), the
``google.rpc.BadRequest`` field violations the server attached (``.field_violations``, a list of
``(field, description)``) and the server's ``google.rpc.RetryInfo`` hint (``.retry_delay`` in
seconds, or ``None``).
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class ExpertError(Exception):
    """A call to the expert server failed; base of every typed client error."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field_violations: list[tuple[str, str]] | None = None,
        retry_delay: float | None = None,
    ):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field_violations = field_violations or []
        self.retry_delay = retry_delay

    @property
    def retryable(self) -> bool:
        """True for UNAVAILABLE and RESOURCE_EXHAUSTED: the same call may succeed later."""
        return self.code in RETRYABLE_CODES


class InvalidArgumentError(ExpertError, ValueError):
    """INVALID_ARGUMENT: the request is malformed (see ``field_violations``)."""


class NotFoundError(ExpertError, LookupError):
    """NOT_FOUND: the server does not hold the layer asked for."""


class UnavailableError(ExpertError):
    """UNAVAILABLE: the server is warming up, draining or unreachable; retry later."""


class ResourceExhaustedError(ExpertError):
    """RESOURCE_EXHAUSTED: the server's queue is full; retry with backoff."""


class ThrottledError(ResourceExhaustedError):
    """RESOURCE_EXHAUSTED decided by this client, the call never sent: the server refused most of
    its recent calls (client-side throttling, :mod:`expertd.client.throttle`)."""

    def __init__(self, message: str, *, retry_delay: float | None = None):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_delay=retry_delay)


class DeadlineExceededError(ExpertError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline passed before the answer came."""


class CancelledError(ExpertError):
    """CANCELLED: the call was cancelled."""


class UnauthenticatedError(ExpertError):
    """UNAUTHENTICATED: a bearer token is required and was missing or wrong."""


class InternalError(ExpertError):
    """INTERNAL: the server failed while computing; the message has no stack trace."""


_BY_CODE: dict[grpc.StatusCode, type[ExpertError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
}
_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for(
    code: grpc.StatusCode | int,
    message: str,
    *,
    field_violations: list[tuple[str, str]] | None = None,
    retry_delay: float | None = None,
) -> ExpertError:
    """The typed exception for a status code (a ``grpc.StatusCode`` or its integer value)."""
    if not isinstance(code, grpc.StatusCode):
        code = _CODE_BY_VALUE.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, ExpertError)
    return cls(code, message, field_violations=field_violations, retry_delay=retry_delay)


def from_rpc_error(error: grpc.RpcError) -> ExpertError:
    """Turn a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``) into a typed error."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    violations, retry_delay = _rich_details(trailing or ())
    return error_for(code, message, field_violations=violations, retry_delay=retry_delay)


def _rich_details(metadata: Iterable[tuple[str, str | bytes]]) -> tuple[list[tuple[str, str]], float | None]:
    """BadRequest field violations and the RetryInfo delay from ``grpc-status-details-bin``."""
    violations: list[tuple[str, str]] = []
    retry_delay = None
    for key, value in metadata:
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations += [(v.field, v.description) for v in bad_request.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry_info = error_details_pb2.RetryInfo()
                detail.Unpack(retry_info)
                retry_delay = retry_info.retry_delay.ToTimedelta().total_seconds()
    return violations, retry_delay
