"""What every gRPC method gets on top of its servicer: bearer-token auth before the body is read,
per-method message limits before it is parsed, and the ``grpc_server_*`` metrics.

All of it is applied once, when a service registers its handlers, not per call: ``wrapping(server,
metrics, token, max_request_bytes=...)`` returns a stand-in for the grpc.aio server that every
``add_*_to_server`` function is given. It keeps every method in one generic handler (``_Router``)
registered on the real server; grpc.aio asks it for a method's handler when a call starts, with
the call's metadata and before the request message is read, so that:

- Auth: a call to a method outside ``OPEN_SERVICES`` without ``authorization: Bearer <token>``
  (scheme in any case, RFC 7235) gets a handler that never reads the request and answers
  UNAUTHENTICATED at once: a client without the token cannot make the server read a body.
- Limits: each method's request deserializer is wrapped (``_guarded``): a message over the
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
would await a coroutine per interceptor and rebuild the handler on every call (what that costs:
BENCHMARKS.md, Serving). Health is open: Kubernetes probes cannot send metadata.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Callable

import grpc

from expertd.server.errors import CLIENT_CODES, client_errors, quiet_grpc_client_errors
from expertd.server.metrics.calls import GrpcMethodMetrics
from expertd.server.metrics.families import Metrics
from expertd.server.transport.auth import UNAUTHENTICATED_MESSAGE, authorized, has_key, parse_token

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
_FACTORIES = {
    "unary": grpc.unary_unary_rpc_method_handler,
    "server_stream": grpc.unary_stream_rpc_method_handler,
    "client_stream": grpc.stream_unary_rpc_method_handler,
    "bidi_stream": grpc.stream_stream_rpc_method_handler,
}


@dataclasses.dataclass(frozen=True)
class Refused:
    """What a guarded deserializer hands the method instead of a message it would not parse."""

    code: grpc.StatusCode
    message: str
    reason: str  # too_large | undecodable


class RefusedMessage(Exception):
    """A streamed request message was refused: the call ends with its status."""

    def __init__(self, refused: Refused):
        super().__init__(refused.message)
        self.refused = refused


def _split(method: str) -> tuple[str, str]:
    """``/expertd.v1.ExpertService/Forward`` -> (``expertd.v1.ExpertService``, ``Forward``)."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


def _grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _original(handler: grpc.RpcMethodHandler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def _guarded(deserializer, limit: int | None):
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
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {type_name} message",
                           "undecodable")

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


def _behavior(method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics, metrics: Metrics):
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


