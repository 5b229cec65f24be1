"""Admission: whether a request may join the batcher's queues, decided at once from its header
(layer, step kind, tokens, deadline), before its tensor is decoded or scanned, from the work
already queued and the measured step times.

Step times (``StepTimes``): per (layer config, step kind, bucket), an exponentially weighted moving
average of the seconds the batcher's own steps took on the device thread; ``Batcher.calibrate``
seeds every entry at start-up by running each step once.

Expected completion of a request of T tokens on queue q (M: rows per step, rows: a queue's tokens
accepted and not yet taken into a step):
- The device runs one step at a time for every queue. The work ahead of a request is the rest of
  the running step plus each queue's rows, drained in steps of M rows (``drain``: full steps at
  t(M), the remainder at t(its bucket)); first in, first out, this is its completion. A queue
  waiting for more requests to fill its next step (``--max-queue-delay-ms``) finishes no earlier
  than that wait plus its own rows.
- A small request (T <= M / 2) goes into one of the next steps of its queue, before big requests'
  rows (the batcher takes small requests first and keeps half a step for the oldest big one): it
  waits for the small rows ahead of it at ``small_share`` rows per step of its queue, each such
  step costing one step of every busy queue. Its estimate is the smaller of that and the above
  (an upper bound: a step carrying small requests may be sized for them, ``Queues.take``).

A request is refused with ``Overloaded`` (RESOURCE_EXHAUSTED and a RetryInfo delay) when, checked
in this order:
1. ``queue_size``: ``max_queue_size`` requests are pending already (a hard cap on requests);
2. ``queue_tokens``: its tokens would take the queued tokens past ``max_queue_tokens`` (memory);
3. ``queue_wait``: its expected wait for the work ahead of it (completion minus its own compute,
   without the queue delay an operator configured) exceeds ``max_queue_wait``;
4. ``deadline``: its expected completion, times ``MARGIN``, is later than its deadline.
Nothing is refused while the device is idle and nothing is queued: an estimate can then only be
wrong by refusing work the server had time for (and the step that runs measures it).

RetryInfo is the time until the queued work will have drained enough for the same request (same
size, same time to its deadline) to pass, assuming no new arrivals; at least ``MIN_RETRY_S``.

Before the estimates, an upper bound admits at once when it is in time (every queued step at its
bucket's slowest estimate): it never admits what the estimates would refuse
(``tests/server/batching/test_admission_bounds.py``), and most calls of a busy server stop there.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable

from expertd.server.errors import Overloaded

MARGIN = 1.25
"""Expected completion x MARGIN must be within the deadline: room for step times that vary
(the benchmark and ``tests/server/batching/test_overload.py`` show the goodput this leaves)."""
MIN_RETRY_S = 0.01
EWMA_WEIGHT = 0.2
"""Weight of the newest step in the step-time average (about the last 10 steps count)."""


class StepTimes:
    """Seconds of one engine step per (step key, bucket); the step key is (layer config, kind).

    ``estimate`` (what admission reads): an exponentially weighted moving average of the measured
    steps. ``rows_at_cost_of`` (how a step carrying small requests is sized) reads the fastest each
    bucket has run instead: the device's own cost of that many rows, which contention on the host
    can only lengthen, so one slow small step does not change the policy for good. Either, for a
    bucket never measured, falls back to the nearest smaller measured bucket of the same key (a
    step is no faster with more rows), else 0 (optimistic: admit and measure).

    Threads: the event loop and the direct path (``batching.direct``) both observe and read it; every
    method holds ``_lock``.
    """

    def __init__(self, weight: float = EWMA_WEIGHT):
        self._weight = weight
        self._seconds: dict[tuple[Hashable, int], float] = {}
        self._fastest: dict[tuple[Hashable, int], float] = {}
        self._slowest: dict[Hashable, float] = {}
        self._buckets: dict[Hashable, list[int]] = {}
        self._lock = threading.Lock()

    def observe(self, key: Hashable, bucket: int, seconds: float) -> None:
        with self._lock:
            self._observe(key, bucket, seconds)

    def _observe(self, key: Hashable, bucket: int, seconds: float) -> None:
        old = self._seconds.get((key, bucket))
        if old is None:
            self._seconds[(key, bucket)] = self._fastest[(key, bucket)] = seconds
            self._buckets.setdefault(key, []).append(bucket)
            self._buckets[key].sort()
        else:
            self._seconds[(key, bucket)] = old + self._weight * (seconds - old)
            self._fastest[(key, bucket)] = min(self._fastest[(key, bucket)], seconds)
        self._slowest[key] = max(self._seconds[(key, b)] for b in self._buckets[key])

    def seed(self, key: Hashable, bucket: int, seconds: float) -> None:
        """Replace the estimate (calibration)."""
        with self._lock:
            self._seconds.pop((key, bucket), None)
            if bucket in self._buckets.get(key, ()):
                self._buckets[key].remove(bucket)
            self._observe(key, bucket, seconds)

    def estimate(self, key: Hashable, bucket: int) -> float:
        with self._lock:
            return self._lookup(self._seconds, key, bucket)

    def slowest(self, key: Hashable) -> float:
        """The largest estimate of any bucket of ``key`` (0 before any): no step of it is expected longer."""
        with self._lock:
            return self._slowest.get(key, 0.0)

    def rows_at_cost_of(self, key: Hashable, bucket: int, buckets: Iterable[int], slack: float) -> int:
        """The largest of ``buckets`` whose step has run within ``slack`` x the time of a step of
        ``bucket`` (at least ``bucket``), both at their fastest: how far a step can grow at about the
        same cost. Where step time barely grows with rows (a GPU) that is the largest bucket; on a
        CPU, a few more."""
        with self._lock:
            budget = slack * self._lookup(self._fastest, key, bucket)
            return max([b for b in buckets if b >= bucket and self._lookup(self._fastest, key, b) <= budget],
                       default=bucket)

    def _lookup(self, table: dict, key: Hashable, bucket: int) -> float:
        seconds = table.get((key, bucket))
        if seconds is not None:
            return seconds
        smaller = [b for b in self._buckets.get(key, ()) if b < bucket]
        return table[(key, smaller[-1])] if smaller else 0.0


class RunningSteps:
    """The steps handed to run and not ended, each with its expected seconds when handed over: the
    running work admission counts (``seconds_left``). O(1) per call."""

    def __init__(self):
        self._steps: dict[int, tuple[float, float]] = {}  # step -> (monotonic start, expected s)
        self._seconds = 0.0  # their expected seconds, summed
        self._started = 0

    def start(self, expected: float) -> int:
        """A step expected to take ``expected`` seconds is handed over now: its id for ``end``."""
        self._started += 1
        self._steps[self._started] = (time.monotonic(), expected)
        self._seconds += expected
        return self._started

    def end(self, step: int) -> None:
        """Step ``step`` ended (again: nothing)."""
        since_expected = self._steps.pop(step, None)
        if since_expected is not None:  # a sum left by the last step is rounding: reset it
            self._seconds = self._seconds - since_expected[1] if self._steps else 0.0

    def seconds_left(self, now: float) -> float:
        """Expected seconds left of the steps: the oldest runs (the first handed over), the others wait."""
        if not self._steps:
            return 0.0
        since, first = next(iter(self._steps.values()))
        return max(self._seconds - min(now - since, first), 0.0)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds of admission (``BatchingConfig``: --max-queue-size, --max-queue-tokens,
    --max-queue-wait-ms) and M, the rows of one step."""

    max_requests: int
    max_tokens: int
    max_wait_s: float
    step_rows: int


