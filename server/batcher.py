"""The batcher: merges concurrent requests for one layer into engine steps, off the asyncio loop.

How a request flows (T tokens, H hidden, E experts, k top-k):

1. ``forward`` / ``route`` check capacity (``Overloaded`` past ``max_queue_size`` accepted
   requests; ``NotReady`` while warming up or draining), split the tokens into parts of at most
   ``max_batch_tokens`` rows (so requests bigger than the largest bucket are served, not refused)
   and queue the parts on the queue of their (layer, step kind).
2. One scheduler task per queue waits (``_gather``) until the queued rows fill a bucket exactly
   or ``max_batch_tokens``, or ``max_queue_delay`` has passed since the first part arrived or the
   previous step ended, then takes parts in arrival order up to ``max_batch_tokens`` rows. Parts whose request was cancelled or whose deadline passed are
   dropped here, before compute.
3. The parts are concatenated (cast to the engine dtype) and run as one engine step on the single
   device-worker thread (``run_in_executor``): the loop never blocks on device work. The engine
   pads the rows to the smallest bucket that fits and masks the padding out of routing.
4. Results are cut back per part and cast to each request's dtype. If a merged step fails, its
   parts are re-run one by one, so one bad request never fails the others in its batch.
5. Per-expert token counts feed the load tracker (GetExpertLoad) and the metrics. Each answered
   request carries its own ``compute_seconds`` (the engine steps that computed its parts) and
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
from collections.abc import Callable

import numpy as np

from expertd.server import steps
from expertd.server.config import BatchingConfig
from expertd.server.errors import DeadlineExpired, NotReady, Overloaded
from expertd.server.metrics import Metrics

FORWARD, ROUTE_HIDDEN, ROUTE_LOGITS = "forward", "route_hidden", "route_logits"


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
    out_dtype: np.dtype
    future: asyncio.Future


@dataclasses.dataclass(frozen=True)
class _Served:
    """How one request's parts were served: its own parts' results in order, the seconds of the
    engine steps that computed them (``compute_seconds``) and the rest of its time in the batcher,
    from arrival to the end of its last step (``queue_seconds``; waiting for the batch to form and
    for earlier steps)."""

    parts: list
    queue_seconds: float
    compute_seconds: float


@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """output [T, H] in the request dtype; topk_ids int32 [T, k]; topk_weights fp32 [T, k];
    tokens_per_expert int64 [E] over the request's tokens (counted when first read);
    queue_seconds / compute_seconds: this request's time waiting in the batcher / in engine steps."""

    output: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    num_experts: int
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0

    @property
    def tokens_per_expert(self) -> np.ndarray:
        return _counts(self.topk_ids, self.num_experts)


@dataclasses.dataclass(frozen=True)
class RouteOutput:
    """topk_ids int32 [T, k]; topk_weights fp32 [T, k]; tokens_per_expert int64 [E]; aux_loss;
    queue_seconds / compute_seconds as in ForwardOutput."""

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray
    aux_loss: float
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0


