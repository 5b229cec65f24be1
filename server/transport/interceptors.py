"""What every gRPC method gets on top of its servicer: bearer-token auth before the body is read,
per-method message limits before it is parsed, and the ``grpc_server_*`` metrics.

All of it is applied once, when a service registers its handlers, not per call: ``wrapping(server,
metrics, token, max_request_bytes=...)`` returns a stand-in for the grpc.aio server that every
``add_*_to_server`` function is given (``transport.registration``). It keeps every method in one
generic handler (``_Router``) registered on the real server; grpc.aio asks it for a method's
handler when a call starts, with the call's metadata and before the request message is read, so
that:

- Auth: a call to a method outside ``OPEN_SERVICES`` without ``authorization: Bearer <token>``
  (scheme in any case, RFC 7235) gets a handler that never reads the request and answers
  UNAUTHENTICATED at once: a client without the token cannot make the server read a body.
- Limits: each method's request deserializer is wrapped (``guarded``): a message over the
  method's limit (``TENSOR_METHODS``: ``max_request_bytes``; every other method:
  ``SMALL_REQUEST_BYTES``) is refused with RESOURCE_EXHAUSTED without being parsed, and bytes that
  do not parse are INVALID_ARGUMENT, instead of gRPC's UNKNOWN and a logged traceback.
- Early handlers (``add_early``): an authorized call that carries a method's metadata key (Forward's
  ``expertd-admission``) goes to a request-streaming handler, which decides from the metadata
  before it reads the message: a call it refuses never has its body read.
- Metrics: each call is counted and timed (the only place calls are, ``expertd.server.metrics.families``),
  with the status it ended with (a call ended by its deadline is DEADLINE_EXCEEDED), and a failure
  the client caused writes one rate-limited log line (``errors.client_errors``), never a traceback.

What gRPC does before any of this runs: it reads the HTTP/2 headers; and for an authorized call,
gRPC core (1.81) reads the whole message before it compares its length with the server-wide
``grpc.max_receive_message_length`` (docs/overload.md).

Rule: nothing per call that can be done once per method; grpc.aio's own ``ServerInterceptor`` chain
would await a coroutine per interceptor and rebuild the handler on every call. The wrapping itself
lives in ``transport.registration``. Health is open: Kubernetes probes cannot send metadata.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

import grpc

from expertd.server.errors import CLIENT_CODES, Refused, RefusedMessage, client_errors
from expertd.server.metrics.calls import GrpcMethodMetrics
from expertd.server.metrics.families import Metrics
from expertd.server.transport.auth import UNAUTHENTICATED_MESSAGE

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
TENSOR_METHODS = frozenset({
    "/expertd.v1.ExpertService/Forward", "/expertd.v1.ExpertService/Route",
    "/expertd.v1.ExpertService/ForwardStream", "/inference.GRPCInferenceService/ModelInfer"})
"""Methods whose requests carry token tensors; their limit is the largest legitimate request."""
SMALL_REQUEST_BYTES = 64 * 1024
"""Every other method's request limit (model info, load, health, metadata, reflection)."""
DEADLINE_TOLERANCE_S = 0.01
_ENDED = {"DEADLINE_EXCEEDED": "the call's deadline passed", "CANCELLED": "the client cancelled or went away"}
Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]
"""A registration wrapper: (method, handler) -> the handler served instead (``WrappingServer``)."""
HANDLER_FACTORIES = {
    "unary": grpc.unary_unary_rpc_method_handler,
    "server_stream": grpc.unary_stream_rpc_method_handler,
    "client_stream": grpc.stream_unary_rpc_method_handler,
    "bidi_stream": grpc.stream_stream_rpc_method_handler,
}


