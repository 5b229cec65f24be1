"""What a drain has to end itself: health Watch calls and the input of request-streaming calls.

``grpc.aio.Server.stop(grace)`` waits for every open call, and a health Watch or an idle
ForwardStream never ends on its own: one of them would hold the process for the whole grace.

- ``HealthServicer``: ``grpc.health.v1`` (Check, Watch) for grpc.aio. ``enter_graceful_shutdown``
  sets every service NOT_SERVING for good, and every Watch receives it at once. Watches stay open
  through the drain (a client whose Watch ends starts a new one immediately, so ending them early
  would only make clients spin); ``end_watches`` ends them all just before the gRPC server stops.
- ``StreamInputs``: a registration wrapper (a ``Wrap`` of ``expertd.server.transport.interceptors``) for the
  methods whose request is a stream (ForwardStream, reflection). ``close`` ends the input of every
  open call, and of every call opened later, as if its client had half-closed: the servicer
  answers what it has read and returns, and the call then ends UNAVAILABLE ("draining": the rest
  belongs to another replica) unless its client had half-closed itself.
"""
from __future__ import annotations

import asyncio
import inspect

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
DRAINING = "draining: the server is shutting down; send the rest of the stream to another replica"


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` whose statuses the server sets and whose Watches a drain can end."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._shutting_down = False
        self._ending = False

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, _unknown(request.service))
        return health_pb2.HealthCheckResponse(status=status)

    def unary_methods(self) -> dict[str, tuple[type, object]]:
        """{path: (request class, ``async handler(message, deadline)``)}: Check, for the same-host channel."""
        return {"/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest, self.check)}

    async def check(self, request: health_pb2.HealthCheckRequest, _deadline=None) -> health_pb2.HealthCheckResponse:
        """Check for another transport (the same-host channel): LookupError (NOT_FOUND) for an unknown service."""
        status = self._status.get(request.service)
        if status is None:
            raise LookupError(_unknown(request.service))
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """The status now, then every change, until ``end_watches``; SERVICE_UNKNOWN for an unknown name."""
        last = None
        while True:
            async with self._changed:
                while not self._ending and self._status.get(request.service, SERVICE_UNKNOWN) == last:
                    await self._changed.wait()
                status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:  # written outside the lock: a slow reader never blocks ``set``
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._ending:
                return

    async def set(self, service: str, status: int) -> None:
        """Set ``service``'s status (ignored once the drain began: everything stays NOT_SERVING)."""
        async with self._changed:
            if not self._shutting_down:
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; open Watches receive it at once."""
        async with self._changed:
            self._shutting_down = True
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """End every open Watch (and any opened later) after it has sent the latest status."""
        async with self._changed:
            self._ending = True
            self._changed.notify_all()


def _unknown(service: str) -> str:
    return f"health service {service!r} is not one this server reports"


class StreamInputs:
    """The request streams of open calls, which ``close`` ends (see module docstring)."""

    def __init__(self) -> None:
        self._open: set[_Input] = set()
        self.closed = False

    def close(self) -> None:
        """End every open request stream, and the streams of calls opened from now on."""
        self.closed = True
        for stream in list(self._open):
            stream.close()

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``(method, handler) -> handler``: request-streaming handlers read through a closable input."""
        if not handler.request_streaming:
            return handler
        inner = handler.stream_stream or handler.stream_unary
        factory = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler

        if handler.response_streaming and inspect.isasyncgenfunction(inner):
            async def behavior(requests, context):
                stream = self._track(requests)
                try:
                    async for response in inner(stream, context):
                        yield response
                finally:
                    self._open.discard(stream)
                if stream.cut:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        else:
            async def behavior(requests, context):
                stream = self._track(requests)
                try:
                    response = inner(stream, context)
                    response = await response if inspect.isawaitable(response) else response
                finally:
                    self._open.discard(stream)
                if stream.cut:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
                return response

        return factory(behavior, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)

    def _track(self, requests) -> _Input:
        stream = _Input(requests)
        if self.closed:
            stream.close()
        else:
            self._open.add(stream)
        return stream


class _Input:
    """An async iterator over a call's requests that ``close`` ends. A read in progress is ended by
    cancelling the task awaiting it (the cancellation is taken back here, so it goes no further);
    ``cut`` says the input ended this way rather than by the client's half-close."""

    def __init__(self, requests) -> None:
        self._requests = requests.__aiter__()
        self._reader: asyncio.Task | None = None
        self._closed = False
        self._ended = False
        self.cut = False

    def close(self) -> None:
        if self._closed or self._ended:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()

    def __aiter__(self) -> _Input:
        return self

    async def __anext__(self):
        if self._closed:
            self.cut = True
            raise StopAsyncIteration
        self._reader = asyncio.current_task()
        try:
            return await self._requests.__anext__()
        except StopAsyncIteration:
            self._ended = True
            raise
        except asyncio.CancelledError:
            if not self._closed:
                raise
            self._reader.uncancel()
            self.cut = True
            raise StopAsyncIteration from None
        finally:
            self._reader = None
