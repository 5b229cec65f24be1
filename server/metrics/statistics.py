"""Per-layer statistics kept as plain numbers: the one store behind Triton's ModelStatistics (KServe)
and the ``expertd_executions_total`` Prometheus family.

- executions: engine steps run per (layer, kind), counted by ``Metrics.observe_execution`` once
  per step; Prometheus reads them at scrape time through this object (a registry collector), and
  ModelStatistics reads ``execution_count`` here. Nothing reads Prometheus back.
- inferences: per layer, Triton's InferenceStatistics of the ModelInfer requests: success / fail
  (count and total time), and for each success its time decoding (compute_input), waiting in the
  batcher (queue), in engine steps (compute_infer) and encoding (compute_output), each counted
  once per successful request as perf_analyzer requires; ``inference_count`` (tokens) and
  ``last_inference`` (ms since the epoch).

Thread-safe: the follower's step loop and the scrape thread share it with the event loop.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

from prometheus_client.core import CounterMetricFamily

EXECUTIONS = "expertd_executions"


@dataclasses.dataclass
class Duration:
    """How many times, and how many nanoseconds in all."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)


@dataclasses.dataclass
class InferenceStatistics:
    """Triton's InferenceStatistics of one model (layer), plus its inference_count and last_inference."""

    success: Duration = dataclasses.field(default_factory=Duration)
    fail: Duration = dataclasses.field(default_factory=Duration)
    queue: Duration = dataclasses.field(default_factory=Duration)
    compute_input: Duration = dataclasses.field(default_factory=Duration)
    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)
    inference_count: int = 0
    last_inference_ms: int = 0


@dataclasses.dataclass(frozen=True)
class InferenceTimes:
    """One successful request's seconds: decoding, in the batcher's queue, in engine steps, encoding, in all."""

    compute_input: float
    queue: float
    compute_infer: float
    compute_output: float
    total: float


class Statistics:
    """The store (see module docstring); registered on a Prometheus registry as a collector."""

    def __init__(self):
        self._lock = threading.Lock()
        self._executions: collections.Counter[tuple[int, str]] = collections.Counter()
        self._inferences: dict[int, InferenceStatistics] = {}

    # -- executions ------------------------------------------------------------------------------
    def add_execution(self, layer: int, kind: str) -> None:
        with self._lock:
            self._executions[(int(layer), kind)] += 1

    def executions(self, layer: int, kind: str) -> int:
        with self._lock:
            return self._executions[(int(layer), kind)]

    # -- inferences ------------------------------------------------------------------------------
    def add_success(self, layer: int, tokens: int, times: InferenceTimes) -> None:
        with self._lock:
            stats = self._inferences.setdefault(layer, InferenceStatistics())
            stats.success.add(times.total)
            stats.compute_input.add(times.compute_input)
            stats.queue.add(times.queue)
            stats.compute_infer.add(times.compute_infer)
            stats.compute_output.add(times.compute_output)
            stats.inference_count += tokens
            stats.last_inference_ms = int(time.time() * 1000)

    def add_failure(self, layer: int, seconds: float) -> None:
        with self._lock:
            self._inferences.setdefault(layer, InferenceStatistics()).fail.add(seconds)

    def inferences(self, layer: int) -> InferenceStatistics:
        """A copy of layer ``layer``'s inference statistics (zeros before its first request)."""
        with self._lock:
            stats = self._inferences.get(layer, InferenceStatistics())
            return dataclasses.replace(stats, **{f.name: dataclasses.replace(getattr(stats, f.name))
                                                 for f in dataclasses.fields(stats)
                                                 if isinstance(getattr(stats, f.name), Duration)})

    # -- Prometheus collector --------------------------------------------------------------------
    def describe(self):
        return [CounterMetricFamily(EXECUTIONS, "Engine steps run.", labels=("layer", "kind"))]

    def collect(self):
        family = CounterMetricFamily(EXECUTIONS, "Engine steps run.", labels=("layer", "kind"))
        with self._lock:
            counts = sorted(self._executions.items())
        for (layer, kind), count in counts:
            family.add_metric((str(layer), kind), count)
        yield family
