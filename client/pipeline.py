"""Micro-batch overlap for the attention side: m micro-batches of one decode step in flight across
the MoE layers ("ping-pong"), so that the attention side computes micro-batch i while the expert
server computes micro-batch j and neither side waits.

    async with AsyncExpertClient("localhost:8001") as client:
        async with Pipeline(client, layers=[0, 1, 2, 3]) as pipeline:
            parts = split_micro_batches(x, 3)              # x [T, H] -> 3 arrays [~T/3, H]
            outs = await pipeline.run_step(parts, attention)
            y = np.concatenate(outs)                       # [T, H], rows in x's order

One decode step of micro-batch i runs, for each MoE layer l of ``layers`` in order::

    x_i = attention(l, i, x_i)     # the caller's part of the model before layer l's MoE block
    x_i = Forward(l, x_i)          # the MoE block on the expert server

``attention(layer, micro_batch, x [T_i, H]) -> [T_i, H]`` may be a plain function or a coroutine
function. A plain function runs on the event loop, so one micro-batch's attention runs at a time
(as on one accelerator) while the other micro-batches' expert calls are in flight; a coroutine
function can await a device or a thread instead. Residuals and caches are the caller's state.

Rules: outputs come back in micro-batch order and equal a run with one micro-batch (each token's
expert call sees the same input). When any expert call or attention call fails, the others are
cancelled, a stream transport's call is cancelled too, and ``run_step`` raises that first error
(a typed :class:`~expertd.client.errors.ExpertError` for the server's failures); nothing is left
running. Each expert call has a deadline of ``timeout`` seconds.

Transports (``transport=``), all on the client's one channel:
- ``"unary"``: one Forward call per (micro-batch, layer); retried as the client is configured
  (UNAVAILABLE, RESOURCE_EXHAUSTED).
- ``"stream"``: one ForwardStream per pipeline carrying every layer's messages, answers paired by
  ``request_id``; not retried (a broken stream fails the calls in flight; the next call opens a
  new stream).
- ``"layer-streams"``: one such ForwardStream per layer.
``DEFAULT_TRANSPORT`` is unary, the one transport that is retried; ``benchmarks/disaggregated.py``
measures the three (docs/attention.md, BENCHMARKS.md).
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Awaitable, Callable, Sequence

import grpc
import numpy as np

from expertd.client import errors, messages
from expertd.client.aio import AsyncExpertClient

TRANSPORTS = ("unary", "stream", "layer-streams")
DEFAULT_TRANSPORT = "unary"

AttentionFn = Callable[[int, int, np.ndarray], "np.ndarray | Awaitable[np.ndarray]"]


def split_micro_batches(x: np.ndarray, micro_batches: int) -> list[np.ndarray]:
    """``x [T, H]`` as ``micro_batches`` consecutive row blocks whose sizes differ by at most one."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {x.shape}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or not 1 <= micro_batches <= len(x):
        raise ValueError(f"micro_batches must be an int between 1 and the {len(x)} tokens of x, got {micro_batches!r}")
    return np.array_split(x, micro_batches)


