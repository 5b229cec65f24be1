"""Every failure the service distinguishes, and the one mapping from failures to gRPC status.

| failure | status | details |
|---|---|---|
| ``InvalidRequest`` (a ValueError naming ``field``) | INVALID_ARGUMENT | BadRequest.FieldViolation |
| ``UnknownLayerError`` and other LookupErrors | NOT_FOUND | - |
| ``Overloaded`` | RESOURCE_EXHAUSTED | RetryInfo (``retry_after``) |
| ``NotReady`` | UNAVAILABLE | - |
| ``DeadlineExpired`` | DEADLINE_EXCEEDED | - |
| any other ValueError | INVALID_ARGUMENT | - |
| anything else | INTERNAL, generic message (the traceback goes to the server log only) | - |

``status_of(exc)`` is the mapping, ``abort`` ends a call with it and ``run_unary`` runs a unary
handler's work under it; both front ends (expertd.v1 and KServe) use them.
"""
from __future__ import annotations

import datetime
import logging

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

Status = tuple[grpc.StatusCode, str, list]


class InvalidRequest(ValueError):
    """The request is malformed; ``field`` names the offending field (``hidden_states.shape``)."""

    def __init__(self, field: str, description: str):
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class UnknownLayerError(LookupError):
    """No layer (or KServe model) of that name is served (NOT_FOUND); the message lists those served."""


class Overloaded(Exception):
    """The batcher's queue is full; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(Exception):
    """The server is still warming up, or is draining; no new work is accepted."""


class DeadlineExpired(Exception):
    """The request's deadline passed while it was queued, so it was dropped before compute."""


def status_of(exc: BaseException) -> Status:
    """(code, message, rich details) for a failure; unexpected ones are logged with their traceback."""
    if isinstance(exc, ValueError) and getattr(exc, "field", None):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), [error_details_pb2.BadRequest(field_violations=[violation])]
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(exc).strip("'\""), []
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=exc.retry_after))
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), [error_details_pb2.RetryInfo(retry_delay=delay)]
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, str(exc), []
    if isinstance(exc, DeadlineExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), []
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), []
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); details are in the server log", []


async def abort(context: grpc.aio.ServicerContext, status: Status) -> None:
    """End the call with ``status`` (from ``status_of``), BadRequest / RetryInfo details included."""
    code, message, details = status
    packed_status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        packed_status.details.append(packed)
    await context.abort_with_status(rpc_status.to_status(packed_status))


async def run_unary(context: grpc.aio.ServicerContext, work):
    """Await ``work`` (a unary handler's coroutine); a failure ends the call with its status.

    Counting and timing the call is the ``grpc_server_*`` wrapper's job
    (``expertd.server.interceptors``), not this one's.
    """
    try:
        return await work
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        await abort(context, status_of(exc))
