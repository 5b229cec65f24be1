"""ExpertClient: the blocking Python client of ``expertd.v1.ExpertService``.

    from expertd.client import ExpertClient
    with ExpertClient("localhost:8001", timeout=10) as client:
        client.wait_ready(timeout=60)
        y = client.forward(x, layer=0)            # x [T, H] float32 / bfloat16 -> y [T, H], same dtype
        r = client.route(x, layer=0)              # r.topk_ids [T, k], r.topk_weights [T, k], r.aux_loss

The target is one server or its replicas (``"host:port"``, ``"host1:port,host2:port"``,
``"dns:///name:port"``: :mod:`expertd.client.channel`). Calls are balanced round-robin over the
replicas whose health is SERVING. Unary calls are retried with exponential backoff on UNAVAILABLE
(by gRPC's retry policy, on another replica: at most 4 retries) and on RESOURCE_EXHAUSTED (by the
client, honouring the server's RetryInfo hint); every other failure raises at once. Failures raise
the typed exceptions of :mod:`expertd.client.errors`, carrying the server's message. A large
Forward declares its size in its metadata, and while the server pushes back its body waits until
the call is admitted (:mod:`expertd.client.admission`). While the server refuses more than half of
the Forward and Route calls, the client refuses some itself, unsent (:mod:`expertd.client.throttle`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import grpc
import numpy as np
from grpc_health.v1 import health_pb2

from expertd.client import errors, messages
from expertd.client.channel import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_MESSAGE_BYTES,
    Backoff,
    ClientBase,
    TlsOptions,
)
from expertd.client.pb.v1 import expert_pb2
from expertd.client.throttle import DEFAULT_THROTTLE, AdaptiveThrottle, Throttle


class ExpertClient(ClientBase):
    """Blocking client. Thread-safe: one client (one HTTP/2 channel) can serve many threads.

    Args:
      target: ``host:port``, ``host1:port1,host2:port2,...`` or ``dns:///name:port`` (replicas of
        one server; see :mod:`expertd.client.channel`).
      timeout: deadline in seconds of each unary call, its UNAVAILABLE retries included; each
        RESOURCE_EXHAUSTED retry gets a new one (None: no deadline).
      retries: extra attempts after UNAVAILABLE (gRPC's retry policy, at most 4; an idempotent
        call lost in transport after its replica began answering, once more by the client's own
        loop) or RESOURCE_EXHAUSTED (the client's own loop); 0 disables all.
      tls: False (plaintext), True (TLS with the system roots) or :class:`TlsOptions` (own CA,
        mutual TLS with a client certificate, server-name override).
      token: bearer token sent as ``authorization: Bearer <token>`` on every call.
      max_message_bytes: largest message sent or received.
      backoff: retry backoff schedule.
      throttle: client-side throttling of Forward and Route while the server refuses most of them:
        its settings (:class:`~expertd.client.throttle.Throttle`), an ``AdaptiveThrottle`` shared
        with other clients, or None (no throttling).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 30.0,
        retries: int = 3,
        tls: bool | TlsOptions = False,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        backoff: Backoff = DEFAULT_BACKOFF,
        throttle: Throttle | AdaptiveThrottle | None = DEFAULT_THROTTLE,
    ):
        super().__init__(
            target,
            aio=False,
            timeout=timeout,
            retries=retries,
            tls=tls,
            token=token,
            max_message_bytes=max_message_bytes,
            backoff=backoff,
            throttle=throttle,
        )

    def forward(self, x: np.ndarray, *, layer: int, return_routing: bool = False, timeout: float | None = None,
                token_ids=None, out=None):
        """The MoE layer's output for ``x [T, H]`` (float32, bfloat16 or float16).

        Returns ``y [T, H]`` in x's dtype, or a :class:`ForwardResult` (output + routing) when
        ``return_routing`` is set. ``token_ids``: the tokens' vocabulary ids ``[T]`` (int32 range;
        hash-routed layers need them, other layers ignore them). Same host: ``x`` may be a
        :class:`~expertd.client.shared_memory.SharedTensor` of a registered region, and ``out=`` one
        the server writes the output into (then returned: ``out.array``); docs/shared-memory.md.
        """
        request = messages.forward_request(x, layer, return_routing, token_ids=token_ids, out=out)
        method, metadata = self._forward_call(request)
        response = self._unary(method, request, timeout, metadata=metadata, throttled=True, idempotent=True)
        result = messages.forward_result(response, out)
        return result if return_routing else result.output

    def route(
        self,
        hidden_states: np.ndarray | None = None,
        *,
        layer: int,
        logits: np.ndarray | None = None,
        aux_loss_coeff: float | None = None,
        timeout: float | None = None,
        token_ids=None,
    ) -> messages.RouteResult:
        """The router's decisions for ``hidden_states [T, H]`` or for router ``logits= [T, E]``
        (``token_ids [T]`` as in ``forward``)."""
        request = messages.route_request(hidden_states, logits, layer, aux_loss_coeff, token_ids)
        return messages.route_result(self._unary(self._stub.Route, request, timeout, throttled=True, idempotent=True))

    def forward_stream(
        self,
        items: Iterable[np.ndarray | tuple[str, np.ndarray]],
        *,
        layer: int,
        return_routing: bool = False,
        timeout: float | None = None,
    ) -> Iterator[messages.StreamResult]:
        """Send many ``[T, H]`` micro-batches on one call; yields a StreamResult per item, in order.

        Items are arrays (request ids "0", "1", ... are assigned), ``(request_id, array)`` pairs or
        ``(request_id, array, token_ids)`` triples. A failed item yields a StreamResult with
        ``error`` set; a failure of the whole call raises. ``timeout`` bounds the whole stream
        (default: none). Not retried.
        """
        encode_failures: list[Exception] = []

        def requests():
            # gRPC consumes this on its own thread; a bad item is re-raised in the caller's thread.
            try:
                yield from messages.stream_requests(items, layer, return_routing)
            except Exception as exc:  # noqa: BLE001 - handed to the caller below
                encode_failures.append(exc)

        call = self._stub.ForwardStream(requests(), timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield messages.stream_result(response)
        except grpc.RpcError as error:
            raise errors.from_rpc_error(error) from None
        finally:
            call.cancel()
        if encode_failures:
            raise encode_failures[0]

    def register_shared_memory(self, region, *, timeout: float | None = None) -> None:
        """Register a :class:`~expertd.client.shared_memory.SharedMemoryRegion` (or a
        ``RegisterSharedMemoryRequest``: name, key, offset, byte_size) with the server."""
        self._unary(self._stub.RegisterSharedMemory, messages.register_request(region), timeout)

    def unregister_shared_memory(self, name: str = "", *, timeout: float | None = None) -> None:
        """Unregister region ``name`` (every region when empty)."""
        self._unary(self._stub.UnregisterSharedMemory, expert_pb2.UnregisterSharedMemoryRequest(name=name), timeout)

    def shared_memory_status(self, name: str = "", *, timeout: float | None = None) -> list:
        """The registered regions (RegisterSharedMemoryRequest messages), or region ``name``."""
        request = expert_pb2.GetSharedMemoryStatusRequest(name=name)
        return list(self._unary(self._stub.GetSharedMemoryStatus, request, timeout).regions)

    def model_info(self, *, timeout: float | None = None) -> expert_pb2.GetModelInfoResponse:
        """The layers served (shapes, router settings), dtype, token buckets and mesh."""
        return self._unary(self._stub.GetModelInfo, expert_pb2.GetModelInfoRequest(), timeout, idempotent=True)

    def expert_load(self, layers: Iterable[int] = (), *, timeout: float | None = None) -> dict[int,
                                                                                               messages.ExpertLoad]:
        """Tokens routed to each expert per layer (all layers when ``layers`` is empty)."""
        request = expert_pb2.GetExpertLoadRequest(layers=list(layers))
        return messages.expert_loads(self._unary(self._stub.GetExpertLoad, request, timeout, idempotent=True))

    def health(self, service: str = "", *, timeout: float | None = None) -> int:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server): a HealthCheckResponse.ServingStatus.

        Asked over the probe channel (no health checking), so a server that is not SERVING answers
        too; with several replicas, the next one in round-robin order answers.
        """
        request = health_pb2.HealthCheckRequest(service=service)
        return self._unary(self.probe().Check, request, timeout, retry=False).status

    def wait_ready(self, timeout: float = 60.0, *, service: str = "") -> None:
        """Block until the server's health for ``service`` is SERVING (raises TimeoutError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.target} not SERVING after {timeout:g}s (last: {last})")
            try:
                status = self.health(service, timeout=min(remaining, 2.0))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except errors.ExpertError as error:
                last = str(error)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        for channel in self._channels():
            channel.close()

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _unary(self, method, request, timeout: float | None, *, retry: bool = True, metadata=(),
               throttled: bool = False, idempotent: bool = False):
        """One unary call, retried as ``ClientBase._retry_delay`` says; ``throttled``: a call the
        server admits by cost, subject to client-side throttling (``ClientBase._refused_here``);
        ``idempotent``: one that may run twice (``channel.IDEMPOTENT_METHODS``)."""
        timeout = self._timeout if timeout is None else timeout
        metadata = self._metadata + metadata if metadata else self._metadata
        retries = self._retries if retry else 0
        attempt = 0
        while True:
            error = self._refused_here(attempt) if throttled else None
            if error is None:
                try:
                    response = method(request, timeout=timeout, metadata=metadata)
                except grpc.RpcError as rpc_error:
                    error = errors.from_rpc_error(rpc_error)
                if throttled:
                    self._answered(error)
                if error is None:
                    return response
            time.sleep(self._retry_delay(error, attempt, retries, idempotent))
            attempt += 1
