"""How services register on the gRPC server so that every method is wrapped once
(``expertd.server.transport.interceptors``: auth, limits, metrics).

``wrapping(server, metrics, token, max_request_bytes=...)`` gives the stand-in every
``add_*_to_server`` function is handed: it keeps every method in one generic handler (``_Router``)
on the real server, which grpc.aio asks for a method's handler when a call starts (with its
metadata, before the request message is read). ``WrappingServer`` applies further per-method
wraps (the drain's stream inputs) before that; ``add_early_handler`` registers a method's
header-first handler (Forward's ``expertd-admission``).
"""
from __future__ import annotations

import dataclasses

import grpc

from expertd.server.errors import quiet_grpc_client_errors
from expertd.server.metrics.calls import GrpcMethodMetrics
from expertd.server.metrics.families import Metrics
from expertd.server.transport.auth import authorized, has_key, parse_token
from expertd.server.transport.interceptors import (
    HANDLER_FACTORIES,
    OPEN_SERVICES,
    SMALL_REQUEST_BYTES,
    TENSOR_METHODS,
    Wrap,
    denied,
    grpc_type,
    guarded,
    metered,
    split_method,
)


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
        series = self._metrics.grpc_method((grpc_type(entry.source), *split_method(method)))
        self._entries[method] = dataclasses.replace(entry, early=(key, self._wrapped(method, handler, series)))

    def _entry(self, method: str, handler: grpc.RpcMethodHandler) -> _Entry:
        service, name = split_method(method)
        series = self._metrics.grpc_method((grpc_type(handler), service, name))
        open_method = self._expected is None or service in OPEN_SERVICES
        return _Entry(handler, self._wrapped(method, handler, series),
                      None if open_method else denied(method, handler, series, self._metrics))

    def _wrapped(self, method: str, handler: grpc.RpcMethodHandler, series: GrpcMethodMetrics):
        limit = self._max_request_bytes if method in TENSOR_METHODS else SMALL_REQUEST_BYTES
        return HANDLER_FACTORIES[grpc_type(handler)](metered(method, handler, series, self._metrics),
                                               request_deserializer=guarded(handler.request_deserializer, limit),
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
