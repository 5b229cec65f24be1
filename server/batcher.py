"""The batcher: merges concurrent requests for one layer into engine steps, off the asyncio loop.

How a request flows (T tokens, H hidden, E experts, k top-k); requests arrive decoded, validated
and in the engine dtype (``expertd.server.requests``), and nothing here checks them again:

1. ``forward`` / ``route`` check capacity (``Overloaded`` past ``max_queue_size`` accepted
   requests; ``NotReady`` while warming up or draining), split the tokens into parts of at most
   ``max_batch_tokens`` rows (views, no copies; requests bigger than the largest bucket are
   served, not refused) and queue the parts on the queue of their (layer, step kind).
2. One scheduler task per queue waits (``_gather``) until the queued rows fill a bucket exactly
   or ``max_batch_tokens``, or ``max_queue_delay`` has passed since the first part arrived or the
   previous step ended, then takes parts in arrival order up to ``max_batch_tokens`` rows. Parts
   whose request was cancelled or whose deadline passed are dropped here, before compute.
3. The step's bucket is chosen once, and the parts are copied once into one buffer of that many
   rows (``steps.pad_rows``; no copy when one part fills it), which the engine runs as one step on
   the single device-worker thread (``run_in_executor``): the loop never blocks on device work.
   Token ids travel with their rows: a step gets ``token_ids [bucket]`` int32 (zeros past the valid
   rows) when every part in it has ids, else None.
4. Results are cut back per part (views); each request's output is cast once to its caller's dtype
   (``requests.cast``) and answered as the client's own result types (``ForwardResult``,
   ``RouteResult`` of ``expertd.client.messages``) with its ``Timing``. If a merged step fails,
   its parts are re-run one by one, so one bad request never fails the others in its batch.
5. Per-expert token counts feed the load tracker (GetExpertLoad) and the metrics. Each request's
   ``Timing`` has its ``compute_seconds`` (the engine steps that computed its parts) and
   ``queue_seconds`` (the rest of its time until its last step ended); the latter is observed in
   ``expertd_queue_duration_seconds`` once per request, the steps in the compute histogram.

Route requests are merged the same way. The aux loss is a statistic of a request's own tokens,
so the step returns per-token routing ids and dense aux scores ``[T, E]``; each request's
tokens per expert and score sums come from its own rows (summed over its parts when it was
split), and its loss is computed from them on the host (``steps.aux_loss_of``): exact for merged
and split requests alike.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time

import numpy as np

from expertd.client.messages import ForwardResult, RouteResult, Routing
from expertd.server import requests, steps
from expertd.server.config import BatchingConfig
from expertd.server.description import ModelDescription
from expertd.server.errors import DeadlineExpired, NotReady, Overloaded
from expertd.server.expert_load import ExpertLoadTracker
from expertd.server.metrics import Metrics
from expertd.server.requests import ForwardRequest, RouteRequest


@dataclasses.dataclass(frozen=True)
class Timing:
    """One request's seconds in the batcher: waiting (for its batch to form and for earlier steps)
    and in the engine steps that computed its parts."""

    queue_seconds: float
    compute_seconds: float


@dataclasses.dataclass
class _Request:
    """One accepted call: its deadline (monotonic seconds or None) and arrival time."""

    deadline: float | None
    arrived: float


@dataclasses.dataclass
class _Part:
    """Up to max_batch_tokens rows of one request, with the future its result goes to."""

    request: _Request
    tokens: np.ndarray          # [n, H] (engine dtype) or [n, E] fp32 logits
    future: asyncio.Future
    token_ids: np.ndarray | None = None  # [n] int32, the rows' vocabulary ids


class Batcher:
    """Per-(layer, step kind) queues in front of one engine (see module docstring).

    Args:
      engine: runs the steps (``expertd.server.engine.Engine``, or the multi-host leader's wrapper);
        called only from the device-worker thread.
      model: the served layers and buckets.
      config: batching limits.
      metrics: where batches, queue times and routing are recorded.
      executor: the single device-worker thread (created here when not given).
    """

    def __init__(self, engine, model: ModelDescription, config: BatchingConfig, metrics: Metrics,
                 executor: concurrent.futures.ThreadPoolExecutor | None = None):
        self.engine = engine
        self.model = model
        self.config = config
        self.metrics = metrics
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expertd-device")
        self.max_part_tokens = model.max_batch_tokens
        self.loads = ExpertLoadTracker({i: cfg.num_experts for i, cfg in model.layers.items()},
                                       config.expert_load_window_s)
        self.accepting = False
        self.draining = False
        self._buckets = frozenset(model.buckets)
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        metrics.track_pending(lambda: self._pending)
        self._queues: dict[tuple[int, str], collections.deque[_Part]] = {}
        self._wakeups: dict[tuple[int, str], asyncio.Event] = {}
        self._schedulers: dict[tuple[int, str], asyncio.Task] = {}

    # -- public API (called from servicers on the event loop) -----------------------------------
    async def forward(self, request: ForwardRequest) -> tuple[ForwardResult, Timing]:
        """The layer output for ``request.tokens [T, H]`` (any T >= 1) in the caller's dtype, with the routing."""
        parts, timing = await self._submit(request.layer, steps.FORWARD, request.tokens, request.deadline,
                                           request.token_ids)
        output, ids, weights = parts[0] if len(parts) == 1 else (np.concatenate(p) for p in zip(*parts))
        counts = _counts(ids, self.model.layers[request.layer].num_experts)
        return ForwardResult(requests.cast(output, request.out_dtype), Routing(ids, weights, counts)), timing

    async def route(self, request: RouteRequest) -> tuple[RouteResult, Timing]:
        """Top-k routing of hidden states ``[T, H]`` or logits ``[T, E]``; aux loss times the request's coefficient."""
        kind = steps.ROUTE_LOGITS if request.from_logits else steps.ROUTE_HIDDEN
        parts, timing = await self._submit(request.layer, kind, request.tokens, request.deadline, request.token_ids)
        ids = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
        weights = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
        cfg = self.model.layers[request.layer]
        counts = _counts(ids, cfg.num_experts)
        score_sums = sum(p[2] for p in parts)
        aux_loss = steps.aux_loss_of(score_sums, counts, len(ids), cfg.topk, request.aux_loss_coeff)
        return RouteResult(ids, weights, counts, aux_loss), timing

    @property
    def pending(self) -> int:
        """Accepted requests not answered yet (queued or computing)."""
        return self._pending

    def start(self) -> None:
        """Accept requests (after warm-up)."""
        self.accepting = True

    async def drain(self) -> None:
        """Stop accepting; return when every accepted request has been answered."""
        self.accepting, self.draining = False, True
        await self._idle.wait()

    async def close(self) -> None:
        for task in self._schedulers.values():
            task.cancel()
        await asyncio.gather(*self._schedulers.values(), return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def run_on_device(self, fn, *args):
        """Run ``fn(*args)`` on the device-worker thread (warm-up, engine steps)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- queueing -------------------------------------------------------------------------------
    async def _submit(self, layer: int, kind: str, tokens: np.ndarray, deadline: float | None,
                      token_ids: np.ndarray | None = None) -> tuple[list, Timing]:
        """Queue ``tokens`` (and their ``token_ids``) in parts; (each part's result in order, the request's Timing)."""
        if not self.accepting:
            raise NotReady("draining: not accepting new requests" if self.draining else "warming up: the model is "
                           "still compiling; retry when health reports SERVING")
        if self._pending >= self.config.max_queue_size:
            raise Overloaded(f"overloaded: {self._pending} requests queued (--max-queue-size "
                             f"{self.config.max_queue_size}); retry later",
                             retry_after=max(self.config.max_queue_delay_ms / 1000.0, 0.01))
        loop = asyncio.get_running_loop()
        request = _Request(deadline=deadline, arrived=time.monotonic())
        key = (layer, kind)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = collections.deque()
            self._wakeups[key] = asyncio.Event()
            self._schedulers[key] = asyncio.ensure_future(self._schedule(key))
        futures = []
        for start in range(0, len(tokens), self.max_part_tokens):
            future = loop.create_future()
            rows = slice(start, start + self.max_part_tokens)
            queue.append(_Part(request, tokens[rows], future, None if token_ids is None else token_ids[rows]))
            futures.append(future)
        self._wakeups[key].set()
        self._pending += 1
        self._idle.clear()
        try:
            # each part's future gives (its result, its step's seconds, its step's end)
            done = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
            compute = sum(seconds for _, seconds, _ in done)
            queued = max(max(end for _, _, end in done) - request.arrived - compute, 0.0)
            self.metrics.observe_queue("forward" if kind == steps.FORWARD else "route", queued)
            return [result for result, _, _ in done], Timing(queued, compute)
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def _schedule(self, key: tuple[int, str]) -> None:
        queue, wakeup = self._queues[key], self._wakeups[key]
        last_step_end = 0.0
        while True:
            while not queue:
                wakeup.clear()
                await wakeup.wait()
            await self._gather(queue, wakeup, last_step_end)
            batch = self._take(queue)
            if batch:
                await self._execute(key, batch)
                last_step_end = time.monotonic()

    async def _gather(self, queue: collections.deque[_Part], wakeup: asyncio.Event, last_step_end: float) -> None:
        """Wait, at most the queue delay, for more requests to join the batch at the queue's head.

        No wait when the queued rows fill a bucket exactly (nothing to gain) or the largest batch.
        The delay counts from the first request's arrival or the end of the previous step,
        whichever is later, so callers just answered by that step can come back and fill the
        padding of the next one (closed-loop clients otherwise settle into half-full batches).
        """
        delay = self.config.max_queue_delay_ms / 1000.0
        while not self.draining:
            rows = sum(len(p.tokens) for p in queue)
            if rows >= self.max_part_tokens or rows in self._buckets:
                return
            remaining = max(queue[0].request.arrived, last_step_end) + delay - time.monotonic()
            if remaining <= 0:
                return
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _take(self, queue: collections.deque[_Part]) -> list[_Part]:
        """Live parts in arrival order up to max_part_tokens rows; dead ones are dropped on the way."""
        batch: list[_Part] = []
        rows = 0
        now = time.monotonic()
        while queue:
            part = queue[0]
            expired = part.request.deadline is not None and part.request.deadline <= now
            if part.future.done():  # the caller went away (cancelled, or gRPC ended it at its deadline)
                queue.popleft()
                self.metrics.observe_dropped("deadline" if expired else "cancelled")
                continue
            if expired:
                queue.popleft()
                self.metrics.observe_dropped("deadline")
                part.future.set_exception(DeadlineExpired("deadline passed while queued; dropped before compute"))
                continue
            if batch and rows + len(part.tokens) > self.max_part_tokens:
                break
            queue.popleft()
            batch.append(part)
            rows += len(part.tokens)
        return batch

    # -- execution ------------------------------------------------------------------------------
    async def _execute(self, key: tuple[int, str], batch: list[_Part]) -> None:
        layer, kind = key
        rows = sum(len(p.tokens) for p in batch)
        bucket = self.model.bucket_for(rows)
        started = time.monotonic()
        try:
            ids = None if any(p.token_ids is None for p in batch) else [p.token_ids for p in batch]
            result = await self.run_on_device(self._step, layer, kind, [p.tokens for p in batch], bucket, rows, ids)
        except Exception as exc:  # noqa: BLE001 - handed to the requests' futures
            if len(batch) > 1:
                for part in batch:  # isolate the failing request; the others still get answers
                    await self._execute(key, [part])
            elif not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        ended = time.monotonic()
        seconds = ended - started
        self._record(layer, kind, rows, bucket, len(batch), seconds, result)
        offset = 0
        for part in batch:
            span = slice(offset, offset + len(part.tokens))
            offset += len(part.tokens)
            if part.future.done():
                continue
            if kind == steps.FORWARD:
                part.future.set_result(((result.output[span], result.topk_ids[span], result.topk_weights[span]),
                                        seconds, ended))
            else:
                # the part's own score sums [E], in fp64: the request's aux loss is computed from them
                part.future.set_result(((result.topk_ids[span], result.topk_weights[span],
                                         result.aux_scores[span].sum(axis=0, dtype=np.float64)), seconds, ended))

    def _step(self, layer: int, kind: str, parts: list[np.ndarray], bucket: int, rows: int,
              token_ids: list[np.ndarray] | None = None):
        """Device-worker thread: the parts (and their token ids, when every part has them) padded to
        ``bucket`` rows, run as one engine step."""
        tokens = steps.pad_rows(parts, bucket)
        ids = None if token_ids is None else steps.pad_rows(token_ids, bucket)
        if kind == steps.FORWARD:
            return self.engine.forward(layer, tokens, rows, token_ids=ids)
        return self.engine.route(layer, tokens, rows, from_logits=kind == steps.ROUTE_LOGITS, token_ids=ids)

    def _record(self, layer: int, kind: str, rows: int, bucket: int, num_parts: int, seconds: float, result) -> None:
        metric_kind = "forward" if kind == steps.FORWARD else "route"
        self.metrics.observe_batch(layer=layer, kind=metric_kind, num_valid=rows, bucket=bucket,
                                   num_requests=num_parts, seconds=seconds)
        counts = np.asarray(result.tokens_per_expert, np.int64)
        imbalance = self.loads.add(layer, counts)
        self.metrics.observe_routing(layer, counts, imbalance)
        if kind != steps.FORWARD:
            self.metrics.set_aux_loss(layer, result.aux_loss)


def _counts(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """tokens_per_expert ``[E]`` int64 from ``topk_ids [T, k]``."""
    return np.bincount(topk_ids.reshape(-1), minlength=num_experts)