class Pipeline:
    """Runs decode steps of m micro-batches through the MoE ``layers`` of one expert server.

    Args:
      client: an AsyncExpertClient (the pipeline does not close it).
      layers: the model's MoE layer indices, in the order a step visits them.
      transport: ``"unary"``, ``"stream"`` or ``"layer-streams"`` (module docstring).
      timeout: deadline in seconds of each expert call (None: none).
    """

    def __init__(self, client: AsyncExpertClient, layers: Sequence[int], *, transport: str = DEFAULT_TRANSPORT,
                 timeout: float | None = 30.0):
        layers = list(layers)
        if not layers or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in layers):
            raise ValueError(f"layers must be a non-empty list of non-negative layer indices, got {layers!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.client = client
        self.layers = [int(i) for i in layers]
        self.transport = transport
        self.timeout = timeout
        self._streams: dict[int | None, _Stream] = {}

    async def forward(self, x: np.ndarray, layer: int) -> np.ndarray:
        """One expert call over the pipeline's transport: ``x [T, H]`` -> ``[T, H]``, x's dtype."""
        if self.transport == "unary":
            return await self.client.forward(x, layer=layer, timeout=self.timeout)
        key = layer if self.transport == "layer-streams" else None
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream(self.client)
        return await stream.forward(x, layer, self.timeout)

    async def run_step(self, hidden: Sequence[np.ndarray], attention: AttentionFn) -> list[np.ndarray]:
        """One decode step: ``hidden`` holds one ``[T_i, H]`` array per micro-batch (m = len(hidden));
        returns each micro-batch's output of the last MoE layer, ``[T_i, H]``, in micro-batch order."""
        hidden = list(hidden)
        if not hidden:
            raise ValueError("hidden must hold at least one micro-batch [T_i, H]")
        for i, x in enumerate(hidden):
            if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != hidden[0].shape[1] or not len(x):
                raise ValueError(f"hidden[{i}] must be a non-empty 2-D array [T_i, H] with the H of hidden[0], "
                                 f"got {getattr(x, 'shape', type(x).__name__)}")
        if not callable(attention):
            raise TypeError(f"attention must be callable (layer, micro_batch, x) -> x, got {type(attention).__name__}")
        tasks = [asyncio.ensure_future(self._micro_batch(i, x, attention)) for i, x in enumerate(hidden)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # also when the caller cancels run_step
            unfinished = any(not task.done() for task in tasks)
            await _cancel(tasks)
            failed = [task for task in tasks if not task.cancelled() and task.exception() is not None]
            if unfinished or failed:
                await self._abort()
        if failed:
            raise failed[0].exception()
        return [task.result() for task in tasks]

    async def close(self) -> None:
        """Ends the pipeline's streams: answers still due are awaited (up to ``timeout``), then cancelled."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close(self.timeout)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _micro_batch(self, index: int, x: np.ndarray, attention: AttentionFn) -> np.ndarray:
        for layer in self.layers:
            out = attention(layer, index, x)
            if inspect.isawaitable(out):
                out = await out
            if not isinstance(out, np.ndarray) or out.shape != x.shape:
                raise ValueError(f"attention(layer={layer}, micro_batch={index}) must return an array of shape "
                                 f"{x.shape}, got {getattr(out, 'shape', type(out).__name__)}")
            x = await self.forward(out, layer)
        return x

    async def _abort(self) -> None:
        """Cancels the streams and what is in flight on them (run_step failed or was cancelled)."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.abort()


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel the tasks still running and wait until every one has finished."""
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Stream:
    """One ForwardStream shared by many callers: a sender task writes the requests in the order they
    are queued, a reader task hands each answer to the future waiting for its ``request_id``. A call
    that breaks fails its waiting futures; the next ``forward`` opens a new call."""

    def __init__(self, client: AsyncExpertClient):
        self._client = client
        self._ids = itertools.count()
        self._call: _StreamCall | None = None

    async def forward(self, x: np.ndarray, layer: int, timeout: float | None) -> np.ndarray:
        request_id = str(next(self._ids))
        request = messages.forward_request(x, layer, False, request_id=request_id)  # bad input raises here
        if self._call is None or self._call.broken:
            self._call = _StreamCall(self._client)
        call = self._call
        future = call.submit(request_id, request)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise errors.error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no answer from ForwardStream for layer {layer} within {timeout:g}s") from None
        finally:
            call.waiting.pop(request_id, None)

    async def close(self, timeout: float | None) -> None:
        call, self._call = self._call, None
        if call is not None:
            await call.close(timeout)

    async def abort(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            await call.abort()


class _StreamCall:
    """The tasks and waiting futures of one ForwardStream call."""

    def __init__(self, client: AsyncExpertClient):
        self.call = client.open_forward_stream()
        self.outbox: asyncio.Queue = asyncio.Queue()  # requests, then None to half-close
        self.waiting: dict[str, asyncio.Future] = {}
        self.broken = False
        self.sender = asyncio.ensure_future(self._send())
        self.reader = asyncio.ensure_future(self._read())

    def submit(self, request_id: str, request) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        self.outbox.put_nowait(request)
        return future

    async def close(self, timeout: float | None) -> None:
        self.outbox.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.gather(self.sender, self.reader, return_exceptions=True), timeout)
        except TimeoutError:
            await self.abort()

    async def abort(self) -> None:
        self.call.cancel()
        self._fail(errors.error_for(grpc.StatusCode.CANCELLED, "ForwardStream cancelled"))
        await _cancel([self.sender, self.reader])
        await self.call.code()  # grpc's own bookkeeping of the cancelled call finishes too

    async def _send(self) -> None:
        try:
            while (request := await self.outbox.get()) is not None:
                await self.call.write(request)
            await self.call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call has ended: the reader reports its status

    async def _read(self) -> None:
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
                future = self.waiting.get(response.request_id)
                if future is None or future.done():  # its caller stopped waiting (deadline, cancelled)
                    continue
                result = messages.stream_result(response)
                if result.error is not None:
                    future.set_exception(result.error)
                else:
                    future.set_result(result.output)
            error = errors.error_for(grpc.StatusCode.UNAVAILABLE, "ForwardStream ended with answers still due")
        except grpc.RpcError as rpc_error:
            error = _stream_error(errors.from_rpc_error(rpc_error))
        except ValueError as bad_answer:  # an answer that does not decode
            error = errors.error_for(grpc.StatusCode.INTERNAL, f"bad ForwardStream answer: {bad_answer}")
            self.call.cancel()
        self._fail(error)
        self.sender.cancel()  # nothing more can be written to an ended call

    def _fail(self, error: Exception) -> None:
        self.broken = True
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error)


# What grpc reports, as INTERNAL, for a stream whose connection broke while a message was written.
_BROKEN_WRITE = "Internal error from Core"


def _stream_error(error: errors.ExpertError) -> errors.ExpertError:
    """A ForwardStream's failure as the caller should see it: a connection that broke under a write
    (the server stopped or went away) is UNAVAILABLE, as a unary call to a server that is gone is."""
    if error.code == grpc.StatusCode.INTERNAL and error.message == _BROKEN_WRITE:
        return errors.error_for(grpc.StatusCode.UNAVAILABLE, "ForwardStream broke: the connection to the server "
                                "failed while a message was sent (server stopped or unreachable)")
    return error