def _deny(method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics, metrics: Metrics):
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


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A method's handlers, built once: the wrapped one, the one for unauthenticated calls, and the
    one for authorized calls that carry a metadata key (``add_early``)."""

    source: grpc.RpcMethodHandler
    handler: grpc.RpcMethodHandler
    deny: grpc.RpcMethodHandler | None  # None: an open method
    early: tuple[str, grpc.RpcMethodHandler] | None = None


class _Router(grpc.GenericRpcHandler):
    """Every method of every service registered through the stand-in (see module docstring)."""

    def __init__(self, metrics: Metrics, token: str | None, max_request_bytes: int | None):
        self._metrics = metrics
        self._expected = parse_token(token) if token is not None else None
        self._max_request_bytes = max_request_bytes
        self._entries: dict[str, _Entry] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    def add(self, method: str, handler: grpc.RpcMethodHandler) -> None:
        self._entries[method] = self._entry(method, handler)

    def add_generic(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_early(self, method: str, key: str, handler: grpc.RpcMethodHandler) -> None:
        """Serve the authorized calls of ``method`` (registered already) that carry metadata ``key``
        with ``handler``, a request-streaming one: gRPC does not read the request before it runs, so
        it can decide from the metadata before it reads the message (counted as ``method``'s calls)."""
        entry = self._entries[method]
        series = self._metrics.grpc_method((_grpc_type(entry.source), *_split(method)))
        self._entries[method] = dataclasses.replace(entry, early=(key, self._wrapped(method, handler, series)))

    def _entry(self, method: str, handler: grpc.RpcMethodHandler) -> _Entry:
        service, name = _split(method)
        series = self._metrics.grpc_method((_grpc_type(handler), service, name))
        open_method = self._expected is None or service in OPEN_SERVICES
        return _Entry(handler, self._wrapped(method, handler, series),
                      None if open_method else _deny(method, handler, series, self._metrics))

    def _wrapped(self, method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics):
        limit = self._max_request_bytes if method in TENSOR_METHODS else SMALL_REQUEST_BYTES
        return _FACTORIES[_grpc_type(handler)](_behavior(method, handler, series, self._metrics),
                                               request_deserializer=_guarded(handler.request_deserializer, limit),
                                               response_serializer=handler.response_serializer)

    def service(self, handler_call_details):
        method = handler_call_details.method
        entry = self._entries.get(method)
        if entry is None:
            entry = self._from_generic(handler_call_details)
            if entry is None:
                return None
        metadata = handler_call_details.invocation_metadata
        if entry.deny is not None and not authorized(metadata, self._expected):
            return entry.deny
        if entry.early is not None and has_key(metadata, entry.early[0]):
            return entry.early[1]
        return entry.handler

    def _from_generic(self, handler_call_details) -> _Entry | None:
        """A method only a generic handler knows: wrapped the first time, cached while its handler stays."""
        for generic in self._generic:
            handler = generic.service(handler_call_details)
            if handler is not None:
                method = handler_call_details.method
                entry = self._entries.get(method)
                if entry is None or entry.source is not handler:
                    entry = self._entries[method] = self._entry(method, handler)
                return entry
        return None


class RoutedServer:
    """A grpc.aio server stand-in for ``add_*_to_server``: every method handler registered through
    it (method dicts and generic handlers alike) is served by one ``_Router`` on the real server."""

    def __init__(self, server: grpc.aio.Server, router: _Router):
        self._server = server
        self._router = router
        server.add_generic_rpc_handlers((router,))

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        for name, handler in method_handlers.items():
            self._router.add(f"/{service}/{name}", handler)

    def add_early_handler(self, method: str, key: str, handler: grpc.RpcMethodHandler) -> None:
        """``method``'s calls that carry metadata ``key`` go to ``handler`` (``_Router.add_early``)."""
        self._router.add_early(method, key, handler)

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._router.add_generic(handlers)

    def __getattr__(self, name):  # everything else (ports, start, stop...) is the real server's
        return getattr(self._server, name)


class WrappingServer:
    """A stand-in that passes every method handler registered through it through ``wraps`` (each a
    ``Wrap``, innermost first) before registering it on ``server`` (the real server or another
    stand-in, such as ``wrapping``'s). A generic handler is wrapped lazily, per method, and cached."""

    def __init__(self, server, wraps: list[Wrap]):
        self._server = server
        self._wraps = wraps

    def wrap(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if handler is None:
            return None
        for wrap in self._wraps:
            handler = wrap(method, handler)
        return handler

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self.wrap(f"/{service}/{name}", handler) for name, handler in method_handlers.items()})

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_WrappedGeneric(h, self.wrap) for h in handlers))

    def add_early_handler(self, method: str, key: str, handler: grpc.RpcMethodHandler) -> None:
        self._server.add_early_handler(method, key, self.wrap(method, handler))

    def __getattr__(self, name):
        return getattr(self._server, name)


class _WrappedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Wrap):
        self._inner, self._wrap = inner, wrap
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._cache.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._cache[method] = (handler, self._wrap(method, handler))
        return cached[1]


def wrapping(server: grpc.aio.Server, metrics: Metrics, token: str | None, *,
             max_request_bytes: int | None = None) -> RoutedServer:
    """The stand-in through which expertd registers every service (see module docstring); further
    registration wrappers go in front of it (``WrappingServer(wrapping(...), wraps)``).

    Args:
      server: the grpc.aio server (its ``grpc.max_receive_message_length`` is the server-wide limit).
      metrics: where calls are counted.
      token: the bearer token every method outside OPEN_SERVICES requires, or None for no auth
        (ValueError for an empty, blank or unsendable token).
      max_request_bytes: the request limit of ``TENSOR_METHODS`` (None: only the server-wide one).
    """
    quiet_grpc_client_errors()
    return RoutedServer(server, _Router(metrics, token, max_request_bytes))
