"""Every failure the service distinguishes, the one mapping from failures to gRPC status, and how
failures are logged.

| failure | status | details |
|---|---|---|
| ``InvalidRequest`` (a ValueError naming ``field``) | INVALID_ARGUMENT | BadRequest.FieldViolation |
| ``UnknownLayerError`` and other LookupErrors | NOT_FOUND | - |
| ``Overloaded`` | RESOURCE_EXHAUSTED | RetryInfo (``retry_after``) |
| ``NotReady`` | UNAVAILABLE | - |
| ``DeadlineExpired`` | DEADLINE_EXCEEDED | - |
| any other ValueError | INVALID_ARGUMENT | - |
| anything else | INTERNAL, generic message (the traceback goes to the server log only) | - |

``status_of(exc)`` is the mapping, ``set_status`` gives a call its status and ``run_unary`` runs a unary
handler's work under it; both front ends (expertd.v1 and KServe) use them.

Rules for messages and logs:
- A status message is at most ``MAX_MESSAGE_CHARS`` characters, and every value a message quotes
  from a request goes through ``shown`` (at most ``MAX_SHOWN_CHARS``): a request cannot make the
  server write (or send back) more than a bounded amount of text.
- Failures the client caused (bad input, unknown layer, overload, deadlines, cancellations, auth,
  undecodable or oversize messages) never log a traceback: ``client_errors`` writes one line per
  status code at most ``CLIENT_LOG_BURST`` times a minute and says how many it suppressed.
  Failures of the server itself (INTERNAL) log their traceback every time.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

Status = tuple[grpc.StatusCode, str, list]

MAX_MESSAGE_CHARS = 1024
MAX_SHOWN_CHARS = 80
CLIENT_LOG_BURST = 5
CLIENT_LOG_WINDOW_S = 60.0


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters (the cut says how long it was)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} chars)"
    return text[:max(limit - len(tail), 0)] + tail


def shown(value, limit: int = MAX_SHOWN_CHARS) -> str:
    """A request's value quoted in a message: its repr, at most ``limit`` characters."""
    return bounded(repr(value), limit)


def shown_shape(shape) -> str:
    """A shape quoted in a message: its first dimensions only when it has many (``len`` is O(1))."""
    count = len(shape)
    if count <= 4:
        return str([int(d) for d in shape])
    return f"[{', '.join(str(int(shape[i])) for i in range(3))}, ...] ({count} dimensions)"


class InvalidRequest(ValueError):
    """The request is malformed; ``field`` names the offending field (``hidden_states.shape``)."""

    def __init__(self, field: str, description: str):
        field, description = bounded(field, MAX_SHOWN_CHARS * 2), bounded(description)
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class UnknownLayerError(LookupError):
    """No layer (or KServe model) of that name is served (NOT_FOUND); the message lists those served."""


class Overloaded(Exception):
    """Admission refused the request (see ``expertd.server.batching.admission``); the caller should retry
    after ``retry_after`` seconds. ``reason`` names the bound that refused it (a metric label)."""

    def __init__(self, message: str, retry_after: float, reason: str = "queue_size"):
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class NotReady(Exception):
    """The server is still warming up, or is draining; no new work is accepted."""


class DeadlineExpired(Exception):
    """The request's deadline passed while it was queued, so it was dropped before compute."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """What a guarded deserializer (``transport.interceptors.guarded``) hands the method instead of
    a message it would not parse; the wrapper around the method answers it with its status."""

    code: grpc.StatusCode
    message: str
    reason: str  # too_large | undecodable


class RefusedMessage(Exception):
    """A streamed request message was refused: the call ends with its status, answered by the
    method's wrapper whichever handler reads the message (``run_unary`` lets it through)."""

    def __init__(self, refused: Refused):
        super().__init__(refused.message)
        self.refused = refused


