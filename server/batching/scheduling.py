"""How the batcher's queued requests become engine steps (steps 3-6 of ``batcher``'s flow): one
scheduler task per queue gathers a step's rows, the step runs on the device-worker thread (or
inline on the loop, the idle fast path), its results are cut back per request and recorded.

``StepScheduling`` is a part of ``Batcher`` (its base class), kept apart because it is the one
piece that talks to the engine. It runs on the event loop and uses the batcher's ``engine``,
``model``, ``config``, ``metrics``, ``times``, ``loads``, ``queues``, ``occupancy``, ``draining``,
``max_part_tokens``, ``_buckets``, ``_running``, ``run_on_device`` and ``_fail``.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from expertd.server.batching import device_steps, results
from expertd.server.batching.queues import Batch, LayerQueue, QueuedRequest
from expertd.server.engine import api


class StepScheduling:
    """The scheduler tasks, step execution and step records of a ``Batcher`` (module docstring)."""

    async def _schedule(self, queue: LayerQueue) -> None:
        last_step_end = 0.0
        while True:
            while queue.queued <= 0:
                queue.wakeup.clear()
                await queue.wakeup.wait()
            await self._gather(queue, last_step_end)
            batch = self.queues.take(queue, time.monotonic())
            if batch:
                await self._execute(queue, batch)
                last_step_end = time.monotonic()
            else:  # only cancelled requests were left: let their callers account for them
                await asyncio.sleep(0)

    async def _gather(self, queue: LayerQueue, last_step_end: float) -> None:
        """Wait, at most the queue delay, for more requests to join the next step.

        No wait when the queued rows fill a bucket exactly (nothing to gain) or M. The delay counts
        from the oldest request's arrival or the end of the previous step, whichever is later, so
        callers just answered by that step can come back and fill the padding of the next one
        (closed-loop clients otherwise settle into half-full batches).
        """
        delay = self.config.max_queue_delay_ms / 1000.0
        while not self.draining:
            rows = queue.queued
            if rows >= self.max_part_tokens or rows in self._buckets:
                return
            now = time.monotonic()
            oldest = self.queues.oldest_arrival(queue, now)
            if oldest is None:
                return
            remaining = max(oldest, last_step_end) + delay - now
            if remaining <= 0:
                return
            queue.wakeup.clear()
            queue.gather_until = now + remaining
            try:
                await asyncio.wait_for(queue.wakeup.wait(), remaining)
            except TimeoutError:
                return
            finally:
                queue.gather_until = 0.0

    # -- execution ------------------------------------------------------------------------------
    def _runs_inline(self, queue: LayerQueue, rows: int) -> bool:
        """The idle fast path (module docstring, step 4): this request is the only one admitted, the
        device thread has nothing to do, its step is expected within --inline-step-max-ms, and no
        step ran within that time (or, for a padded batch, within the queue delay)."""
        limit_s = self.config.inline_step_max_ms / 1e3
        if not (limit_s > 0 and queue.queued == 0 and rows <= self.max_part_tokens):
            return False
        alone, last_step_end = self.occupancy.idle_for_inline()
        if not alone:
            return False
        bucket = self.model.bucket_for(rows)
        expected = self.times.estimate(queue.step_key, bucket)
        if expected > limit_s:
            return False
        quiet = expected if rows == bucket else max(expected, self.config.max_queue_delay_ms / 1e3)
        return time.monotonic() - last_step_end >= quiet

    async def _execute(self, queue: LayerQueue, batch: Batch, inline: bool = False) -> None:
        rows = sum(stop - start for _, start, stop in batch)
        bucket = self.model.bucket_for(rows)
        step = self._running.start(self.times.estimate(queue.step_key, bucket))
        try:
            # token ids ride with their rows, padded to the bucket; None unless every request has them
            ids = None if any(r.token_ids is None for r, _, _ in batch) else \
                api.pad_rows([r.token_ids[start:stop] for r, start, stop in batch], bucket)
            parts = [r.tokens[start:stop] for r, start, stop in batch]
            args = (self.engine, queue.layer, queue.kind, parts, bucket, rows, ids)
            result, seconds, bad_rows = device_steps.run_step(*args) if inline else \
                await self.run_on_device(device_steps.run_step, *args)
        except Exception as exc:  # noqa: BLE001 - handed to the requests' futures
            self._running.end(step)
            if len(batch) > 1:
                for entry in batch:  # isolate the failing request; the others still get answers
                    await self._execute(queue, [entry])
            else:
                self._fail(batch[0][0], exc)
            return
        finally:
            self._running.end(step)
            ended = self.occupancy.step_ended()
        self.record(queue.step_key, queue.layer, queue.kind, rows, bucket, len(batch), seconds, result)
        offset = 0
        for request, start, stop in batch:
            span = slice(offset, offset + stop - start)
            offset = span.stop
            if request.ended or request.future.done():
                continue
            if bad_rows is not None and bad_rows[span].any():
                self._fail(request, results.not_finite(request.field, start + int(np.argmax(bad_rows[span]))))
                continue
            self._deliver(request, start, results.step_piece(queue.kind, result, span), seconds, ended)

    def _deliver(self, request: QueuedRequest, start: int, piece: tuple, seconds: float, ended: float) -> None:
        """Rows ``start:`` of ``request`` computed (``piece``, ``results.step_piece``)."""
        if (pieces := request.add(start, piece, seconds, ended)) is not None:
            self.queues.end(request)
            request.future.set_result(pieces)

    def record(self, step_key, layer: int, kind: str, rows: int, bucket: int, num_parts: int, seconds: float,
                result) -> None:
        """One step of ``seconds`` done: the step-time estimates, the metrics, the expert loads."""
        self.times.observe(step_key, bucket, seconds)
        metric_kind = "forward" if kind == api.FORWARD else "route"
        self.metrics.observe_batch(layer=layer, kind=metric_kind, num_valid=rows, bucket=bucket,
                                   num_requests=num_parts, seconds=seconds)
        self.loads.add(layer, result.tokens_per_expert)
        if kind != api.FORWARD:
            self.metrics.set_aux_loss(layer, result.aux_loss)