def split_method(method: str) -> tuple[str, str]:
    """``/expertd.v1.ExpertService/Forward`` -> (``expertd.v1.ExpertService``, ``Forward``)."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


def grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _original(handler: grpc.RpcMethodHandler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def undecodable_message(type_name: str) -> str:
    """The status message of a call whose bytes do not parse as its ``type_name`` message (every
    transport's: the native port's C++ is given it at start)."""
    return f"request is not a valid {type_name} message"


def guarded(deserializer, limit: int | None):
    """``deserializer`` that refuses (never raises): over ``limit`` bytes unparsed, or bytes that do not parse."""
    type_name = getattr(getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None), "full_name", "request")

    def deserialize(raw: bytes):
        if limit is not None and len(raw) > limit:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request message of {len(raw)} bytes is larger than "
                           f"this method's limit of {limit} bytes", "too_large")
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - any parse failure is the client's bytes, answered as such
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, undecodable_message(type_name), "undecodable")

    return deserialize


def _deadline_of(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _final_code(context, error: BaseException | None, deadline: float | None) -> str:
    """The status the call ended with: what the handler set or aborted with; DEADLINE_EXCEEDED when
    it ended at its deadline; CANCELLED when the client went away; UNKNOWN for an escaped exception."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    if deadline is not None and time.monotonic() >= deadline - DEADLINE_TOLERANCE_S:
        return "DEADLINE_EXCEEDED"
    if isinstance(error, (asyncio.CancelledError, grpc.aio.UsageError)):
        return "CANCELLED"
    return "UNKNOWN"


class _Call:
    """One call's bookkeeping: counted at its start, its end counted, timed and (when the client
    caused a failure) logged once, rate-limited."""

    __slots__ = ("series", "method", "context", "started", "deadline")

    def __init__(self, series: GrpcMethodMetrics, method: str, context):
        self.series, self.method, self.context = series, method, context
        self.started, self.deadline = time.perf_counter(), _deadline_of(context)
        series.started.inc()

    def end(self, error: BaseException | None) -> None:
        code = _final_code(self.context, error, self.deadline)
        self.series.handled(code, time.perf_counter() - self.started)
        if code in CLIENT_CODES:
            client_errors.note(code, f"{self.method}: {self.context.details() or _ENDED.get(code, code)}")


def _refuse(context, refused: Refused, metrics: Metrics) -> None:
    """Give the call the refusal's status, sent when the handler returns (set, not raised: as
    ``errors.run_unary``)."""
    metrics.observe_refused_call(refused.reason)
    context.set_code(refused.code)
    context.set_details(refused.message)


def metered(method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics, metrics: Metrics):
    """The method's behavior with its call counted and a Refused request answered with its status."""
    inner, streaming_in = _original(handler), handler.request_streaming

    async def checked(requests):
        async for request in requests:
            if type(request) is Refused:
                raise RefusedMessage(request)
            series.received.inc()
            yield request

    def begin(request):
        if streaming_in:
            return checked(request)
        if type(request) is Refused:
            raise RefusedMessage(request)
        series.received.inc()
        return request

    if handler.response_streaming and inspect.isasyncgenfunction(inner):
        async def behavior(request, context):
            call, error = _Call(series, method, context), None
            try:
                async for response in inner(begin(request), context):
                    series.sent.inc()
                    yield response
            except RefusedMessage as exc:
                _refuse(context, exc.refused, metrics)
            except BaseException as exc:
                error = exc
                raise
            finally:
                call.end(error)
    else:
        response_streaming = handler.response_streaming
        # decided once: an ABC isinstance test per call (inspect.isawaitable) is not free
        is_async = inspect.iscoroutinefunction(inner)

        async def behavior(request, context):
            call, error = _Call(series, method, context), None
            try:
                response = inner(begin(request), context)
                if is_async or inspect.isawaitable(response):
                    response = await response
                if not response_streaming and response is not None:
                    series.sent.inc()
                return response
            except RefusedMessage as exc:
                _refuse(context, exc.refused, metrics)
            except BaseException as exc:
                error = exc
                raise
            finally:
                call.end(error)

    return behavior


def denied(method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics, metrics: Metrics):
    """A handler for unauthenticated calls of ``method``: request-streaming, so gRPC does not read
    the request before it runs, and it never reads it; it answers UNAUTHENTICATED at once."""

    async def deny(request_iterator, context):
        call = _Call(series, method, context)
        metrics.observe_refused_call("unauthenticated")
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(UNAUTHENTICATED_MESSAGE)
        call.end(None)

    factory = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
        else grpc.stream_unary_rpc_method_handler
    return factory(deny, response_serializer=handler.response_serializer)
