"""The batcher's queues: the requests of each (layer, step kind), the accounting of their rows, and
how one step's rows are taken from a queue.

A queue keeps small requests (at most half a step of rows, ``Admission.is_small``) and big ones in
two FIFOs. ``take`` fills one step of M rows: small requests first, whole, in arrival order, while
they fit beside the rows kept for the oldest big request (half a step, or all it has left when
less); then rows of big requests, in arrival order, fill the step. So big requests are split across
steps (views, never copies) and keep progressing, and a small request waits for the running step
and at most one step holding big requests' rows.

A step that carries small requests is sized for them: big requests' rows join it only up to the
rows a step can hold at about the cost of the small rows' own step (``small_step_rows``, from the
measured step times: where a step's time grows with its rows, as on a CPU, the small requests do
not wait for a full step of another client's work; where it barely does, as on a GPU, the step is
filled as before). A step so limited leaves the oldest big request less than its kept rows, so the
next step of the queue is a full one (``big_owed``): big requests get at least half a step every
other step, however many small requests keep arriving.

A ``Ticket`` is an admitted request's reservation: its tokens count as queued from admission on.

Accounting (what admission reads): ``LayerQueue.rows`` are tokens admitted and not yet taken into a
step (``reserved``: those of tickets whose request is not queued yet), ``small_rows`` those of
small requests; ``Queues.queued_tokens`` sums ``rows`` over every queue. A request leaves the
accounting once (``end``), whether answered, failed, expired or cancelled.

Deadlines: each queue has one timer, armed for the earliest deadline of its queued requests. When
it fires it expires every request still queued (rows not all taken into a step) whose deadline
has passed and re-arms for the next; ``head`` drops expired requests as a step is formed. A
request whose last rows are in a running step finishes that step (gRPC itself ends the call at its
deadline). One timer per queue instead of one per request: a request costs a comparison, not a
timer handle armed and cancelled.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np


class LayerQueue:
    """The requests of one (layer, kind), with ``step_key`` (standing for its layer config and kind) for step times."""

    def __init__(self, layer: int, kind: str, step_key):
        self.layer, self.kind, self.step_key = layer, kind, step_key
        self.small: collections.deque[QueuedRequest] = collections.deque()
        self.big: collections.deque[QueuedRequest] = collections.deque()
        self.rows = self.small_rows = self.reserved = 0
        self.gather_until = 0.0  # while the scheduler waits for company: until when (monotonic)
        self.big_owed = False  # the last step was sized for small requests: the next one is full
        self.expiry: asyncio.TimerHandle | None = None  # fires at the earliest queued deadline
        self._expiry_at = 0.0
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def expiry_at(self) -> float:
        """When the deadline timer fires (``time.monotonic``), 0 when none is armed."""
        return self._expiry_at if self.expiry is not None else 0.0

    def arm_expiry(self, deadline: float, callback) -> None:
        """``callback(self)`` at ``deadline`` (``time.monotonic``, as request deadlines are: the event
        loop's own clock may differ, uvloop's does), replacing the timer armed before."""
        if self.expiry is not None:
            self.expiry.cancel()
        self._expiry_at = deadline
        self.expiry = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), callback, self)

    @property
    def queued(self) -> int:
        """Rows of queued requests not yet taken into a step (reservations excluded)."""
        return self.rows - self.reserved


@dataclasses.dataclass(eq=False, slots=True)
class QueuedRequest:
    """One queued call: its tokens [T, W] (and their vocabulary ids [T] int32, or None), how many
    rows steps took and computed, its results so far."""

    queue: LayerQueue
    tokens: np.ndarray
    field: str
    deadline: float | None
    arrived: float
    future: asyncio.Future
    small: bool
    taken: int = 0
    computed: int = 0
    pieces: list = dataclasses.field(default_factory=list)  # (first row, result tuple)
    compute_seconds: float = 0.0
    last_end: float = 0.0
    ended: bool = False
    token_ids: np.ndarray | None = None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.taken

    def add(self, start: int, piece: tuple, seconds: float, ended: float) -> list | None:
        """Rows ``start:`` of ``piece``'s length computed by a step of ``seconds`` that ended at
        ``ended``: the pieces in row order once every row is computed, else None."""
        self.pieces.append((start, piece))
        self.computed += len(piece[0])
        self.compute_seconds += seconds
        self.last_end = ended
        if self.computed < len(self.tokens):
            return None
        return [self.pieces[0][1]] if len(self.pieces) == 1 else [p for _, p in sorted(self.pieces, key=lambda p: p[0])]


Batch = list[tuple[QueuedRequest, int, int]]  # one step's row ranges: (request, first row, end row)


class Queues:
    """Every queue of one batcher. ``expire(request)`` is called for a request found past its
    deadline; it must end it (``end``). ``small_step_rows(queue, rows)``: the rows a step carrying
    ``rows`` rows of small requests may hold (default: a full step)."""

    def __init__(self, step_rows: int, expire: Callable[[QueuedRequest], None],
                 small_step_rows: Callable[[LayerQueue, int], int] | None = None):
        self.step_rows = step_rows
        self.small_step_rows = small_step_rows or (lambda queue, rows: step_rows)
        self.queued_tokens = 0
        self._expire = expire
        self._queues: dict[tuple[int, str], LayerQueue] = {}

    def get(self, layer: int, kind: str) -> LayerQueue | None:
        return self._queues.get((layer, kind))

    def add(self, queue: LayerQueue) -> LayerQueue:
        self._queues[(queue.layer, queue.kind)] = queue
        return queue

    def values(self) -> list[LayerQueue]:
        return list(self._queues.values())

    # -- accounting ------------------------------------------------------------------------------
    def reserve(self, queue: LayerQueue, tokens: int, small: bool, sign: int = 1) -> None:
        """Count an admitted request's rows (``sign`` -1: a released reservation)."""
        queue.rows += sign * tokens
        queue.reserved += sign * tokens
        queue.small_rows += sign * tokens if small else 0
        self.queued_tokens += sign * tokens

    def enqueue(self, request: QueuedRequest, wake: bool = True) -> None:
        """The reserved rows of ``request`` become queued ones; its queue's scheduler is woken and its
        deadline watched unless the caller takes them into a step itself (``wake=False``)."""
        queue = request.queue
        queue.reserved -= len(request.tokens)
        (queue.small if request.small else queue.big).append(request)
        if wake:
            queue.wakeup.set()
            if request.deadline is not None:
                self._expire_by(queue, request.deadline)

    def _expire_by(self, queue: LayerQueue, deadline: float) -> None:
        """Arm ``queue``'s timer for ``deadline`` (monotonic) unless it fires no later already."""
        if queue.expiry is not None and queue.expiry_at <= deadline:
            return
        queue.arm_expiry(deadline, self._expire_queued)

    def close(self) -> None:
        """Cancel every queue's deadline timer (the batcher is closing)."""
        for queue in self._queues.values():
            if queue.expiry is not None:
                queue.expiry.cancel()
                queue.expiry = None

    def _expire_queued(self, queue: LayerQueue) -> None:
        """The timer: expire the queued requests past their deadline, re-arm for the earliest left."""
        queue.expiry = None
        now = time.monotonic()
        earliest = None
        for fifo in (queue.small, queue.big):
            for request in fifo:  # expiring ends a request; it leaves its FIFO at the next ``head``
                if request.ended or request.deadline is None:
                    continue
                if request.deadline <= now:
                    self._expire(request)
                elif earliest is None or request.deadline < earliest:
                    earliest = request.deadline
        if earliest is not None:
            self._expire_by(queue, earliest)

    def end(self, request: QueuedRequest) -> bool:
        """The request leaves the accounting; False when it had already."""
        if request.ended:
            return False
        request.ended = True
        self._taken(request, request.remaining)
        return True

    def _taken(self, request: QueuedRequest, count: int) -> None:
        request.taken += count
        queue = request.queue
        queue.rows -= count
        queue.small_rows -= count if request.small else 0
        self.queued_tokens -= count

    # -- steps -----------------------------------------------------------------------------------
    def head(self, fifo: collections.deque[QueuedRequest], now: float) -> QueuedRequest | None:
        """The first live request of ``fifo``; ended, cancelled and expired ones are dropped on the way
        (a cancelled one is accounted for by its caller when it resumes)."""
        while fifo:
            request = fifo[0]
            if not request.ended and request.deadline is not None and request.deadline <= now:
                self._expire(request)
            if not request.ended and not request.future.done():
                return request
            fifo.popleft()
        return None

    def oldest_arrival(self, queue: LayerQueue, now: float) -> float | None:
        heads = [r for r in (self.head(queue.small, now), self.head(queue.big, now)) if r is not None]
        return min(r.arrived for r in heads) if heads else None

    def take(self, queue: LayerQueue, now: float) -> Batch:
        """One step's row ranges from ``queue`` (see module docstring)."""
        step = self.step_rows
        batch: Batch = []
        rows = 0
        oldest_big = self.head(queue.big, now)
        keep = min(oldest_big.remaining, max(step // 2, 1)) if oldest_big is not None else 0
        while (request := self.head(queue.small, now)) is not None and rows + request.remaining <= step - keep:
            queue.small.popleft()
            rows += self._take(request, request.remaining, batch)
        limit = step
        if rows and keep and not queue.big_owed:  # a step sized for its small requests
            limit = min(step, max(rows, self.small_step_rows(queue, rows)))
        queue.big_owed = limit - rows < keep
        while rows < limit and (request := self.head(queue.big, now)) is not None:
            rows += self._take(request, min(request.remaining, limit - rows), batch)
            if request.remaining == 0:
                queue.big.popleft()
        return batch

    def _take(self, request: QueuedRequest, count: int, batch: Batch) -> int:
        batch.append((request, request.taken, request.taken + count))
        self._taken(request, count)
        return count


class Ticket:
    """An admitted request's place (``Batcher.admit``); a context manager that releases it unless
    ``forward`` / ``route`` queued the request."""

    def __init__(self, queues: Queues, queue: LayerQueue, tokens: int, small: bool, done: Callable[[], None]):
        self._queues, self.queue, self.tokens, self.small, self._done = queues, queue, tokens, small, done
        self.open = True

    def release(self) -> None:
        if self.open:
            self.open = False
            self._queues.reserve(self.queue, self.tokens, self.small, sign=-1)
            self._done()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
