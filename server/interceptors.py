"""What every gRPC method gets on top of its servicer: the ``grpc_server_*`` metrics and bearer-token auth.

Both are applied once, when a service registers its handlers, not per call: ``wrapping(server,
metrics, token)`` returns a stand-in for the grpc.aio server that every ``add_*_to_server``
function is given. It wraps each method handler in a behavior that counts the call and checks
the token, then hands it to the real server. Rule: nothing per call that can be done once per
method; grpc.aio's own ``ServerInterceptor`` chain would await a coroutine per interceptor and
rebuild the handler on every call (what that costs: BENCHMARKS.md, Serving).

These wrappers are the only place calls are counted and timed (the ``grpc_server_*`` families of
``expertd.server.metrics``).

The metrics wrapper is the outermost one, so calls that auth rejects are counted too. Health is
open: Kubernetes probes cannot send metadata.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import time
from collections.abc import Callable

import grpc

from expertd.server.metrics import Metrics

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
_FACTORIES = {
    "unary": grpc.unary_unary_rpc_method_handler,
    "server_stream": grpc.unary_stream_rpc_method_handler,
    "client_stream": grpc.stream_unary_rpc_method_handler,
    "bidi_stream": grpc.stream_stream_rpc_method_handler,
}

Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


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


def _rebuild(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as ``handler`` running ``behavior``."""
    return _FACTORIES[_grpc_type(handler)](behavior, request_deserializer=handler.request_deserializer,
                                           response_serializer=handler.response_serializer)


def _original(handler: grpc.RpcMethodHandler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


async def _unary_result(inner, request, context):
    """``inner(request, context)``'s response, awaited when the handler is a coroutine function."""
    response = inner(request, context)
    return await response if inspect.isawaitable(response) else response


def with_metrics(metrics: Metrics) -> Wrap:
    """``(method, handler) -> handler`` counting started / handled calls, handling time and messages."""

    def wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        series = metrics.grpc_method((_grpc_type(handler), *_split(method)))
        inner = _original(handler)
        streaming_in = handler.request_streaming

        async def counted_requests(requests):
            async for request in requests:
                series.received.inc()
                yield request

        def begin(request):
            series.started.inc()
            if streaming_in:
                return counted_requests(request)
            series.received.inc()
            return request

        if handler.response_streaming and inspect.isasyncgenfunction(inner):
            async def behavior(request, context):
                started, error = time.perf_counter(), None
                try:
                    async for response in inner(begin(request), context):
                        series.sent.inc()
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    series.handled(_final_code(context, error), time.perf_counter() - started)
        else:
            response_streaming = handler.response_streaming

            async def behavior(request, context):
                started, error = time.perf_counter(), None
                try:
                    response = await _unary_result(inner, begin(request), context)
                    if not response_streaming:
                        series.sent.inc()
                    return response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    series.handled(_final_code(context, error), time.perf_counter() - started)

        return _rebuild(handler, behavior)

    return wrap


def _final_code(context, error: BaseException | None) -> str:
    """The status the call ended with (what the handler set or aborted with; CANCELLED /
    DEADLINE_EXCEEDED when the client went away; UNKNOWN for an escaped exception)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    return "UNKNOWN" if error is not None else "OK"


def with_token(token: str) -> Wrap:
    """``(method, handler) -> handler`` requiring ``authorization: Bearer <token>`` (UNAUTHENTICATED
    otherwise) on every method except those of ``OPEN_SERVICES``."""
    if not token:
        raise ValueError("auth token must not be empty")
    expected = f"Bearer {token}".encode()

    def authorized(context) -> bool:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                return hmac.compare_digest(value.encode() if isinstance(value, str) else value, expected)
        return False

    async def deny(context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")

    def wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if _split(method)[0] in OPEN_SERVICES:
            return handler
        inner = _original(handler)
        if handler.response_streaming and inspect.isasyncgenfunction(inner):
            async def behavior(request, context):
                if not authorized(context):
                    await deny(context)
                async for response in inner(request, context):
                    yield response
        else:
            async def behavior(request, context):
                if not authorized(context):
                    await deny(context)
                return await _unary_result(inner, request, context)

        return _rebuild(handler, behavior)

    return wrap


class WrappingServer:
    """A grpc.aio server stand-in for ``add_*_to_server``: every method handler registered through
    it is passed through ``wraps`` (innermost first) before it reaches the real server.

    Registered method handlers (a dict per service) are wrapped at once; a generic handler is
    wrapped lazily, the first time a method is looked up, and the result is cached per method.
    """

    def __init__(self, server: grpc.aio.Server, wraps: list[Wrap]):
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
        self._server.add_generic_rpc_handlers(tuple(_WrappedGenericHandler(h, self.wrap) for h in handlers))

    def __getattr__(self, name):  # everything else (ports, start, stop...) is the real server's
        return getattr(self._server, name)


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Callable):
        self._inner = inner
        self._wrap = wrap
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


def wrapping(server: grpc.aio.Server, metrics: Metrics, token: str | None) -> WrappingServer:
    """The stand-in through which expertd registers every service: metrics outermost, then auth."""
    wraps = ([with_token(token)] if token else []) + [with_metrics(metrics)]
    return WrappingServer(server, wraps)
