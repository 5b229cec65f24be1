"""Client-side adaptive throttling: while the server refuses many of a client's calls for lack of
room, the client refuses some of them itself, so that the server's cores go to the calls it
answers rather than to refusing the surplus (the client-side throttling of the Google SRE book,
"Handling Overload"). docs/overload.md has the measurements.

Each client counts, over the last ``window_s`` seconds, its attempts whose outcome is known
(``requests``: those the server answered, and those refused here) and the attempts the server did
not refuse with RESOURCE_EXHAUSTED (``accepts``). Attempts still in flight are not counted: a burst
of concurrent first calls would otherwise look like a server that accepts none of them. A call's
first attempt is refused here with probability

    min(max_probability, max(0, (requests - k * accepts) / (requests + 1)))

once the window holds ``min_requests``; so nothing is refused while the server accepts at least
1/k of the attempts (k = 2: half of them). Beyond that the client sends about k times what the
server accepts and the rest fails here at once, unsent, as
:class:`~expertd.client.errors.ThrottledError`: a ResourceExhaustedError carrying the server's
latest RetryInfo delay, so callers and the clients' own RESOURCE_EXHAUSTED retries treat it as the
server's refusal. Retries are never refused here: they are few (``retries``) and paced by that
delay, and a call the server would answer on retry is answered. At least 1 - max_probability of
the first attempts go out, so a recovered server is seen within a few calls; its accepts catch up,
the refusals stop, and counts older than the window are forgotten.

Only the calls the server admits by cost (Forward, Route) are counted and throttled.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time

from expertd.client.errors import ThrottledError

BUCKETS = 10  # the window is kept as this many buckets, each forgotten whole


@dataclasses.dataclass(frozen=True)
class Throttle:
    """Settings of a client's adaptive throttling (module docstring); ``throttle=None`` disables it.

    k: the multiple of the server's accepted calls a client keeps sending (>= 1; larger refuses
      later and less). window_s: how far back calls are counted (> 0). max_probability: the
      largest share of attempts refused here (in [0, 1): some always go out, to see recovery).
      min_requests: attempts the window must hold before any is refused (a few refusals in a
      quiet window say little)."""

    k: float = 2.0
    window_s: float = 1.0
    max_probability: float = 0.9
    min_requests: int = 20

    def __post_init__(self):
        if not self.k >= 1.0:
            raise ValueError(f"Throttle.k must be >= 1, got {self.k}")
        if not self.window_s > 0.0:
            raise ValueError(f"Throttle.window_s must be > 0, got {self.window_s}")
        if not 0.0 <= self.max_probability < 1.0:
            raise ValueError(f"Throttle.max_probability must be in [0, 1), got {self.max_probability}")
        if self.min_requests < 0:
            raise ValueError(f"Throttle.min_requests must be >= 0, got {self.min_requests}")


DEFAULT_THROTTLE = Throttle()  # immutable: one instance serves every client's default


class AdaptiveThrottle:
    """One client's counts and decisions. ``allow()`` before a call's first attempt (it counts the
    attempts it refuses), then ``accepted()`` or ``refused(retry_delay)`` after each attempt the
    server answered, retries included (accepted: anything but RESOURCE_EXHAUSTED). Safe from any
    thread; clients given the same instance (``throttle=``) share their counts."""

    def __init__(self, settings: Throttle = DEFAULT_THROTTLE, *, clock=time.monotonic, rand=random.random):
        self.settings = settings
        self._bucket_s = settings.window_s / BUCKETS
        self._clock, self._rand = clock, rand
        self._lock = threading.Lock()
        self._index = [-1] * BUCKETS  # which bucket of time each slot counts
        self._requests = [0] * BUCKETS
        self._accepts = [0] * BUCKETS
        self._total_requests = self._total_accepts = 0
        self._retry_delay: float | None = None  # the server's latest RetryInfo delay

    def _slot(self) -> int:
        """The slot of the current bucket; buckets older than the window are emptied first."""
        index = int(self._clock() / self._bucket_s)
        slot = index % BUCKETS
        if self._index[slot] != index:
            for old in range(BUCKETS):
                if self._index[old] <= index - BUCKETS:  # left the window (the current slot's old bucket too)
                    self._total_requests -= self._requests[old]
                    self._total_accepts -= self._accepts[old]
                    self._requests[old] = self._accepts[old] = 0
            self._index[slot] = index
        return slot

    def allow(self) -> bool:
        """Whether to send a first attempt; False (counted) when this client refuses it itself."""
        with self._lock:
            slot = self._slot()  # what left the window is forgotten first
            refuse = self._total_requests - self.settings.k * self._total_accepts
            probability = min(refuse / (self._total_requests + 1), self.settings.max_probability) \
                if refuse > 0 and self._total_requests >= self.settings.min_requests else 0.0
            sent = probability <= 0.0 or self._rand() >= probability
            if not sent:
                self._requests[slot] += 1
                self._total_requests += 1
        return sent

    def refused(self, retry_delay: float | None) -> None:
        """Count an attempt the server refused (RESOURCE_EXHAUSTED) and note its RetryInfo delay
        (given to the refusals here)."""
        with self._lock:
            slot = self._slot()
            self._requests[slot] += 1
            self._total_requests += 1
        if retry_delay is not None:
            self._retry_delay = retry_delay

    def accepted(self) -> None:
        """Count an attempt the server answered with anything but RESOURCE_EXHAUSTED."""
        with self._lock:
            slot = self._slot()
            self._requests[slot] += 1
            self._total_requests += 1
            self._accepts[slot] += 1
            self._total_accepts += 1

    def counts(self) -> tuple[int, int]:
        """(requests, accepts) within the window."""
        with self._lock:
            self._slot()
            return self._total_requests, self._total_accepts

    def refusal(self) -> ThrottledError:
        """The error of an attempt ``allow()`` refused, with the counts that refused it."""
        requests, accepts = self.counts()
        return ThrottledError(
            f"refused by this client without sending: the server accepted {accepts} of its last {requests} "
            f"attempts within {self.settings.window_s:g} s, fewer than 1/{self.settings.k:g} (client-side "
            "throttling; throttle=None disables it)", retry_delay=self._retry_delay)