def status_of(exc: BaseException) -> Status:
    """(code, message, rich details) for a failure; unexpected ones are logged with their traceback."""
    if isinstance(exc, ValueError) and getattr(exc, "field", None):
        field, description = bounded(exc.field, MAX_SHOWN_CHARS * 2), bounded(exc.description)
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
        return (grpc.StatusCode.INVALID_ARGUMENT, bounded(f"{field}: {description}"),
                [error_details_pb2.BadRequest(field_violations=[violation])])
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, bounded(str(exc).strip("'\"")), []
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=exc.retry_after))
        return grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(str(exc)), [error_details_pb2.RetryInfo(retry_delay=delay)]
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, bounded(str(exc)), []
    if isinstance(exc, DeadlineExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED, bounded(str(exc)), []
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)), []
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); details are in the server log", []


def rich_status(status: Status) -> status_pb2.Status:
    """``status`` (from ``status_of``) as a google.rpc.Status, its BadRequest / RetryInfo details packed."""
    code, message, details = status
    packed_status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        packed_status.details.append(packed)
    return packed_status


def set_status(context: grpc.aio.ServicerContext, status: Status) -> None:
    """Give the call ``status`` (from ``status_of``), BadRequest / RetryInfo details included, for
    gRPC to send when the handler returns (its response, if any, is then discarded)."""
    grpc_status = rpc_status.to_status(rich_status(status))
    context.set_trailing_metadata(grpc_status.trailing_metadata)
    context.set_code(grpc_status.code)
    context.set_details(grpc_status.details)


async def run_unary(context: grpc.aio.ServicerContext, work):
    """Await ``work`` (a unary handler's coroutine); a failure gives the call its status and no
    response (the status set, not raised: an abort unwinds through every wrapper for the same answer).

    Counting, timing and logging the call is the ``grpc_server_*`` wrapper's job
    (``expertd.server.transport.interceptors``), not this one's.
    """
    try:
        return await work
    except RefusedMessage:  # a message that did not parse: the wrapper answers it, as for every method
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        set_status(context, status_of(exc))
        return None


# ---------------------------------------------------------------------- logging client errors

class RateLimitedLog:
    """At most ``burst`` lines per kind in every ``window_s`` seconds; the first line after some
    were suppressed says how many. Thread-safe (gRPC's own log records come from its threads)."""

    def __init__(self, logger: logging.Logger, *, burst: int = CLIENT_LOG_BURST, window_s: float = CLIENT_LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self._logger, self._burst, self._window_s, self._clock = logger, burst, window_s, clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [window start, lines written in it, suppressed]

    def note(self, kind: str, message: str, level: int = logging.INFO) -> bool:
        """Log ``kind: message`` unless the kind's budget is spent; True when it was written."""
        now = self._clock()
        with self._lock:
            state = self._kinds.setdefault(kind, [now, 0, 0])
            if now - state[0] >= self._window_s:
                state[0], state[1] = now, 0
            if state[1] >= self._burst:
                state[2] += 1
                return False
            state[1] += 1
            suppressed, state[2] = state[2], 0
        extra = f" ({suppressed} more {kind} suppressed before this one)" if suppressed else ""
        self._logger.log(level, "%s: %s%s", kind, bounded(message), extra)
        return True


client_errors = RateLimitedLog(logging.getLogger("expertd.server.client_errors"))
"""The one log of client-caused failures (see the module docstring)."""

CLIENT_CODES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                          "CANCELLED", "UNAUTHENTICATED", "UNIMPLEMENTED"})
"""The status codes (names) of failures the client caused: logged through ``client_errors``."""


class _ClientGoneFilter(logging.Filter):
    """gRPC logs a traceback when it cannot send an answer because the client already went away
    (cancelled, or its deadline passed, while the answer was on its way): a client-caused event,
    so it becomes one rate-limited line instead. Every other gRPC record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("ExecuteBatchError raised in core"):
            client_errors.note("CANCELLED", "the client went away while its answer was being sent")
            return False
        return True


_grpc_filter_installed = False


def quiet_grpc_client_errors() -> None:
    """Install the filter above on gRPC's server logger (once per process)."""
    global _grpc_filter_installed
    if not _grpc_filter_installed:
        logging.getLogger("grpc._cython.cygrpc").addFilter(_ClientGoneFilter())
        _grpc_filter_installed = True
