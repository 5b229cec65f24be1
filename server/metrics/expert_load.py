"""Tokens routed to each expert per layer, since start and over a recent window (GetExpertLoad and
the load-imbalance gauge)."""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import numpy as np


class ExpertLoadTracker:
    """Tokens routed to each expert per layer: since start and over a sliding window.

    The window is kept as one-second slots with a running sum, so recording a step and reading
    the window cost O(E) whatever the request rate. Recording is all a step does; the metrics
    (``Metrics.track_expert_load``), GetExpertLoad and the load balancer read at their own pace,
    from any thread.
    """

    def __init__(self, num_experts: dict[int, int], window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._total = {layer: np.zeros(e, np.int64) for layer, e in num_experts.items()}
        self._recent_sum = {layer: np.zeros(e, np.int64) for layer, e in num_experts.items()}
        self._slots: dict[int, collections.deque] = {layer: collections.deque() for layer in num_experts}

    @property
    def layers(self) -> list[int]:
        return list(self._total)

    def add(self, layer: int, tokens_per_expert: np.ndarray) -> None:
        """Record one step's counts ``[E]``."""
        counts = np.asarray(tokens_per_expert, np.int64)
        second = int(self._clock())
        with self._lock:
            self._total[layer] += counts
            self._recent_sum[layer] += counts
            slots = self._slots[layer]
            if slots and slots[-1][0] == second:
                slots[-1][1] += counts
            else:
                slots.append([second, counts.copy()])

    def total(self, layer: int) -> np.ndarray:
        with self._lock:
            return self._total[layer].copy()

    def recent(self, layer: int) -> np.ndarray:
        horizon = self._clock() - self.window_s
        with self._lock:
            slots = self._slots[layer]
            while slots and slots[0][0] + 1 <= horizon:  # the slot ended before the window began
                self._recent_sum[layer] -= slots.popleft()[1]
            return self._recent_sum[layer].copy()

    def imbalance(self, layer: int) -> float:
        """Max / mean tokens per expert over the recent window (1.0 with no tokens: balanced by
        convention)."""
        recent = self.recent(layer)
        mean = recent.mean()
        return float(recent.max() / mean) if mean > 0 else 1.0
