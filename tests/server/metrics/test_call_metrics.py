"""The lock-free grpc_server_* families export what prometheus_client's own counters and histogram
export for the same observations (the reference), bucket boundaries included."""
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from expertd.server.metrics.calls import GRPC_LABELS, LoopHistogram
from expertd.server.metrics.families import LATENCY_BUCKETS, Metrics

LABELS = ("unary", "expertd.v1.ExpertService", "Forward")


def samples(registry, prefix):
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for family in registry.collect()
                  for s in family.samples if s.name.startswith(prefix) and not s.name.endswith("_created"))


def test_grpc_families_equal_prometheus_clients_for_the_same_calls():
    rng = np.random.default_rng(0)
    latencies = [*LATENCY_BUCKETS, 0.0, 1e-6, 31.0, *rng.exponential(0.01, 200).tolist()]  # bounds are <=
    codes = ["OK", "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
    metrics = Metrics(CollectorRegistry())
    series = metrics.grpc_method(LABELS)
    reference = CollectorRegistry()
    started = Counter("grpc_server_started", "", GRPC_LABELS, registry=reference)
    handled = Counter("grpc_server_handled", "", (*GRPC_LABELS, "grpc_code"), registry=reference)
    seconds = Histogram("grpc_server_handling_seconds", "", GRPC_LABELS, buckets=LATENCY_BUCKETS, registry=reference)
    received = Counter("grpc_server_msg_received", "", GRPC_LABELS, registry=reference)
    sent = Counter("grpc_server_msg_sent", "", GRPC_LABELS, registry=reference)
    for i, latency in enumerate(latencies):
        code = codes[i % len(codes)]
        series.started.inc(), started.labels(*LABELS).inc()
        series.received.inc(), received.labels(*LABELS).inc()
        if code == "OK":
            series.sent.inc(), sent.labels(*LABELS).inc()
        series.handled(code, latency)
        handled.labels(*LABELS, code).inc()
        seconds.labels(*LABELS).observe(latency)
    ours, theirs = samples(metrics.registry, "grpc_server_"), samples(reference, "grpc_server_")
    assert [s[:2] for s in ours] == [s[:2] for s in theirs]
    np.testing.assert_allclose([s[2] for s in ours], [s[2] for s in theirs], rtol=1e-12)
    assert metrics.grpc_calls.calls_started() == len(latencies)
    assert metrics.grpc_calls.calls_started(skip_service=LABELS[1]) == 0


def test_a_histogram_bucket_holds_values_up_to_and_including_its_bound():
    histogram = LoopHistogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 2.5):
        histogram.observe(value)
    assert histogram.cumulative() == ([("1.0", 2), ("2.0", 4), ("+Inf", 5)], 7.5)
