"""The batcher's one off-loop entry: a lone Forward computed on a transport's own thread.

The batcher belongs to the server's event loop (its queues, tickets, scheduler tasks and futures are
the loop's alone). A transport that answers on threads of its own (the native port's gRPC and
runner threads) may skip the loop for a lone call at an idle server: ``DirectPath.forward_now``
computes it on the calling thread. What that thread shares with the loop is ``Occupancy``, and
every read and write of it holds its lock; the step-time estimates (``admission.StepTimes``), the
expert loads and the metrics it records into have locks of their own. Steps themselves serialize
on the engine's lock, so a direct step and the batcher's never overlap.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from expertd.server.batching import device_steps, results
from expertd.server.batching.requests import ForwardRequest
from expertd.server.engine import api


class Occupancy:
    """What the batcher's loop and a direct caller both read and write, guarded by ``lock``:

    - ``accepting``: requests are accepted (after warm-up, until the drain);
    - ``pending``: requests admitted and not answered (the loop's);
    - ``device_jobs``: jobs handed to the device-worker thread and not finished (the loop's);
    - ``direct``: a direct step is running (``DirectPath``'s);
    - ``last_step_end``: monotonic end of the latest step, either kind.
    Owned by no thread: every access holds ``lock`` (uncontended, a fraction of a microsecond).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.accepting = False
        self.pending = 0
        self.device_jobs = 0
        self.direct = False
        self.last_step_end = 0.0

    def add_pending(self, delta: int) -> int:
        """``pending += delta``; the new count."""
        with self.lock:
            self.pending += delta
            return self.pending

    def add_device_jobs(self, delta: int) -> None:
        with self.lock:
            self.device_jobs += delta

    def step_ended(self) -> float:
        """Record that a step ended now; the time."""
        with self.lock:
            self.last_step_end = now = time.monotonic()
            return now

    def idle_for_inline(self) -> tuple[bool, float]:
        """(exactly one request admitted, nothing on the device thread or direct; the latest step's end)."""
        with self.lock:
            return (self.pending == 1 and self.device_jobs == 0 and not self.direct), self.last_step_end

    def claim_direct(self) -> bool:
        """Claim the server for a direct step: True, with ``direct`` set, when accepting and nothing at
        all is admitted, on the device thread or in another direct step."""
        with self.lock:
            if not self.accepting or self.direct or self.pending or self.device_jobs:
                return False
            self.direct = True
            return True

    def release_direct(self) -> None:
        with self.lock:
            self.direct, self.last_step_end = False, time.monotonic()


class DirectPath:
    """``forward_now`` for a transport thread, over the batcher's engine, model, step times and
    records. Any thread may call it; it never touches the loop's state beyond ``Occupancy``."""

    def __init__(self, batcher):
        self._batcher = batcher
        self._occupancy: Occupancy = batcher.occupancy

    def forward_now(self, request: ForwardRequest, answer: Callable[[np.ndarray], None]) -> bool:
        """Compute ``request`` now on the calling thread, ``answer`` its output ``[T, H]`` in the
        caller's dtype, then record the step as the batcher records every step; False, doing nothing,
        unless the server is idle (``Occupancy.claim_direct``) and the step fits one bucket and is
        expected within the deadline. InvalidRequest for a non-finite output (after the step is
        recorded)."""
        batcher = self._batcher
        rows, cfg = len(request.tokens), batcher.model.layers[request.layer]
        if rows > batcher.max_part_tokens:
            return False
        key, bucket = batcher.step_key(cfg, api.FORWARD), batcher.model.bucket_for(rows)
        if request.deadline is not None and request.deadline < time.monotonic() + batcher.times.estimate(key, bucket):
            return False
        if not self._occupancy.claim_direct():
            return False
        try:
            ids = None if request.token_ids is None else api.pad_rows([request.token_ids], bucket)
            result, seconds, bad_rows = device_steps.run_step(batcher.engine, request.layer, api.FORWARD,
                                                              [request.tokens], bucket, rows, ids)
        finally:
            self._occupancy.release_direct()
        if bad_rows is None:
            answer(api.cast(result.output, request.out_dtype))
        batcher.record(key, request.layer, api.FORWARD, rows, bucket, 1, seconds, result)
        batcher.metrics.observe_queue("forward", 0.0)
        if bad_rows is not None:
            raise results.not_finite(request.field, int(np.argmax(bad_rows)))
        return True
