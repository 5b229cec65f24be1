"""One statistics store: Prometheus' expertd_executions_total and KServe's ModelStatistics read the
same numbers, each step observed once."""
from prometheus_client import CollectorRegistry, generate_latest

from expertd.server.metrics.families import Metrics
from expertd.server.metrics.statistics import InferenceTimes


def test_executions_are_observed_once_and_read_by_both_views():
    metrics = Metrics(CollectorRegistry(), token_buckets=(1, 8))
    metrics.observe_batch(layer=3, kind="forward", num_valid=5, bucket=8, num_requests=2, seconds=0.01)
    metrics.observe_execution(3, "forward", 0.02)  # a multi-host follower's step
    metrics.observe_batch(layer=3, kind="route", num_valid=1, bucket=1, num_requests=1, seconds=0.01)
    registry = metrics.registry
    assert registry.get_sample_value("expertd_executions_total", {"layer": "3", "kind": "forward"}) == 2
    assert registry.get_sample_value("expertd_executions_total", {"layer": "3", "kind": "route"}) == 1
    assert metrics.statistics.executions(3, "forward") == 2 and metrics.statistics.executions(4, "forward") == 0
    assert registry.get_sample_value("expertd_compute_duration_seconds_count", {"kind": "forward"}) == 2
    assert b"# TYPE expertd_executions_total counter" in generate_latest(registry)


def test_inference_statistics_count_each_part_once_per_success():
    metrics = Metrics(CollectorRegistry())
    statistics = metrics.statistics
    statistics.add_success(0, 3, InferenceTimes(compute_input=0.001, queue=0.002, compute_infer=0.003,
                                                compute_output=0.0005, total=0.007))
    statistics.add_failure(0, 0.0001)
    stats = statistics.inferences(0)
    assert (stats.success.count, stats.fail.count, stats.inference_count) == (1, 1, 3)
    assert stats.queue.ns == 2_000_000 and stats.compute_infer.ns == 3_000_000 and stats.last_inference_ms > 0
    assert {d.count for d in (stats.queue, stats.compute_input, stats.compute_infer, stats.compute_output)} == {1}
    stats.success.add(1.0)  # a copy: the store is unchanged
    assert statistics.inferences(0).success.count == 1 and statistics.inferences(7).success.count == 0
