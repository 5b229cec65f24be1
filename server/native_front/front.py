"""The native Forward port (``--native-port``): ``expertd.v1`` Forward from gRPC C++, Python once per batch.

A thin transport: gRPC C++ (``csrc/``, built by ``build``) parses, queues and answers; Python's one
request path decides. docs/serving.md has the whole picture; the contracts:

- Forward. C++ checks only what a transport must where a call arrives: the bearer token
  (``transport.auth``'s message), that the body parses (the main port's INVALID_ARGUMENT), that the
  server accepts, and the bounds on the tokens and calls queued on the port
  (``BatchingConfig.queue_tokens``, ``max_queue_size``: RESOURCE_EXHAUSTED with a RetryInfo delay
  from the batcher's seconds per token, refreshed at most every RETRY_HINT_INTERVAL_S). Every call
  of a batch Python takes is decoded and checked by ``frontends.decode.decode_plain_forward`` (the
  main port's codes, messages and BadRequest details, ``errors.status_of``); a call that fails is
  answered alone (``fail_call``), the good calls' rows go to the batcher as one request, so
  admission, step times, merging with the main port, expert loads and step metrics are the main
  port's. A merged result that is not finite (one call's input overflowed the layer) is computed
  again call by call: what one caller does wrong ends that call only.
- Batches: a call finding the queue empty signals an eventfd the event loop watches; the loop takes
  the queued calls one batch a turn (one layer, dtype and token-ids presence, up to the largest
  bucket; a call arriving after the last answer at an idle port goes alone, calls that queued
  behind a batch leave together). The direct path (``--native-direct``, one process): a call at an
  idle port is decoded and offered to ``Batcher.direct.forward_now`` on its gRPC thread, and what
  queues meanwhile on the port's runner thread (``expertd-direct``), until the queue is empty or a
  batch is handed to the loop; steps serialize on the engine's lock.
- GetModelInfo: the main port's answer; health: SERVING once warm; the rest is the main port's
  (UNIMPLEMENTED, or INVALID_ARGUMENT naming the field). A call's method and token are checked
  from its headers, before its body is read (``csrc/reactor.cc``).

Security is the main port's (token, TLS, mutual TLS). Refusals are logged as the main port's
(``errors.client_errors``), read from C++ every REFUSAL_LOG_INTERVAL_S. Metrics
(``metrics.native_port``): each Forward counts in the ``grpc_server_*`` series of
``ExpertService/Forward``, and in the port's ``expertd_native_forward_*``. Drain:
``set_accepting(False, ...)``, ``quiesce`` (queued calls answered), ``stop`` (the port closes;
calls unanswered after the grace are cancelled).
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import time
from collections.abc import Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from expertd.client import codec
from expertd.client.pb.v1.expert_pb2 import ForwardRequest, GetModelInfoResponse
from expertd.server import errors
from expertd.server.batching import offload, requests
from expertd.server.batching.admission import MIN_RETRY_S
from expertd.server.batching.batcher import WARMING_UP, Batcher
from expertd.server.config.credentials import TlsMaterial
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription
from expertd.server.frontends import decode
from expertd.server.metrics import native_port
from expertd.server.metrics.calls import GrpcCallCollector
from expertd.server.metrics.families import LATENCY_BUCKETS
from expertd.server.metrics.native_port import NativePortCollector
from expertd.server.native_front.build import load
from expertd.server.transport.auth import UNAUTHENTICATED_MESSAGE
from expertd.server.transport.interceptors import undecodable_message

log = logging.getLogger(__name__)

BATCHES_IN_FLIGHT = 2
"""Batches of the native port handed to the batcher and not yet answered, at most: one computing
and the next waiting for it. Calls arriving meanwhile wait in the C++ queue and leave it as one
batch, so Python's per-batch work shrinks as load grows, and an idle server takes a call at once."""

