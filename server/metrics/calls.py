"""The per-call ``grpc_server_*`` families, counted without locks.

Other transports' calls of a method (the native Forward port's) are added to its series at scrape
time (``GrpcCallCollector.add_transport``), so a Forward counts in the same series on either port.

Every call updates four or five of these series, always on the server's event loop (the
interceptors in ``expertd.server.transport.interceptors`` run there), so they are plain numbers updated in
that one thread and turned into Prometheus samples when scraped (``GrpcCallCollector``), where a
prometheus_client child takes a lock and checks its labels on every update. A scrape from another
thread reads numbers the loop may be changing: each series is read whole (a histogram's buckets as
one copied list, its count their sum), so what it exports is consistent within a series and at most
one call behind.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")


class LoopCounter:
    """A counter updated from one thread."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class LoopHistogram:
    """A histogram updated from one thread: ``counts[i]`` observations <= ``bounds[i]`` and above the
    bound before (the last, above every bound), and their ``sum``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """(Prometheus buckets ``[(le, cumulative count)]`` ending with ``+Inf``, the sum)."""
        counts, total = list(self.counts), self.sum
        return cumulative_buckets(self.bounds, counts), total


def cumulative_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Prometheus buckets ``[(le, cumulative count)]`` ending with ``+Inf`` from per-bucket ``counts``
    (``len(bounds) + 1`` of them, the last above every bound)."""
    buckets, running = [], 0
    for bound, count in zip((*(repr(float(b)) for b in bounds), "+Inf"), counts, strict=True):
        running += count
        buckets.append((bound, running))
    return buckets


@dataclasses.dataclass
class CallCounts:
    """One method's calls on another transport (the native port), to add to its ``grpc_server_*``
    series: counters, answers by code name, per-bucket latency counts (the series' bounds, +Inf
    last) and their sum."""

    started: int
    received: int
    sent: int
    handled_by_code: dict[str, int]
    bucket_counts: list[int]
    seconds_sum: float


class GrpcMethodMetrics:
    """grpc_server_* series of one (grpc_type, grpc_service, grpc_method): ``started``,
    ``received`` and ``sent`` (messages) counters, and ``handled(code, seconds)`` for a call's end."""

    __slots__ = ("labels", "started", "received", "sent", "handled_by_code", "seconds")

    def __init__(self, labels: tuple[str, str, str], latency_buckets: Sequence[float]):
        self.labels = labels
        self.started, self.received, self.sent = LoopCounter(), LoopCounter(), LoopCounter()
        self.handled_by_code: dict[str, int] = {}
        self.seconds = LoopHistogram(latency_buckets)

    def handled(self, code: str, seconds: float) -> None:
        self.handled_by_code[code] = self.handled_by_code.get(code, 0) + 1
        self.seconds.observe(seconds)


class GrpcCallCollector(Collector):
    """Exports the ``grpc_server_*`` families of every method seen so far (a method appears with its
    first call, as a labelled prometheus_client child would)."""

    def __init__(self, methods: dict[tuple[str, str, str], GrpcMethodMetrics], latency_buckets: Sequence[float]):
        self._methods = methods
        self._bounds = tuple(latency_buckets)
        self._transports: list[tuple[tuple[str, str, str], Callable[[], CallCounts]]] = []

    def add_transport(self, labels: tuple[str, str, str], read: Callable[[], CallCounts]) -> None:
        """Count, at each scrape, ``read()``'s calls (another transport's, on the same latency
        bounds) in the series of ``labels`` with this server's own calls of that method."""
        self._transports.append((labels, read))

    def describe(self) -> list:
        return [CounterMetricFamily(name, "", labels=GRPC_LABELS) for name in
                ("grpc_server_started", "grpc_server_msg_received", "grpc_server_msg_sent")] + [
            CounterMetricFamily("grpc_server_handled", "", labels=(*GRPC_LABELS, "grpc_code")),
            HistogramMetricFamily("grpc_server_handling_seconds", "", labels=GRPC_LABELS)]

    def collect(self) -> Iterator:
        started = CounterMetricFamily("grpc_server_started", "RPCs started on the server.", labels=GRPC_LABELS)
        handled = CounterMetricFamily("grpc_server_handled", "RPCs completed on the server, regardless of success.",
                                      labels=(*GRPC_LABELS, "grpc_code"))
        seconds = HistogramMetricFamily("grpc_server_handling_seconds", "Response latency of RPCs handled by the "
                                        "server.", labels=GRPC_LABELS)
        received = CounterMetricFamily("grpc_server_msg_received", "Stream messages received on the server.",
                                       labels=GRPC_LABELS)
        sent = CounterMetricFamily("grpc_server_msg_sent", "Stream messages sent by the server.", labels=GRPC_LABELS)
        series = {method.labels: CallCounts(method.started.value, method.received.value, method.sent.value,
                                            dict(method.handled_by_code), list(method.seconds.counts),
                                            method.seconds.sum) for method in list(self._methods.values())}
        for key, read in self._transports:
            other = read()
            if other.started == 0:
                continue
            mine = series.setdefault(key, CallCounts(0, 0, 0, {}, [0] * (len(self._bounds) + 1), 0.0))
            mine.started, mine.received, mine.sent = (mine.started + other.started, mine.received + other.received,
                                                      mine.sent + other.sent)
            for code, count in other.handled_by_code.items():
                mine.handled_by_code[code] = mine.handled_by_code.get(code, 0) + count
            mine.bucket_counts = [a + b for a, b in zip(mine.bucket_counts, other.bucket_counts, strict=True)]
            mine.seconds_sum += other.seconds_sum
        for key, counts in series.items():
            labels = list(key)
            started.add_metric(labels, counts.started)
            received.add_metric(labels, counts.received)
            sent.add_metric(labels, counts.sent)
            for code, count in counts.handled_by_code.items():
                handled.add_metric([*labels, code], count)
            seconds.add_metric(labels, cumulative_buckets(self._bounds, counts.bucket_counts), counts.seconds_sum)
        yield from (started, handled, seconds, received, sent)

    def calls_started(self, skip_service: str | None = None) -> int:
        """Calls started so far, those of ``skip_service`` not counted."""
        return sum(m.started.value for m in list(self._methods.values()) if m.labels[1] != skip_service)
