"""The same-host channel's metrics (``--shm-channel``): its calls in the ``grpc_server_*`` series of their
methods, with every other transport's, and by transport in ``expertd_shm_channel_*``.

``ShmChannelStats`` is updated by the channel on the server's event loop (its one owner) and read
at scrape time, as ``calls.GrpcCallCollector`` reads the loop's own counters: each series whole.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from expertd.server.metrics.calls import CallCounts, GrpcCallCollector, GrpcMethodMetrics, cumulative_buckets
from expertd.server.metrics.families import LATENCY_BUCKETS

TRANSPORT = "shm"
CALL_LABELS = ("transport", "grpc_method")


class ShmChannelStats:
    """Per method path: its calls (``GrpcMethodMetrics``); the clients attached; refused attaches by reason."""

    def __init__(self, methods: tuple[str, ...]):
        self.methods = {path: GrpcMethodMetrics(("unary", *path.strip("/").split("/")), LATENCY_BUCKETS)
                        for path in methods}
        self.clients = 0
        self.refused: dict[str, int] = {}

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def counts(self, path: str) -> CallCounts:
        method = self.methods[path]
        return CallCounts(method.started.value, method.received.value, method.sent.value,
                          dict(method.handled_by_code), list(method.seconds.counts), method.seconds.sum)


class ShmChannelCollector(Collector):
    """``expertd_shm_channel_handled_total{transport, grpc_method, grpc_code}``,
    ``expertd_shm_channel_handling_seconds``, ``expertd_shm_channel_clients``,
    ``expertd_shm_channel_refused_clients_total{reason}``."""

    def __init__(self, stats: ShmChannelStats):
        self._stats = stats

    def describe(self) -> list:
        return [CounterMetricFamily("expertd_shm_channel_handled", "", labels=(*CALL_LABELS, "grpc_code")),
                HistogramMetricFamily("expertd_shm_channel_handling_seconds", "", labels=CALL_LABELS),
                GaugeMetricFamily("expertd_shm_channel_clients", ""),
                CounterMetricFamily("expertd_shm_channel_refused_clients", "", labels=("reason",))]

    def collect(self) -> Iterator:
        handled = CounterMetricFamily("expertd_shm_channel_handled", "Calls answered on the same-host channel, by "
                                      "method and status code (also counted in grpc_server_handled_total).",
                                      labels=(*CALL_LABELS, "grpc_code"))
        seconds = HistogramMetricFamily("expertd_shm_channel_handling_seconds", "Calls on the same-host channel: "
                                        "seconds from the doorbell to the answer's.", labels=CALL_LABELS)
        for path in list(self._stats.methods):
            counts, method = self._stats.counts(path), path.rsplit("/", 1)[1]
            if not counts.started:
                continue
            for code, count in sorted(counts.handled_by_code.items()):
                handled.add_metric([TRANSPORT, method, code], count)
            seconds.add_metric([TRANSPORT, method], cumulative_buckets(LATENCY_BUCKETS, counts.bucket_counts),
                               counts.seconds_sum)
        clients = GaugeMetricFamily("expertd_shm_channel_clients", "Clients attached to the same-host channel.",
                                    value=self._stats.clients)
        refused = CounterMetricFamily("expertd_shm_channel_refused_clients", "Attaches the same-host channel refused, "
                                      "by reason.", labels=("reason",))
        for reason, count in sorted(self._stats.refused.items()):
            refused.add_metric([reason], count)
        yield from (handled, seconds, clients, refused)


def register(registry, grpc_calls: GrpcCallCollector, stats: ShmChannelStats) -> None:
    """Export ``stats`` (``ShmChannelCollector``) and add its calls to the ``grpc_server_*`` series."""
    registry.register(ShmChannelCollector(stats))
    for path, method in stats.methods.items():
        grpc_calls.add_transport(method.labels, lambda path=path: stats.counts(path))