REFUSAL_LOG_INTERVAL_S = 1.0
"""How often the calls the port refused are read into the server's client-error log: at most one
line per status code an interval (its latest message and how many calls it stands for), then the
log's own rate limit."""
FORWARD_METHOD = "/expertd.v1.ExpertService/Forward"
ELSEWHERE = "the main port (--port), not the native port"
"""Where what the port does not serve is (``decode.decode_plain_forward``'s refusals name it)."""
UNDECODABLE = undecodable_message(ForwardRequest.DESCRIPTOR.full_name)
QUIESCE_POLL_S = 0.005
BODY_BYTES_PER_ELEMENT = 4
"""A taken batch's elements (``offload.run``) from its bodies' bytes: float32's size, an upper bound."""
RETRY_HINT_INTERVAL_S = 0.5
"""How often, at most, the port's retry-delay rates are refreshed from the batcher's step times (on
accepting, then after answered batches)."""


@dataclasses.dataclass(slots=True)
class _Calls:
    """A taken batch's calls that decoded: ``request``, their rows joined in order (one request for
    the batcher), and ``parts``, each call's (index in the batch, its own request)."""

    request: requests.ForwardRequest
    parts: list[tuple[int, requests.ForwardRequest]]


class NativeFront:
    """A started native Forward port (module docstring). Create with ``NativeFront.start``."""

    def __init__(self, module, handle: int, port: int, ready_fd: int, model: ModelDescription,
                 model_info: Callable[[], GetModelInfoResponse], batcher: Batcher, loop: asyncio.AbstractEventLoop):
        self.port = port
        self._module = module
        self._handle = handle
        self._ready_fd = ready_fd
        self._model = model
        self._model_info = model_info
        self._batcher = batcher
        self._loop = loop
        self._stopped = False
        self._batches: set[asyncio.Task] = set()  # batches in flight (held: the loop keeps weak references)
        self._handing = False  # a batch was handed to the batcher this loop turn (``_take``)
        self._hint_refreshed = 0.0  # monotonic time of the last set_retry_hint
        self.direct_calls = {"computed": 0, "handed_over": 0}  # batches given to ``_direct``, by outcome
        loop.add_reader(ready_fd, self._on_ready)
        self._refusal_timer = loop.call_later(REFUSAL_LOG_INTERVAL_S, self._log_refusals)

    @classmethod
    def start(cls, address: str, *, model: ModelDescription, model_info: Callable[[], GetModelInfoResponse],
              batcher: Batcher, loop: asyncio.AbstractEventLoop, queue_tokens: int, queue_calls: int,
              max_message_bytes: int, token: str | None = None, tls: TlsMaterial | None = None,
              cache_dir: str | None = None, direct: bool = False) -> NativeFront:
        """Listen on ``address`` (port 0: a free one), not accepting until ``set_accepting(True)``;
        GetModelInfo answers ``model_info()`` (as of start, then of each ``refresh_model_info``).
        ``direct``: a lone call on an idle server, and what queues behind it, runs on its gRPC thread
        (module docstring); only
        where the batcher's engine may be called from any thread (one process).

        Raises ``NativeUnavailable`` where the module cannot be built, OSError where the
        address cannot be bound.
        """
        module = load(cache_dir)
        handle, port, ready_fd = module.start(
            address, {index: cfg.hidden_size for index, cfg in model.layers.items()},
            {dtype: codec.numpy_dtype(dtype).itemsize for dtype in codec.FLOAT_DTYPES}, model.max_request_tokens,
            model.max_batch_tokens, queue_tokens, queue_calls, max_message_bytes, model_info().SerializeToString(),
            None if token is None else token.encode(),
            None if tls is None else (tls.private_key, tls.certificate_chain, tls.client_ca), LATENCY_BUCKETS,
            WARMING_UP, UNAUTHENTICATED_MESSAGE, UNDECODABLE)
        front = cls(module, handle, port, ready_fd, model, model_info, batcher, loop)
        if direct:
            module.set_direct(handle, front._direct)
            atexit.register(module.set_direct, handle, None)  # no gRPC thread enters a finalizing interpreter
        return front

    def set_accepting(self, accepting: bool, reason: str = "") -> None:
        """Accept calls (health SERVING), or refuse new ones UNAVAILABLE with ``reason``."""
        if accepting:
            self._refresh_retry_hint()
        self._module.set_accepting(self._handle, accepting, reason)

    def refresh_model_info(self) -> None:
        """Answer GetModelInfo with what ``model_info()`` gives now."""
        self._module.set_model_info(self._handle, self._model_info().SerializeToString())

    def _seconds_per_token(self) -> dict[int, float]:
        """Each layer's seconds per queued Forward token (``Admission.seconds_per_token``)."""
        batcher = self._batcher
        return {layer: batcher.admission.seconds_per_token(batcher.step_key(cfg, api.FORWARD))
                for layer, cfg in self._model.layers.items()}

    def _refresh_retry_hint(self) -> None:
        """Give C++ the seconds per token its RESOURCE_EXHAUSTED refusals' RetryInfo delays are
        computed from (the main port's rates and minimum)."""
        self._module.set_retry_hint(self._handle, self._seconds_per_token(), MIN_RETRY_S)
        self._hint_refreshed = time.monotonic()

    def stats(self) -> dict:
        """``{"handled": {code: n}, "latency": ([counts per LATENCY_BUCKETS bound, +Inf last], sum),
        "queued_tokens", "queued_calls", "batches_in_flight"}``."""
        return self._module.stats(self._handle)

    async def quiesce(self, timeout: float) -> bool:
        """Wait until no call is queued or computing (False if ``timeout`` passed first)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["queued_calls"] == 0 and stats["batches_in_flight"] == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIESCE_POLL_S)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Refuse what is still queued and close the port, cancelling calls unanswered after
        ``grace_s`` (batches already taken are answered meanwhile). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._refusal_timer.cancel()
        self._loop.remove_reader(self._ready_fd)
        await self._loop.run_in_executor(None, self._module.stop, self._handle, grace_s)
        await asyncio.gather(*self._batches, return_exceptions=True)
        self._log_refusals()

    def register_metrics(self, registry, grpc_calls: GrpcCallCollector) -> None:
        """Export the port's ``expertd_native_forward_*`` on ``registry`` and count its Forward calls
        in the ``grpc_server_*`` series (``expertd.server.metrics.native_port``)."""
        registry.register(NativePortCollector(self.stats, lambda: dict(self.direct_calls)))
        grpc_calls.add_transport(native_port.FORWARD_LABELS, lambda: native_port.grpc_calls(self.stats()))

    # -- the event loop's side -------------------------------------------------------------------
    def _on_ready(self) -> None:
        """The eventfd is readable: a call found the queue empty (read first, so a call queued while
        this runs signals again)."""
        try:
            os.read(self._ready_fd, 8)
        except BlockingIOError:
            pass
        self._take()

    def _take(self) -> None:
        """Hand one queued batch to the batcher if fewer than BATCHES_IN_FLIGHT are and none was
        handed over this loop turn (the next goes the turn after its calls are decoded: ``_serve``
        schedules ``_handed``). Two batches handed over in one turn would share a step, tying
        together the answers of calls that arrived together (one client's micro-batches), which C++
        keeps apart at an idle port. Every path (the eventfd, an answered batch, the next turn) goes
        through this rule; the rest of the queue is taken when a batch is answered."""
        if self._stopped or self._handing or len(self._batches) >= BATCHES_IN_FLIGHT:
            return
        batch = self._module.take(self._handle)
        if batch is None:
            return
        task = asyncio.ensure_future(self._serve(batch[0], None, *batch[1:]))
        self._batches.add(task)
        task.add_done_callback(self._answered)
        self._handing = True

    def _handed(self) -> None:
        """The turn after a hand-over: the batch is in the batcher, so the next may follow."""
        self._handing = False
        self._take()

    def _log_refusals(self) -> None:
        """Log what the port refused since the last time (client-caused codes only: a server failure
        has logged its traceback where it happened), then come back in REFUSAL_LOG_INTERVAL_S."""
        for code, (calls, message) in sorted(self._module.refusals(self._handle).items()):
            name = _CODE_NAMES.get(code, str(code))
            if name in errors.CLIENT_CODES:
                more = f" (and {calls - 1} more {name} calls)" if calls > 1 else ""
                errors.client_errors.note(name, f"{FORWARD_METHOD} on the native port: "
                                                f"{message.decode(errors='replace')}{more}")
        if not self._stopped:
            self._refusal_timer = self._loop.call_later(REFUSAL_LOG_INTERVAL_S, self._log_refusals)

    def _answered(self, task: asyncio.Task) -> None:
        self._batches.discard(task)
        if time.monotonic() - self._hint_refreshed >= RETRY_HINT_INTERVAL_S:
            self._refresh_retry_hint()
        self._take()

    def _direct(self, batch_id: int, bodies: tuple[bytes, ...], remaining_s: float | None) -> None:
        """One of the direct runner's batches (a lone call on an idle port, on its gRPC thread, or the
        calls queued behind the last, on the runner thread) with the GIL held (C++'s ``set_direct``;
        the arguments as ``take`` gives them): its calls decoded (``_request``), then computed and
        answered here where the batcher is idle too (``Batcher.direct.forward_now``, which records
        the step after the answer), else handed to the event loop as a taken batch."""
        answered = False

        def answer(output: np.ndarray) -> None:
            nonlocal answered
            answered = True
            self._answer(self._module.finish, batch_id, np.ascontiguousarray(output))

        try:
            calls = self._request(batch_id, bodies, remaining_s)
        except Exception as exc:  # noqa: BLE001 - every failure answers the call
            self._fail(batch_id, exc)
            return
        if calls is None:  # every call refused
            return
        try:
            computed = self._batcher.direct.forward_now(calls.request, answer)
        except errors.InvalidRequest as exc:  # its step ran: a result not finite
            computed = True
            if len(calls.parts) > 1:  # one call's input overflowed the layer: each call alone, on the loop
                self._loop.call_soon_threadsafe(self._adopt, batch_id, calls, True)
            elif not answered:
                self._fail(batch_id, exc)
        except Exception as exc:  # noqa: BLE001 - its step failed, or recording it did
            computed = True
            if not answered:
                self._fail(batch_id, exc)
            else:
                log.exception("native Forward port: recording a direct step failed")
        self.direct_calls["computed" if computed else "handed_over"] += 1  # one runner at a time
        if not computed:
            self._loop.call_soon_threadsafe(self._adopt, batch_id, calls)

    def _adopt(self, batch_id: int, calls: _Calls, one_by_one: bool = False) -> None:
        """Serve on the loop a batch C++ took for ``_direct`` (counted among the batches in flight);
        ``one_by_one``: its merged step's result was not finite, so each call runs alone."""
        work = self._one_by_one(batch_id, calls.parts) if one_by_one else self._serve(batch_id, calls)
        task = asyncio.ensure_future(work)
        self._batches.add(task)
        task.add_done_callback(self._answered)

    def _request(self, batch_id: int, bodies: tuple[bytes, ...], remaining_s: float | None) -> _Calls | None:
        """A taken batch (``take``'s tuple: each call's ForwardRequest as bytes) as one ForwardRequest:
        each call decoded and checked as the main port does (``decode.decode_plain_forward``), a call
        that fails answered alone with its status (``fail_call``), the others' rows joined in order
        (C++ batches calls of one layer, dtype and token-ids presence); None when none is left."""
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        parts = []
        for index, body in enumerate(bodies):
            try:
                parts.append((index, decode.decode_plain_forward(_parsed(body), self._model, deadline, ELSEWHERE)))
            except Exception as exc:  # noqa: BLE001 - every failure answers its call
                self._answer(self._module.fail_call, batch_id, index, *self._status(exc))
        if len(parts) <= 1:
            return _Calls(parts[0][1], parts) if parts else None
        good = [r for _, r in parts]
        first = good[0]
        return _Calls(requests.ForwardRequest(
            first.layer, np.concatenate([r.tokens for r in good]), first.out_dtype, deadline,
            token_ids=None if first.token_ids is None else np.concatenate([r.token_ids for r in good])), parts)

    async def _serve(self, batch_id: int, calls: _Calls | None, *batch) -> None:
        """Compute one batch (``calls``, or None and ``take``'s tuple after the batch id: decoded
        here, off the loop when large) and answer its calls (each failure answers those left with its
        status; a result not finite, each call alone); the batcher drops it when its last caller's
        deadline passes first."""
        try:
            if calls is None:  # a taken batch: the next may follow once this one is in the batcher
                try:
                    calls = await offload.run(self._request, batch_id, *batch,
                                              elements=sum(map(len, batch[0])) // BODY_BYTES_PER_ELEMENT)
                finally:
                    self._loop.call_soon(self._handed)  # runs when this step yields: in the forward below
                if calls is None:  # every call refused
                    return
            result, _timing = await self._batcher.forward(calls.request)
            output = np.ascontiguousarray(result.output)
        except errors.InvalidRequest as exc:  # a result not finite: one call's input overflowed the layer
            if calls is not None and len(calls.parts) > 1:
                await self._one_by_one(batch_id, calls.parts)
            else:
                self._fail(batch_id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every failure answers the batch's calls
            self._fail(batch_id, exc)
            return
        self._answer(self._module.finish, batch_id, output)

    async def _one_by_one(self, batch_id: int, parts: list[tuple[int, requests.ForwardRequest]]) -> None:
        """Each call of a batch whose merged result was not finite, computed alone: a call that fails
        is answered with its own status (its own row numbers), the others with their rows (what one
        bad caller does ends that call only, as on the main port)."""
        outputs = []
        for index, call in parts:
            try:
                result, _timing = await self._batcher.forward(call)
                outputs.append(np.ascontiguousarray(result.output))
            except Exception as exc:  # noqa: BLE001 - every failure answers its call
                self._answer(self._module.fail_call, batch_id, index, *self._status(exc))
        if outputs:  # the calls not answered yet, in order: the ones that computed
            self._answer(self._module.finish, batch_id, np.concatenate(outputs))

    @staticmethod
    def _status(exc: Exception) -> tuple[int, str, bytes]:
        """(code, message, google.rpc.Status bytes) for ``exc`` (``errors.status_of``: the main port's)."""
        status = errors.status_of(exc)
        return status[0].value[0], status[1], errors.rich_status(status).SerializeToString()

    def _fail(self, batch_id: int, exc: Exception) -> None:
        self._answer(self._module.fail, batch_id, *self._status(exc))

    def _answer(self, answer: Callable, batch_id: int, *args) -> None:
        """``answer(handle, batch_id, *args)`` (C++ ``finish``, ``fail``, ``fail_call``). Its ValueError
        is a server bug (an output of the wrong size: C++ has answered the batch's calls INTERNAL)
        or, once ``stop``'s grace has passed, a batch the port already cancelled: logged, never
        raised out of the batch's task or the direct runner."""
        try:
            answer(self._handle, batch_id, *args)
        except ValueError:
            if not self._stopped:
                log.exception("native Forward port: batch %d could not be answered", batch_id)


def _parsed(body: bytes) -> ForwardRequest:
    """A call's ForwardRequest from the bytes C++ parsed it from and hands over (its parser took
    them, so this one refusing them, a difference between the two, is the main port's refusal)."""
    try:
        return ForwardRequest.FromString(body)
    except DecodeError:
        raise ValueError(UNDECODABLE) from None


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

