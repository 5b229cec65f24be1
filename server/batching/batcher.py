"""The batcher: admits requests, merges concurrent requests for one layer into engine steps, off the asyncio loop.

How a request flows (T tokens, H hidden, E experts, k top-k, M rows per step = max_batch_tokens);
requests arrive decoded, validated and in the engine dtype (``expertd.server.frontends.decode``), and
nothing here checks them again:

1. ``admit`` (from the request's header, before its tensor is decoded): ``NotReady`` while warming
   up or draining, else ``expertd.server.batching.admission`` decides from the queued work and the measured
   step times (``Overloaded``: RESOURCE_EXHAUSTED with a RetryInfo delay). The ``Ticket`` it gives
   counts the request's tokens as queued from that moment until ``forward`` / ``route`` queue the
   decoded request or the ticket is released.
2. A request joins the queue of its (layer, step kind) (``expertd.server.batching.queues``). Its queue's
   timer drops it once its deadline passes while queued, a cancelled call at once; each dropped
   request is counted once.
3. One scheduler task per queue waits (``_gather``) until the queued rows fill a bucket exactly or
   M, or ``max_queue_delay`` has passed since the oldest request arrived or the previous step
   ended, then takes one step's rows (``Queues.take``: small requests first, big ones split
   across steps; a small request never waits behind more than the running step, and its own step
   holds big requests' rows only while that costs about nothing).
4. The step's bucket is chosen once and its row ranges (views of the requests' arrays) are copied
   once into one buffer of that many rows (``api.pad_rows``; no copy when one range fills it),
   which the engine runs as one step (``device_steps.run_step``) on the single device-worker
   thread, except on the idle fast path (``_runs_inline``): a lone request, the device thread free,
   traffic sparse (no step within the last step time, or queue delay if padded), a step expected
   within ``--inline-step-max-ms``: run on the loop, saving two thread switches; ``direct.forward_now``
   is that path for a front end's own thread (the native port's), when nothing at all is admitted.
   Step seconds feed the step-time estimates. Non-finite outputs (inputs that overflow the layer)
   fail their request INVALID_ARGUMENT; a failed merged step is re-run range by range, so a bad
   request fails alone.
5. Results are cut back per request (views) and joined into the client's own result types
   (``expertd.server.batching.results``; a large request's off the event loop, ``offload``), each
   request's output cast once to its caller's dtype, with its ``Timing``: ``compute_seconds``
   (the steps that computed its rows) and ``queue_seconds`` (the rest of its time until its last
   step ended), the latter observed in ``expertd_queue_duration_seconds`` once per request.
6. Per-expert token counts feed the load tracker (GetExpertLoad) and the metrics.

Route requests are merged the same way. The aux loss is a statistic of a request's own tokens:
each request's tokens per expert and score sums come from its own rows (summed over its steps
when it was split), and its loss is computed from them on the host (``results.route_result``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time

import numpy as np

from expertd.client.messages import ForwardResult, RouteResult
from expertd.server.batching import device_steps, offload, results
from expertd.server.batching.admission import Admission, Limits, RunningSteps, StepTimes
from expertd.server.batching.direct import DirectPath, Occupancy
from expertd.server.batching.queues import LayerQueue, QueuedRequest, Queues, Ticket
from expertd.server.batching.requests import ForwardRequest, Header, RouteRequest
from expertd.server.batching.scheduling import StepScheduling
from expertd.server.config import BatchingConfig
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription
from expertd.server.errors import DeadlineExpired, NotReady, Overloaded
from expertd.server.metrics.expert_load import ExpertLoadTracker
from expertd.server.metrics.families import Metrics

WARMING_UP = "warming up: the model is still compiling; retry when health reports SERVING"
DRAINING = "draining: not accepting new requests"
"""Why a request is refused UNAVAILABLE before warm-up ends and from the drain on (every front end says the same)."""

DEADLINE_TOLERANCE_S = 0.01  # a call cancelled this close to its deadline ended by its deadline
BACKLOG_READ_TIMEOUT_S = 0.5  # how long a scrape waits for the loop to compute the backlog gauge


@dataclasses.dataclass(slots=True)
class Timing:
    """One request's seconds in the batcher: waiting (for its batch to form and for earlier steps)
    and in the engine steps that computed its rows."""

    queue_seconds: float
    compute_seconds: float


class Batcher(StepScheduling):
    """Per-(layer, step kind) queues in front of one engine (see module docstring).

    Threads: the server's event loop owns it (queues, tickets, scheduler tasks, futures); the one
    entry for other threads is ``direct`` (``batching.direct.DirectPath``), which shares only
    ``occupancy`` (under its lock) and the locked step times, loads and metrics. The metrics scrape
    thread reads the backlog gauge through the loop (``_backlog_gauge``).

    Args:
      engine: runs the steps (``expertd.server.engine.engine.Engine``, whose lock serializes them, or the
        multi-host leader's wrapper, never given to ``direct.forward_now``'s callers).
      model: the served layers and buckets.
      config: batching and admission limits.
      metrics: where batches, queue times, drops, refusals and routing are recorded.
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
        self.times = StepTimes()
        self._config_ids = {cfg: index for index, cfg in enumerate(dict.fromkeys(model.layers.values()))}
        self.admission = Admission(Limits(config.max_queue_size, config.queue_tokens, config.max_queue_wait_ms / 1e3,
                                          self.max_part_tokens), self.times, model.bucket_for)
        sized = (lambda queue, rows: self.times.rows_at_cost_of(queue.step_key, model.bucket_for(rows), model.buckets,
                                                                config.small_step_slack))
        self.queues = Queues(self.max_part_tokens, self._expire, sized if config.small_step_slack else None)
        self.draining = False
        self.occupancy = Occupancy()  # shared with the direct path's threads, under its lock
        self.direct = DirectPath(self)  # the off-loop entry for a transport's own thread
        self._buckets = frozenset(model.buckets)
        self._running = RunningSteps()  # the steps handed over and not ended
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the owner, known from ``start``
        self._last_backlog = 0.0
        metrics.track_pending(lambda: self.occupancy.pending)
        metrics.track_queue(lambda: self.queues.queued_tokens, self._backlog_gauge)
        metrics.track_expert_load(self.loads)

    # -- public API (called from servicers on the event loop) -----------------------------------
    def admit(self, header: Header, deadline: float | None) -> Ticket:
        """A place for a request of ``header.tokens`` rows, or ``NotReady`` / ``Overloaded`` at once."""
        queue = self._check(header, deadline)
        small = self.admission.is_small(header.tokens)
        self.queues.reserve(queue, header.tokens, small)
        self.occupancy.add_pending(1)
        self._idle.clear()
        return Ticket(self.queues, queue, header.tokens, small, self._done_one)

    def check_admission(self, header: Header, deadline: float | None) -> None:
        """``NotReady`` / ``Overloaded`` now if ``admit`` would refuse ``header``; reserves nothing
        (a call that declares its size and has not sent its body yet holds no place)."""
        self._check(header, deadline)

    def _check(self, header: Header, deadline: float | None) -> LayerQueue:
        if not self.occupancy.accepting:
            raise NotReady(DRAINING if self.draining else WARMING_UP)
        queue = self._queue(header.layer, header.kind)
        now = time.monotonic()
        try:
            self.admission.check(queue, header.tokens, None if deadline is None else deadline - now,
                                 queues=self.queues.values(), running_s=self._running.seconds_left(now),
                                 pending=self.occupancy.pending, queued_tokens=self.queues.queued_tokens, now=now)
        except Overloaded as exc:
            self.metrics.observe_rejected(exc.reason)
            raise
        return queue

    async def forward(self, request: ForwardRequest, ticket: Ticket | None = None) -> tuple[ForwardResult, Timing]:
        """The layer output for ``request.tokens [T, H]`` in the caller's dtype, with the routing.
        Without a ``ticket`` the request is admitted here (``admit``)."""
        parts, timing = await self._submit(request.layer, api.FORWARD, request.tokens, request.deadline,
                                           request.field, ticket, request.token_ids)
        result = await offload.run(results.forward_result, parts, request.out_dtype,
                                   self.model.layers[request.layer].num_experts, elements=request.tokens.size)
        return result, timing

    async def route(self, request: RouteRequest, ticket: Ticket | None = None) -> tuple[RouteResult, Timing]:
        """Top-k routing of hidden states ``[T, H]`` or logits ``[T, E]``; aux loss times the request's coefficient."""
        kind = api.ROUTE_LOGITS if request.from_logits else api.ROUTE_HIDDEN
        parts, timing = await self._submit(request.layer, kind, request.tokens, request.deadline, request.field,
                                           ticket, request.token_ids)
        return results.route_result(parts, self.model.layers[request.layer], request.aux_loss_coeff), timing

    @property
    def pending(self) -> int:
        """Admitted requests not answered yet (decoding, queued or computing)."""
        return self.occupancy.pending

    @property
    def accepting(self) -> bool:
        return self.occupancy.accepting

    def backlog_seconds(self) -> float:
        """Expected seconds until the admitted work is done (the running step's rest included). On the loop."""
        now = time.monotonic()
        self._last_backlog = self.admission.backlog(self.queues.values(), self._running.seconds_left(now), now)
        return self._last_backlog

    def _backlog_gauge(self) -> float:
        """``backlog_seconds`` for the metrics scrape thread: computed on the loop, which owns the
        queues (the last value when the loop does not answer within BACKLOG_READ_TIMEOUT_S)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return self._last_backlog
        try:
            if asyncio.get_running_loop() is loop:
                return self.backlog_seconds()
        except RuntimeError:  # no loop runs on this thread: the scrape thread
            pass
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def compute():
            if not answer.cancelled():
                answer.set_result(self.backlog_seconds())

        try:
            loop.call_soon_threadsafe(compute)
            return answer.result(BACKLOG_READ_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop closed, or is busy
            answer.cancel()
            return self._last_backlog

    def start(self) -> None:
        """Accept requests (after warm-up). On the loop."""
        self._loop = asyncio.get_running_loop()
        with self.occupancy.lock:
            self.occupancy.accepting = True

    async def drain(self) -> None:
        """Stop accepting; return when every accepted request has been answered."""
        with self.occupancy.lock:
            self.occupancy.accepting = False
        self.draining = True
        await self._idle.wait()

    async def close(self) -> None:
        tasks = [q.task for q in self.queues.values() if q.task is not None]
        for task in tasks:
            task.cancel()
        self.queues.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def run_on_device(self, fn, *args):
        """Run ``fn(*args)`` on the device-worker thread (warm-up, engine steps, weight swaps)."""
        self.occupancy.add_device_jobs(1)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.occupancy.add_device_jobs(-1)

    async def calibrate(self) -> None:
        """Seed the step-time estimates (``device_steps.calibrate``). After warm-up, before ``start``."""
        await self.run_on_device(device_steps.calibrate, self.engine, self.model, self.times, self.max_part_tokens,
                                 self.step_key)

    def step_key(self, cfg, kind: str) -> tuple[int, str]:
        """The ``times`` key of layer config ``cfg``'s steps of ``kind``: an int for the config (cheap to hash)."""
        return self._config_ids[cfg], kind

    # -- queueing -------------------------------------------------------------------------------
    def _queue(self, layer: int, kind: str) -> LayerQueue:
        queue = self.queues.get(layer, kind)
        if queue is None:
            queue = self.queues.add(LayerQueue(layer, kind, self.step_key(self.model.layers[layer], kind)))
            queue.task = asyncio.ensure_future(self._schedule(queue))
        return queue

    async def _submit(self, layer: int, kind: str, tokens: np.ndarray, deadline: float | None, field: str,
                      ticket: Ticket | None, token_ids: np.ndarray | None = None) -> tuple[list, Timing]:
        """Queue ``tokens``; (each step's result for its rows, in row order; the request's Timing)."""
        if ticket is None:
            ticket = self.admit(Header(layer, kind, len(tokens)), deadline)
        queue = ticket.queue
        if (queue.layer, queue.kind, ticket.tokens) != (layer, kind, len(tokens)) or not ticket.open:
            ticket.release()
            raise ValueError("the ticket was admitted for another request")
        ticket.open = False
        loop = asyncio.get_running_loop()
        request = QueuedRequest(queue, tokens, field, deadline, time.monotonic(), loop.create_future(), ticket.small,
                                token_ids=token_ids)
        inline = self._runs_inline(queue, len(tokens))  # then its step runs here: no scheduler to wake
        self.queues.enqueue(request, wake=not inline)  # inline: its step ends before this call returns
        try:
            if inline and (batch := self.queues.take(queue, time.monotonic())):
                await self._execute(queue, batch, inline=True)
            pieces = await request.future
            queued = max(request.last_end - request.arrived - request.compute_seconds, 0.0)
            self.metrics.observe_queue("forward" if kind == api.FORWARD else "route", queued)
            return pieces, Timing(queued, request.compute_seconds)
        finally:
            if not request.ended:  # the call went away (cancelled, or gRPC ended it at its deadline)
                late = deadline is not None and time.monotonic() >= deadline - DEADLINE_TOLERANCE_S
                self.metrics.observe_dropped("deadline" if late else "cancelled")
                self.queues.end(request)
            self._done_one()

    def _done_one(self) -> None:
        if self.occupancy.add_pending(-1) == 0:
            self._idle.set()

    def _fail(self, request: QueuedRequest, exc: BaseException) -> None:
        self.queues.end(request)
        if not request.future.done():
            request.future.set_exception(exc)

    def _expire(self, request: QueuedRequest) -> None:
        """Its deadline passed before its last rows were computed: dropped, counted once."""
        if not request.ended:
            self.metrics.observe_dropped("deadline")
            self._fail(request, DeadlineExpired("deadline passed while queued; dropped before compute"))
