"""The native Forward port's metrics, read from its C++ counters at scrape time.

``NativePortCollector`` exports ``expertd_native_forward_*`` (the port's own view: calls answered
by status code, arrival-to-answer seconds, tokens queued in C++, the direct runner's batches by
outcome); ``grpc_calls`` gives the same calls to ``GrpcCallCollector`` so that they count in the
``grpc_server_*`` series of ``expertd.v1.ExpertService/Forward`` with the main port's calls.

``stats()`` is the port's ``NativeFront.stats``: ``{"handled": {code int: n}, "latency": ([counts
per LATENCY_BUCKETS bound, +Inf last], sum), "queued_tokens": n, ...}``; ``direct_calls()``:
``{"computed": n, "handed_over": n}``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from expertd.server.metrics.calls import CallCounts, cumulative_buckets
from expertd.server.metrics.families import LATENCY_BUCKETS

FORWARD_LABELS = ("unary", "expertd.v1.ExpertService", "Forward")
"""The ``grpc_server_*`` series (grpc_type, grpc_service, grpc_method) a native-port call counts in."""
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def grpc_calls(stats: dict) -> CallCounts:
    """The port's answered Forward calls as ``grpc_server_*`` counts (a unary call: one message
    received, one sent when it answered OK)."""
    handled = {_CODE_NAMES.get(code, str(code)): count for code, count in stats["handled"].items()}
    counts, total = stats["latency"]
    calls = sum(handled.values())
    return CallCounts(started=calls, received=calls, sent=handled.get("OK", 0), handled_by_code=handled,
                      bucket_counts=list(counts), seconds_sum=total)


class NativePortCollector(Collector):
    """``expertd_native_forward_*`` from ``stats()`` and ``direct_calls()`` (module docstring)."""

    def __init__(self, stats: Callable[[], dict], direct_calls: Callable[[], dict[str, int]]):
        self._stats, self._direct_calls = stats, direct_calls

    def describe(self) -> list:
        return [CounterMetricFamily("expertd_native_forward_handled", "", labels=("grpc_code",)),
                HistogramMetricFamily("expertd_native_forward_handling_seconds", ""),
                GaugeMetricFamily("expertd_native_forward_queued_tokens", ""),
                CounterMetricFamily("expertd_native_forward_direct", "", labels=("outcome",))]

    def collect(self) -> Iterator:
        stats = self._stats()
        calls = grpc_calls(stats)
        handled = CounterMetricFamily("expertd_native_forward_handled", "Forward calls answered on the native port, "
                                      "by status code (also counted in grpc_server_handled_total).",
                                      labels=("grpc_code",))
        for code, count in sorted(calls.handled_by_code.items()):
            handled.add_metric([code], count)
        seconds = HistogramMetricFamily("expertd_native_forward_handling_seconds", "Forward calls on the native port: "
                                        "seconds from arrival to answer.")
        seconds.add_metric([], cumulative_buckets(LATENCY_BUCKETS, calls.bucket_counts), calls.seconds_sum)
        queued = GaugeMetricFamily("expertd_native_forward_queued_tokens", "Tokens of Forward calls queued on the "
                                   "native port, not yet handed to the batcher.", value=stats["queued_tokens"])
        direct = CounterMetricFamily("expertd_native_forward_direct", "Batches of the native port's direct runner (a "
                                     "lone call at an idle port, then what queued behind it) by outcome: computed on "
                                     "its gRPC thread (answered there, OK or not), or handed over to the event loop "
                                     "(the server was busy).", labels=("outcome",))
        for outcome, count in self._direct_calls().items():
            direct.add_metric([outcome], count)
        yield from (handled, seconds, queued, direct)