class ExpertLoadTracker:
    """Tokens routed to each expert per layer: since start and over a sliding window.

    The window is kept as one-second slots with a running sum, so recording a step and reading
    the window cost O(E) whatever the request rate.
    """

    def __init__(self, num_experts: dict[int, int], window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._total = {layer: np.zeros(e, np.int64) for layer, e in num_experts.items()}
        self._recent_sum = {layer: np.zeros(e, np.int64) for layer, e in num_experts.items()}
        self._slots: dict[int, collections.deque] = {layer: collections.deque() for layer in num_experts}

    def add(self, layer: int, tokens_per_expert: np.ndarray) -> float:
        """Record one step's counts ``[E]``; returns the layer's recent max/mean imbalance."""
        counts = np.asarray(tokens_per_expert, np.int64)
        self._total[layer] += counts
        slots, second = self._slots[layer], int(self._clock())
        if slots and slots[-1][0] == second:
            slots[-1][1] += counts
        else:
            slots.append([second, counts.copy()])
        self._recent_sum[layer] += counts
        recent = self.recent(layer)
        mean = recent.mean()
        return float(recent.max() / mean) if mean > 0 else 1.0

    def total(self, layer: int) -> np.ndarray:
        return self._total[layer].copy()

    def recent(self, layer: int) -> np.ndarray:
        slots, horizon = self._slots[layer], self._clock() - self.window_s
        while slots and slots[0][0] + 1 <= horizon:  # the slot ended before the window began
            self._recent_sum[layer] -= slots.popleft()[1]
        return self._recent_sum[layer].copy()


class Batcher:
    """Per-(layer, step kind) queues in front of one Engine (see module docstring).

    Args:
      engine: ``expertd.server.engine.Engine`` (called only from the device-worker thread).
      config: batching limits.
      metrics: where batches, queue times and routing are recorded.
      executor: the single device-worker thread (created here when not given).
    """

    def __init__(self, engine, config: BatchingConfig, metrics: Metrics,
                 executor: concurrent.futures.ThreadPoolExecutor | None = None):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expertd-device")
        self.max_part_tokens = min(config.batch_tokens, engine.buckets[-1])
        self.loads = ExpertLoadTracker({i: layer.cfg.num_experts for i, layer in engine.layers.items()},
                                       config.expert_load_window_s)
        self.accepting = False
        self.draining = False
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        metrics.track_pending(lambda: self._pending)
        self._queues: dict[tuple[int, str], collections.deque[_Part]] = {}
        self._wakeups: dict[tuple[int, str], asyncio.Event] = {}
        self._schedulers: dict[tuple[int, str], asyncio.Task] = {}

    # -- public API (called from servicers on the event loop) -----------------------------------
    async def forward(self, layer: int, x: np.ndarray, *, deadline: float | None = None) -> ForwardOutput:
        """The layer output for ``x [T, H]`` (any T >= 1), in x's dtype, with the routing."""
        served = await self._submit(layer, FORWARD, x, self.engine.dtype, deadline)
        parts = served.parts
        output, ids, weights = parts[0] if len(parts) == 1 else (np.concatenate(p) for p in zip(*parts))
        return ForwardOutput(output, ids, weights, self.engine.layers[layer].cfg.num_experts,
                             served.queue_seconds, served.compute_seconds)

    async def route(self, layer: int, *, hidden: np.ndarray | None = None, logits: np.ndarray | None = None,
                    aux_loss_coeff: float = 1.0, deadline: float | None = None) -> RouteOutput:
        """Top-k routing of ``hidden [T, H]`` or ``logits [T, E]``; aux loss times ``aux_loss_coeff``."""
        kind, tokens, dtype = (ROUTE_HIDDEN, hidden, self.engine.dtype) if hidden is not None \
            else (ROUTE_LOGITS, logits, np.dtype(np.float32))
        served = await self._submit(layer, kind, tokens, dtype, deadline)
        parts = served.parts
        ids = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
        cfg = self.engine.layers[layer].cfg
        counts = _counts(ids, cfg.num_experts)
        score_sums = sum(p[2] for p in parts)
        return RouteOutput(
            topk_ids=ids,
            topk_weights=parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts]),
            tokens_per_expert=counts,
            aux_loss=steps.aux_loss_of(score_sums, counts, len(ids), cfg.topk, aux_loss_coeff),
            queue_seconds=served.queue_seconds,
            compute_seconds=served.compute_seconds,
        )

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
        """Run ``fn(*args)`` on the device-worker thread (warm-up, engine info)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- queueing -------------------------------------------------------------------------------
    async def _submit(self, layer: int, kind: str, tokens: np.ndarray, dtype, deadline: float | None) -> _Served:
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
            chunk = np.asarray(tokens[start:start + self.max_part_tokens]).astype(dtype, copy=False)
            future = loop.create_future()
            queue.append(_Part(request, chunk, np.asarray(tokens).dtype, future))
            futures.append(future)
        self._wakeups[key].set()
        self._pending += 1
        self._idle.clear()
        try:
            # each part's future gives (its result, its step's seconds, its step's end)
            done = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
            compute = sum(seconds for _, seconds, _ in done)
            queue = max(max(end for _, _, end in done) - request.arrived - compute, 0.0)
            self.metrics.observe_queue("forward" if kind == FORWARD else "route", queue)
            return _Served([result for result, _, _ in done], queue, compute)
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

        No wait when the queued rows fill their bucket exactly (nothing to gain) or the largest
        one. The delay counts from the first request's arrival or the end of the previous step,
        whichever is later, so callers just answered by that step can come back and fill the
        padding of the next one (closed-loop clients otherwise settle into half-full batches).
        """
        delay = self.config.max_queue_delay_ms / 1000.0
        while not self.draining:
            rows = sum(len(p.tokens) for p in queue)
            if rows >= self.max_part_tokens or rows == self.engine.bucket_for(rows):
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
        started = time.monotonic()
        tokens = batch[0].tokens if len(batch) == 1 else np.concatenate([p.tokens for p in batch])
        try:
            result = await self.run_on_device(self._step, layer, kind, tokens)
        except Exception as exc:  # noqa: BLE001 - handed to the requests' futures
            if len(batch) > 1:
                for part in batch:  # isolate the failing request; the others still get answers
                    await self._execute(key, [part])
            elif not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        ended = time.monotonic()
        seconds = ended - started
        self._record(layer, kind, len(tokens), len(batch), seconds, result)
        offset = 0
        for part in batch:
            rows = slice(offset, offset + len(part.tokens))
            offset += len(part.tokens)
            if part.future.done():
                continue
            if kind == FORWARD:
                part.future.set_result(((result.output[rows].astype(part.out_dtype, copy=False),
                                         result.topk_ids[rows], result.topk_weights[rows]), seconds, ended))
            else:
                # the part's own score sums [E], in fp64: the request's aux loss is computed from them
                part.future.set_result(((result.topk_ids[rows], result.topk_weights[rows],
                                         result.aux_scores[rows].sum(axis=0, dtype=np.float64)), seconds, ended))

    def _step(self, layer: int, kind: str, tokens: np.ndarray):
        """Device-worker thread: one engine step over the concatenated parts."""
        if kind == FORWARD:
            return self.engine.forward(layer, tokens)
        if kind == ROUTE_HIDDEN:
            return self.engine.route(layer, hidden=tokens, aux_loss_coeff=1.0)
        return self.engine.route(layer, logits=tokens, aux_loss_coeff=1.0)

    def _record(self, layer: int, kind: str, rows: int, num_parts: int, seconds: float, result) -> None:
        metric_kind = "forward" if kind == FORWARD else "route"
        self.metrics.observe_batch(layer=layer, kind=metric_kind, num_valid=rows, bucket=self.engine.bucket_for(rows),
                                   num_requests=num_parts, seconds=seconds)
        counts = np.asarray(result.tokens_per_expert, np.int64)
        imbalance = self.loads.add(layer, counts)
        self.metrics.observe_routing(layer, counts, imbalance)
        if kind != FORWARD:
            self.metrics.set_aux_loss(layer, result.aux_loss)


def _counts(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """tokens_per_expert ``[E]`` int64 from ``topk_ids [T, k]``."""
    return np.bincount(topk_ids.reshape(-1), minlength=num_experts).astype(np.int64)