class Admission:
    """The decision above, over the batcher's queues.

    Args:
      limits: the bounds.
      times: the step-time estimates.
      bucket_for: rows -> the bucket a step of that many rows is padded to.

    A queue, as read here, has ``step_key`` (standing for its layer config and kind), ``rows``
    (tokens accepted and not yet taken into a step, reservations included), ``small_rows`` (those
    of small requests) and ``gather_until`` (the monotonic time its scheduler waits until for more
    requests, or 0).
    """

    def __init__(self, limits: Limits, times: StepTimes, bucket_for: Callable[[int], int]):
        self.limits = limits
        self.times = times
        self._bucket_for = bucket_for
        self._full_bucket = bucket_for(limits.step_rows)

    def is_small(self, tokens: int) -> bool:
        """Requests of at most half a step go before big ones (see module docstring)."""
        return tokens <= self.limits.step_rows // 2

    def drain(self, key: Hashable, rows: int) -> float:
        """Seconds to compute ``rows`` rows of one queue in steps of M rows."""
        if rows <= 0:
            return 0.0
        full, rest = divmod(rows, self.limits.step_rows)
        seconds = full * self.times.estimate(key, self._full_bucket)
        return seconds + (self.times.estimate(key, self._bucket_for(rest)) if rest else 0.0)

    def seconds_per_token(self, key: Hashable) -> float:
        """Expected seconds per token of one queue's work in full steps (the --max-queue-tokens
        refusal's retry delay per token over the bound)."""
        return self.drain(key, self.limits.step_rows) / self.limits.step_rows

    def backlog(self, queues: Iterable, running_s: float, now: float) -> float:
        """Seconds until the admitted work is done: the running step's rest and every queued row."""
        total, latest = running_s, 0.0
        for q in queues:
            if q.rows:
                seconds = self.drain(q.step_key, q.rows)
                total += seconds
                latest = max(latest, q.gather_until - now + seconds)
        return max(total, latest)

    def check(self, queue, tokens: int, deadline_in: float | None, *, queues: Iterable, running_s: float,
              pending: int, queued_tokens: int, now: float) -> None:
        """Raise ``Overloaded`` (with its reason and RetryInfo delay) unless a request of ``tokens``
        rows on ``queue``, due in ``deadline_in`` seconds (None: no deadline), may join it."""
        limits = self.limits
        queues = [q for q in queues if q.rows]
        if not queues and running_s <= 0:
            return  # idle: always try
        if pending >= limits.max_requests:
            backlog = self.backlog(queues, running_s, now)
            raise Overloaded(f"overloaded: {pending} requests pending (--max-queue-size {limits.max_requests}); "
                             f"retry later", _retry(max(backlog / max(pending, 1), _first_gather(queues, now))),
                             "queue_size")
        if queued_tokens + tokens > limits.max_tokens:
            excess = queued_tokens + tokens - limits.max_tokens
            raise Overloaded(f"overloaded: {queued_tokens} tokens queued, {tokens} more would pass "
                             f"--max-queue-tokens {limits.max_tokens}; retry later",
                             _retry(excess * self.seconds_per_token(queue.step_key)),
                             "queue_tokens")
        if self._surely_in_time(queue, tokens, deadline_in, queues, running_s, now):
            return
        own = self.drain(queue.step_key, tokens)
        mine = self.drain(queue.step_key, queue.rows + tokens)
        fifo = running_s + sum(self.drain(q.step_key, q.rows) for q in queues if q is not queue) + mine
        rows = queue.rows + tokens
        fills = rows >= limits.step_rows or self._bucket_for(rows) == rows  # its queue then waits no more
        gather_s = 0.0 if fills else max(queue.gather_until - now, 0.0)
        ahead = self._completion(queue, tokens, queues, running_s, 0.0, fifo, mine)
        wait = max(ahead - own, 0.0)  # the work ahead alone
        completion = self._completion(queue, tokens, queues, running_s, gather_s, fifo, mine) if gather_s else ahead
        if wait > limits.max_wait_s:
            raise Overloaded(f"overloaded: expected wait {wait:.3f}s exceeds --max-queue-wait-ms "
                             f"{limits.max_wait_s * 1e3:g}; retry later", _retry(wait - limits.max_wait_s),
                             "queue_wait")
        if deadline_in is not None and completion * MARGIN > deadline_in:
            raise Overloaded(f"overloaded: expected to finish in {completion:.3f}s, too late for the deadline in "
                             f"{max(deadline_in, 0.0):.3f}s; retry later",
                             _retry(completion - deadline_in / MARGIN), "deadline")

    def _surely_in_time(self, queue, tokens: int, deadline_in: float | None, queues: list, running_s: float,
                        now: float) -> bool:
        """True when even with every step of every queue at its slowest bucket's time the request
        waits within ``max_wait`` and ends within its deadline: then the estimates pass too. One
        step-time lookup per busy queue, where ``drain`` needs two per queue and call."""
        step_rows, slowest = self.limits.step_rows, self.times.slowest
        bound = running_s
        for q in queues:
            if q is not queue:
                bound += -(-q.rows // step_rows) * slowest(q.step_key)
        mine = -(-(queue.rows + tokens) // step_rows) * slowest(queue.step_key)
        bound += mine
        if bound > self.limits.max_wait_s:
            return False
        return deadline_in is None or max(bound, queue.gather_until - now + mine) * MARGIN <= deadline_in

    def _completion(self, queue, tokens: int, queues: list, running_s: float, gather_s: float, fifo: float,
                    mine: float) -> float:
        """Expected seconds until a new request of ``tokens`` rows on ``queue`` is computed, its queue
        waiting ``gather_s`` more for company first; ``fifo``: the running step's rest plus every
        queue's rows with its own (``mine``: its queue's rows with its own)."""
        fifo = max(fifo, gather_s + mine)
        if not self.is_small(tokens):
            return fifo
        step_rows = self.limits.step_rows
        big_rows = queue.rows - queue.small_rows
        share = step_rows - min(step_rows // 2, big_rows) if big_rows > 0 else step_rows
        steps = math.ceil((queue.small_rows + tokens) / max(share, 1))
        cycle = sum(self.times.estimate(q.step_key, self._bucket_for(min(q.rows, step_rows)))
                    for q in queues if q is not queue)
        cycle += self.times.estimate(queue.step_key, self._bucket_for(min(queue.rows + tokens, step_rows)))
        return min(fifo, max(running_s, gather_s) + steps * cycle)


def _retry(seconds: float) -> float:
    return max(MIN_RETRY_S, seconds)


def _first_gather(queues: list, now: float) -> float:
    """Seconds until the first queue waiting for company stops waiting (0 when none waits)."""
    waits = [q.gather_until - now for q in queues if q.gather_until > now]
    return min(waits) if waits else 0.0
