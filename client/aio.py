"""AsyncExpertClient: the asyncio twin of :class:`expertd.client.ExpertClient` (``grpc.aio``).

    async with AsyncExpertClient("localhost:8001") as client:
        await client.wait_ready(timeout=60)
        y = await client.forward(x, layer=0)

Same arguments (targets: one server or its replicas), results, balancing, retries and typed
errors as the blocking client.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable

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


class AsyncExpertClient(ClientBase):
    """asyncio client; create it inside the event loop that uses it. See ExpertClient for the arguments."""

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
            aio=True,
            timeout=timeout,
            retries=retries,
            tls=tls,
            token=token,
            max_message_bytes=max_message_bytes,
            backoff=backoff,
            throttle=throttle,
        )

    async def forward(self, x: np.ndarray, *, layer: int, return_routing: bool = False, timeout: float | None = None,
                      token_ids=None, out=None):
        """``y [T, H]`` for ``x [T, H]``, or a ForwardResult (output + routing) with ``return_routing``."""
        request = messages.forward_request(x, layer, return_routing, token_ids=token_ids, out=out)
        method, metadata = self._forward_call(request)
        response = await self._unary(method, request, timeout, metadata=metadata, throttled=True, idempotent=True)
        result = messages.forward_result(response, out)
        return result if return_routing else result.output

    async def route(
        self,
        hidden_states: np.ndarray | None = None,
        *,
        layer: int,
        logits: np.ndarray | None = None,
        aux_loss_coeff: float | None = None,
        timeout: float | None = None,
        token_ids=None,
    ) -> messages.RouteResult:
        """The router's decisions for ``hidden_states [T, H]`` or for router ``logits= [T, E]``."""
        request = messages.route_request(hidden_states, logits, layer, aux_loss_coeff, token_ids)
        response = await self._unary(self._stub.Route, request, timeout, throttled=True, idempotent=True)
        return messages.route_result(response)

    async def forward_stream(
        self,
        items: AsyncIterable[np.ndarray | tuple[str, np.ndarray]] | Iterable[np.ndarray | tuple[str, np.ndarray]],
        *,
        layer: int,
        return_routing: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[messages.StreamResult]:
        """Many micro-batches on one call; yields one StreamResult per item, in order (see ExpertClient)."""
        call = self._stub.ForwardStream(metadata=self._metadata, timeout=timeout)

        async def send() -> None:
            # Half-close even when an item fails to encode, so the answers already due still come.
            try:
                index = 0
                if isinstance(items, AsyncIterable):
                    async for item in items:
                        await call.write(messages.stream_request(index, item, layer, return_routing))
                        index += 1
                else:
                    for item in items:
                        await call.write(messages.stream_request(index, item, layer, return_routing))
                        index += 1
            finally:
                await call.done_writing()

        sender = asyncio.ensure_future(send())
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                yield messages.stream_result(response)
        except grpc.RpcError as error:
            raise errors.from_rpc_error(error) from None
        finally:
            if not sender.done():
                sender.cancel()
            call.cancel()
        await sender  # re-raises an item's encoding error

    def open_forward_stream(self, *, timeout: float | None = None) -> grpc.aio.StreamStreamCall:
        """A raw ForwardStream call with this client's metadata, for callers that send messages for several
        layers on one stream and pair answers by ``request_id`` themselves (:mod:`expertd.client.pipeline`)."""
        return self._stub.ForwardStream(metadata=self._metadata, timeout=timeout)

    async def register_shared_memory(self, region, *, timeout: float | None = None) -> None:
        """See ExpertClient.register_shared_memory."""
        await self._unary(self._stub.RegisterSharedMemory, messages.register_request(region), timeout)

    async def unregister_shared_memory(self, name: str = "", *, timeout: float | None = None) -> None:
        request = expert_pb2.UnregisterSharedMemoryRequest(name=name)
        await self._unary(self._stub.UnregisterSharedMemory, request, timeout)

    async def shared_memory_status(self, name: str = "", *, timeout: float | None = None) -> list:
        request = expert_pb2.GetSharedMemoryStatusRequest(name=name)
        return list((await self._unary(self._stub.GetSharedMemoryStatus, request, timeout)).regions)

    async def model_info(self, *, timeout: float | None = None) -> expert_pb2.GetModelInfoResponse:
        return await self._unary(self._stub.GetModelInfo, expert_pb2.GetModelInfoRequest(), timeout, idempotent=True)

    async def expert_load(self, layers: Iterable[int] = (), *, timeout: float | None = None) -> dict[int,
                                                                                                     messages.ExpertLoad]:
        request = expert_pb2.GetExpertLoadRequest(layers=list(layers))
        return messages.expert_loads(await self._unary(self._stub.GetExpertLoad, request, timeout, idempotent=True))

    async def health(self, service: str = "", *, timeout: float | None = None) -> int:
        """The ``grpc.health.v1`` status of ``service``, over the probe channel (see ExpertClient.health)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return (await self._unary(self.probe().Check, request, timeout, retry=False)).status

    async def wait_ready(self, timeout: float = 60.0, *, service: str = "") -> None:
        """Wait until the health of ``service`` is SERVING (TimeoutError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.target} not SERVING after {timeout:g}s (last: {last})")
            try:
                status = await self.health(service, timeout=min(remaining, 2.0))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except errors.ExpertError as error:
                last = str(error)
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def close(self) -> None:
        for channel in self._channels():
            await channel.close()

    async def __aenter__(self) -> AsyncExpertClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _unary(self, method, request, timeout: float | None, *, retry: bool = True, metadata=(),
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
                    response = await method(request, timeout=timeout, metadata=metadata)
                except grpc.RpcError as rpc_error:
                    error = errors.from_rpc_error(rpc_error)
                if throttled:
                    self._answered(error)
                if error is None:
                    return response
            await asyncio.sleep(self._retry_delay(error, attempt, retries, idempotent))
            attempt += 1
