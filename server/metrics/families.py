"""Every Prometheus metric of expertd, defined once on an injected registry; one observation per event.

Names follow Prometheus conventions: the ``expertd_`` prefix, base units (seconds, ratios),
``_total`` on counters, histograms rather than summaries (aggregatable across replicas), and few
labels of low cardinality (``code``, ``kind``, ``layer``, ``expert``). Per-call counts and
latency are the standard ``grpc_server_*`` families (as go-grpc-prometheus / py-grpc-prometheus
name them), fed by ``expertd.server.transport.interceptors`` for every service on the server and kept
without locks on the event loop (``expertd.server.metrics.calls``); nothing else counts calls.
``expertd_executions_total`` is read from ``expertd.server.metrics.statistics``, the store KServe's
ModelStatistics reads too.

| metric | type | labels | observed by |
|---|---|---|---|
| grpc_server_started_total, grpc_server_handled_total | counter | grpc_type/service/method (+ grpc_code) | each call |
| grpc_server_msg_received_total, grpc_server_msg_sent_total | counter | grpc_type/service/method | each message |
| grpc_server_handling_seconds | histogram | grpc_type/service/method | each call |
| expertd_stream_messages_total | counter | code | each ForwardStream message (its in-band status) |
| expertd_queue_duration_seconds | histogram | kind (forward, route) | each request leaving the batcher |
| expertd_compute_duration_seconds | histogram | kind | each engine step |
| expertd_batch_tokens | histogram (buckets = token buckets) | kind | each engine step |
| expertd_batch_padding_ratio | histogram | kind | each engine step |
| expertd_batch_requests | histogram | kind | each engine step |
| expertd_executions_total | counter | layer, kind | each engine step |
| expertd_tokens_total | counter | kind | each engine step |
| expertd_routed_tokens_total | counter | layer, expert | read at scrape time (``expertd.server.metrics.expert_load``) |
| expertd_expert_load_imbalance | gauge (max/mean over the recent window) | layer | read at scrape time |
| expertd_aux_loss | gauge (last Route batch) | layer | each Route step |
| expertd_eplb_balancedness | gauge (mean/max tokens per rank, recent window) | layer | each EPLB tick (EP mesh) |
| expertd_eplb_rebalances_total | counter | layer | each expert placement swapped in |
| expertd_eplb_rebalance_duration_seconds | histogram | - | each rebalance (plan, weight move, swap) |
| expertd_pending_requests | gauge | - | read at scrape time |
| expertd_queued_tokens | gauge (admitted, not yet in a step) | - | read at scrape time |
| expertd_queue_backlog_seconds | gauge (expected work ahead of a new request) | - | read at scrape time |
| expertd_dropped_requests_total | counter | reason (deadline, cancelled) | each dropped request, once |
| expertd_rejected_requests_total | counter | reason (queue_size, queue_tokens, queue_wait, deadline) | each refusal |
| expertd_refused_calls_total | counter | reason (unauthenticated, too_large, undecodable) | each call refused unread |
| expertd_compilations_total | counter | - | each compilation |
| expertd_compile_duration_seconds | histogram | - | each compilation |
| expertd_model_ready | gauge (1 after warm-up, 0 while warming up or draining) | - | readiness changes |
| expertd_build_info | gauge (1) | version, jax_version, grpc_version, platform | start-up |
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from expertd.server.metrics.calls import GrpcCallCollector, GrpcMethodMetrics
from expertd.server.metrics.expert_load import ExpertLoadTracker
from expertd.server.metrics.statistics import Statistics

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMPILE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
REQUESTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """expertd's metrics on ``registry``; one method per observation; ``statistics`` is the store
    of the executions and of KServe's per-model statistics.

    Args:
      registry: where the metrics are registered (tests pass a fresh CollectorRegistry).
      token_buckets: the compiled token buckets, used as the batch-size histogram buckets.
    """

    def __init__(self, registry: CollectorRegistry, *, token_buckets: Sequence[int] = (1, 4, 16, 64, 256)):
        self.registry = registry
        r = registry
        self.statistics = Statistics()
        r.register(self.statistics)  # expertd_executions_total
        self.stream_messages = Counter("expertd_stream_messages", "ForwardStream messages answered, by the gRPC "
                                       "status code of their in-band answer.", ["code"], registry=r)
        self.queue_seconds = Histogram("expertd_queue_duration_seconds", "Time a request waited in the batcher "
                                       "queue before its batch started computing.", ["kind"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("expertd_compute_duration_seconds", "Time of one engine step (a batch).",
                                         ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_tokens = Histogram("expertd_batch_tokens", "Valid (non-padding) tokens per engine step.",
                                      ["kind"], buckets=tuple(float(b) for b in token_buckets), registry=r)
        self.padding_ratio = Histogram("expertd_batch_padding_ratio", "Padding rows / bucket rows per engine step.",
                                       ["kind"], buckets=RATIO_BUCKETS, registry=r)
        self.batch_requests = Histogram("expertd_batch_requests", "Requests (or parts of split requests) merged "
                                        "into one engine step.", ["kind"], buckets=REQUESTS_BUCKETS, registry=r)
        self.tokens = Counter("expertd_tokens", "Valid tokens computed.", ["kind"], registry=r)
        self.pending = Gauge("expertd_pending_requests", "Requests accepted and not yet answered (queued or "
                             "computing); an autoscaling signal.", registry=r)
        self.queued_tokens = Gauge("expertd_queued_tokens", "Tokens admitted and not yet taken into an engine "
                                   "step (--max-queue-tokens bounds it).", registry=r)
        self.backlog_seconds = Gauge("expertd_queue_backlog_seconds", "Expected seconds of admitted work ahead of "
                                     "a new request, at the measured step times.", registry=r)
        self.dropped = Counter("expertd_dropped_requests", "Admitted requests that ended unanswered because their "
                               "deadline passed or their caller cancelled (each request once).", ["reason"], registry=r)
        self.rejected = Counter("expertd_rejected_requests", "Requests refused with RESOURCE_EXHAUSTED by admission, "
                                "by the bound that refused them.", ["reason"], registry=r)
        self.refused_calls = Counter("expertd_refused_calls", "Calls refused before their message was read "
                                     "(unauthenticated) or parsed (too_large for the method, undecodable).",
                                     ["reason"], registry=r)
        self.aux_loss = Gauge("expertd_aux_loss", "Load-balancing aux loss of the last Route batch (coefficient 1).",
                              ["layer"], registry=r)
        self.eplb_balancedness = Gauge("expertd_eplb_balancedness", "Mean / max tokens per rank over the recent "
                                       "window under the layer's current expert placement (1 = even).", ["layer"],
                                       registry=r)
        self.eplb_rebalances = Counter("expertd_eplb_rebalances", "Expert placements swapped in by the online "
                                       "load balancer (EPLB).", ["layer"], registry=r)
        self.eplb_rebalance_seconds = Histogram("expertd_eplb_rebalance_duration_seconds", "Time of one layer's "
                                                "rebalance: plan, weight move and swap.", buckets=LATENCY_BUCKETS,
                                                registry=r)
        self.compilations = Counter("expertd_compilations", "Programs compiled by the engine (warm-up).", registry=r)
        self.compile_seconds = Histogram("expertd_compile_duration_seconds", "Time to compile one program.",
                                         buckets=COMPILE_BUCKETS, registry=r)
        self.model_ready = Gauge("expertd_model_ready", "1 when warm-up is done and the server is not draining.",
                                 registry=r)
        self.build_info = Gauge("expertd_build_info", "Build information (value 1).",
                                ["version", "jax_version", "grpc_version", "platform"], registry=r)
        self._grpc_methods: dict[tuple[str, str, str], GrpcMethodMetrics] = {}
        self.grpc_calls = GrpcCallCollector(self._grpc_methods, LATENCY_BUCKETS)
        r.register(self.grpc_calls)  # grpc_server_*
        self._kind_children: dict[str, tuple] = {}

    # -- requests (servicers, batcher) ---------------------------------------------------------
    def observe_stream_message(self, code: str) -> None:
        """One ForwardStream message answered with in-band status ``code`` (the call itself is a grpc_server_* call)."""
        self.stream_messages.labels(code).inc()

    def observe_dropped(self, reason: str) -> None:
        """One admitted request ended unanswered (``deadline`` or ``cancelled``)."""
        self.dropped.labels(reason).inc()

    def observe_rejected(self, reason: str) -> None:
        """One request refused by admission (RESOURCE_EXHAUSTED)."""
        self.rejected.labels(reason).inc()

    def observe_refused_call(self, reason: str) -> None:
        """One call refused before its message was read or parsed."""
        self.refused_calls.labels(reason).inc()

    # -- batches (batcher) ---------------------------------------------------------------------
    def observe_queue(self, kind: str, seconds: float) -> None:
        self._kind_series(kind)[5].observe(seconds)

    def observe_execution(self, layer: int, kind: str, seconds: float) -> None:
        """One engine step (a multi-host follower's steps are observed here alone)."""
        self.statistics.add_execution(layer, kind)
        self._kind_series(kind)[0].observe(seconds)

    def observe_batch(self, *, layer: int, kind: str, num_valid: int, bucket: int, num_requests: int,
                      seconds: float) -> None:
        """One batched engine step of ``num_valid`` rows padded to ``bucket``."""
        self.observe_execution(layer, kind, seconds)
        _, batch_tokens, padding, requests, tokens, _ = self._kind_series(kind)
        batch_tokens.observe(num_valid)
        padding.observe((bucket - num_valid) / bucket)
        requests.observe(num_requests)
        tokens.inc(num_valid)

    def _kind_series(self, kind: str) -> tuple:
        """The series labelled ``kind`` (compute seconds, batch tokens, padding ratio, requests, tokens,
        queue seconds), their children looked up once per kind, not per step or request."""
        children = self._kind_children.get(kind)
        if children is None:
            children = self._kind_children[kind] = tuple(metric.labels(kind) for metric in (
                self.compute_seconds, self.batch_tokens, self.padding_ratio, self.batch_requests, self.tokens,
                self.queue_seconds))
        return children

    def track_expert_load(self, tracker: ExpertLoadTracker) -> None:
        """Serve ``expertd_routed_tokens_total`` and ``expertd_expert_load_imbalance`` from ``tracker``
        at scrape time (a step only records its counts there)."""
        self.registry.register(_ExpertLoadCollector(tracker))

    def set_aux_loss(self, layer: int, value: float) -> None:
        self.aux_loss.labels(str(layer)).set(value)

    # -- expert placement (eplb) ---------------------------------------------------------------
    def set_eplb_balancedness(self, layer: int, value: float) -> None:
        self.eplb_balancedness.labels(str(layer)).set(value)

    def observe_rebalance(self, layer: int, seconds: float) -> None:
        """One placement swapped in for ``layer`` after ``seconds`` of planning, moving and swapping."""
        self.eplb_rebalances.labels(str(layer)).inc()
        self.eplb_rebalance_seconds.observe(seconds)

    def track_pending(self, count) -> None:
        """Read the pending-requests gauge from ``count()`` at scrape time (nothing on the hot path)."""
        self.pending.set_function(count)

    def track_queue(self, tokens, backlog_seconds) -> None:
        """Read the queued-tokens and backlog gauges from these functions at scrape time."""
        self.queued_tokens.set_function(tokens)
        self.backlog_seconds.set_function(backlog_seconds)

    # -- lifecycle (app) -----------------------------------------------------------------------
    def observe_compile(self, seconds: float) -> None:
        self.compilations.inc()
        self.compile_seconds.observe(seconds)

    def set_ready(self, ready: bool) -> None:
        self.model_ready.set(1 if ready else 0)

    def set_build_info(self, *, version: str, jax_version: str, grpc_version: str, platform: str) -> None:
        self.build_info.labels(version, jax_version, grpc_version, platform).set(1)

    # -- gRPC (interceptor) --------------------------------------------------------------------
    def grpc_method(self, labels: tuple[str, str, str]) -> GrpcMethodMetrics:
        """The grpc_server_* series of one method, updated on the event loop only."""
        series = self._grpc_methods.get(labels)
        if series is None:
            series = self._grpc_methods[labels] = GrpcMethodMetrics(labels, LATENCY_BUCKETS)
        return series


class _ExpertLoadCollector(Collector):
    """The expert-load series, read from the tracker at each scrape: every expert of every layer,
    zero until routed to."""

    def __init__(self, tracker: ExpertLoadTracker):
        self._tracker = tracker

    def describe(self) -> list:
        return [CounterMetricFamily("expertd_routed_tokens", "", labels=["layer", "expert"]),
                GaugeMetricFamily("expertd_expert_load_imbalance", "", labels=["layer"])]

    def collect(self) -> Iterator:
        routed = CounterMetricFamily("expertd_routed_tokens", "Tokens routed to each expert (each token counts once "
                                     "per selected expert).", labels=["layer", "expert"])
        imbalance = GaugeMetricFamily("expertd_expert_load_imbalance", "Max/mean of tokens per expert over the "
                                      "recent window (1 = perfectly balanced).", labels=["layer"])
        for layer in self._tracker.layers:
            name = str(layer)
            for expert, count in enumerate(self._tracker.total(layer).tolist()):
                routed.add_metric([name, str(expert)], count)
            imbalance.add_metric([name], self._tracker.imbalance(layer))
        yield routed
        yield imbalance

