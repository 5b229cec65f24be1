"""``shm://NAME``: the same-host channel as a gRPC channel look-alike, for ExpertClient and AsyncExpertClient.

``ShmChannel`` (blocking) and ``AsyncShmChannel`` (asyncio) give what the clients use of a
``grpc.Channel``: ``unary_unary(path, serializer, deserializer)`` callables that take
``(request, timeout=, metadata=)`` and return the response or raise a ``grpc.RpcError``
(``ShmRpcError``: the server's code, message and rich details, as gRPC's own), so the clients'
methods, retries, throttling and typed errors are the same over either. Streams are gRPC's only
(UNIMPLEMENTED here, naming the main port). The wire format is ``expertd.client.shm_frames``.

A channel holds at most one connection, made on the first call (the ``authorization`` metadata of
that call is its HELLO token) and made again on a call after it was lost. A lost connection fails
its calls UNAVAILABLE at once; the idempotent methods (``IDEMPOTENT``) are retried on UNAVAILABLE
with the channel's backoff, ``retries`` times (gRPC's retry policy, within the call's deadline),
so a restarted server is reattached by the next call.

Connections: ``expertd.client.shm_connection`` (threads: ``Connection`` is any thread's,
``AsyncConnection`` its event loop's).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

import grpc

from expertd.client import shm_frames as wire
from expertd.client.shm_connection import AsyncConnection, Connection, ShmRpcError, error_of

SPIN_US_ENV = "EXPERTD_SHM_SPIN_US"
DEFAULT_SPIN_US = 2000.0
"""How long a blocking call alone on its connection spins on its answer before it sleeps on the
doorbell (``$EXPERTD_SHM_SPIN_US``; 0: never spin): a sleeping caller and a sleeping server each
pay a wake-up, tens of microseconds on a VM, more than the rest of the channel's round trip."""
IDEMPOTENT = frozenset(wire.METHODS[:4])  # Forward, Route, GetModelInfo, GetExpertLoad: may run twice
MAX_GRPC_RETRIES = 4  # gRPC's own cap (gRFC A6: 5 attempts)


def _token_of(metadata) -> bytes:
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


class _ChannelBase:
    def __init__(self, target: str, *, retries: int = 0, backoff=None, spin_us: float | None = None):
        self.path = wire.socket_path(wire.name_of(target) or target)
        if spin_us is None:
            try:
                spin_us = float(os.environ.get(SPIN_US_ENV, DEFAULT_SPIN_US))
            except ValueError:
                raise ValueError(f"{SPIN_US_ENV}: expected microseconds, got {os.environ[SPIN_US_ENV]!r}") from None
        if not 0 <= spin_us <= 1e6:
            raise ValueError(f"{SPIN_US_ENV}: expected 0..1000000 microseconds, got {spin_us}")
        self._spin_s = spin_us / 1e6
        self._retries, self._backoff = min(retries, MAX_GRPC_RETRIES), backoff
        self._connection = None

    def _method_id(self, path: str) -> int:
        return wire.METHOD_IDS.get(path, 0)

    def _retry_wait(self, error: ShmRpcError, path: str, attempt: int, deadline: float | None) -> float | None:
        """Seconds before the next attempt, or None: raise ``error``."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or path not in IDEMPOTENT or attempt >= self._retries:
            return None
        wait = self._backoff.delay(attempt) if self._backoff is not None else 0.05
        return None if deadline is not None and time.monotonic() + wait >= deadline else wait

    def _unimplemented(self, path: str):
        def refuse(*_args, **_kwargs):
            raise ShmRpcError(grpc.StatusCode.UNIMPLEMENTED, f"{path} is not carried by the shm channel "
                                                             "(its unary methods only: shm_frames.METHODS); call the "
                                                             "server's gRPC port")
        return refuse

    unary_stream = stream_unary = stream_stream = lambda self, path, **_: self._unimplemented(path)


class ShmChannel(_ChannelBase):
    """A blocking ``grpc.Channel`` look-alike over ``shm://NAME`` (module docstring). Thread-safe."""

    def __init__(self, target: str, *, retries: int = 0, backoff=None, spin_us: float | None = None):
        super().__init__(target, retries=retries, backoff=backoff, spin_us=spin_us)
        self._lock = threading.Lock()

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None, **_):
        method = self._method_id(path)
        if not method:
            return self._unimplemented(path)

        def call(request, timeout=None, metadata=None, **_kwargs):
            deadline = None if timeout is None else time.monotonic() + timeout
            payload = request_serializer(request)
            for attempt in itertools.count():
                try:
                    code, answer = self._connected(metadata).call(method, payload, deadline)
                except ShmRpcError as error:
                    wait = self._retry_wait(error, path, attempt, deadline)
                    if wait is None:
                        raise
                    time.sleep(wait)
                    continue
                if code:
                    raise error_of(code, answer)
                return response_deserializer(answer)
        return call

    def _connected(self, metadata) -> Connection:
        with self._lock:
            if self._connection is None or self._connection.broken:
                if self._connection is not None:
                    self._connection.close()
                self._connection = Connection(self.path, _token_of(metadata), self._spin_s)
            return self._connection

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


class AsyncShmChannel(_ChannelBase):
    """An asyncio ``grpc.aio.Channel`` look-alike over ``shm://NAME``: use it from one event loop."""

    def __init__(self, target: str, *, retries: int = 0, backoff=None, spin_us: float | None = None):
        super().__init__(target, retries=retries, backoff=backoff, spin_us=spin_us)
        self._connecting: asyncio.Lock | None = None

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None, **_):
        method = self._method_id(path)
        if not method:
            return self._unimplemented(path)

        async def call(request, timeout=None, metadata=None, **_kwargs):
            deadline = None if timeout is None else time.monotonic() + timeout
            payload = request_serializer(request)
            for attempt in itertools.count():
                try:
                    code, answer = await (await self._connected(metadata)).call(method, payload, deadline)
                except ShmRpcError as error:
                    wait = self._retry_wait(error, path, attempt, deadline)
                    if wait is None:
                        raise
                    await asyncio.sleep(wait)
                    continue
                if code:
                    raise error_of(code, answer)
                return response_deserializer(answer)
        return call

    async def _connected(self, metadata) -> AsyncConnection:
        if self._connection is not None and not self._connection.broken:
            return self._connection
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._connection is None or self._connection.broken:
                if self._connection is not None:
                    self._connection.close()
                self._connection = await AsyncConnection.open(self.path, _token_of(metadata), self._spin_s)
            return self._connection

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

