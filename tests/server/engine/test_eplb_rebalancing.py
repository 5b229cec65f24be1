"""Online expert load balancing (expertd.server.engine.rebalancer): a rebalance swaps a better placement in
between steps without recompiling, and through the real server (a subprocess on 4 simulated CPU
devices) every answer before, during and after rebalances equals the single-device reference."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from service_support import cache_dir, reference_forward, sample, scrape

from expertd.client import ExpertClient
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.kernels import eplb as eplb_kernels
from expertd.server.config import parse_args
from expertd.server.engine import rebalancer
from expertd.server.engine.build import build_engine
from expertd.server.engine.warmup import warm_up
from expertd.server.metrics.expert_load import ExpertLoadTracker
from expertd.server.metrics.families import Metrics
from expertd.server.models.presets import load_preset

HOT = 5  # tiny layer 1 (DeepSeek-V3 style): the expert the skewed tokens pick first
OTHER = 4  # HOT's group-mate: its load gains from a move both from the start-up placement and HOT's
TOLERANCE = dict(rtol=2e-5, atol=2e-6)  # fp32; only the order of the k-term sum differs


@pytest.fixture(scope="module")
def layer1():
    (layer,) = load_preset("tiny", layers="1", dtype="float32")
    return layer, {name: np.asarray(layer.params[name]) for name in layer.params}


def skewed_tokens(params, n, seed, expert=HOT):
    """Tokens along the router's column of ``expert`` (plus noise): routed to it and its group."""
    rng = np.random.default_rng(seed)
    column = params["router_weight"][:, expert]
    x = rng.standard_normal((n, len(column))).astype(np.float32) * 0.3
    return (x + 3.0 * column / np.linalg.norm(column)).astype(np.float32)


async def _run_now(fn, *args):
    return fn(*args)


def test_tick_swaps_a_better_placement_between_steps_without_recompiling(layer1):
    layer, params = layer1
    served = build_engine([layer], buckets=(8,), dtype="float32", devices=4, num_redundant_experts=4)
    engine = served.engine
    warm_up(engine)
    compiled = engine.compilations
    start = engine.expert_placement(1)
    assert start.num_physical == 12 and start.slots_per_rank == 3
    assert served.info()["layers"][0]["expert_placement"]["num_redundant"] == 4
    metrics = Metrics(CollectorRegistry())
    balancer = rebalancer.Rebalancer(engine, metrics, interval_s=1.0)
    loads = ExpertLoadTracker({1: 8}, window_s=60.0)
    x = skewed_tokens(params, 8, seed=0)
    before = engine.forward(1, x, 8)
    loads.add(1, before.tokens_per_expert)
    assert asyncio.run(balancer.tick(loads, _run_now)) == [1]
    moved = engine.expert_placement(1)
    assert moved != start and balancer.version(1) == 1
    assert moved.replica_counts[HOT] > 1  # the hot expert got replicas
    assert moved.balancedness(loads.recent(1)) > start.balancedness(loads.recent(1))
    after = engine.forward(1, x, 8)
    want, routing = reference_forward(params, layer.cfg, x, np.float32)
    np.testing.assert_allclose(before.output, want, **TOLERANCE)
    np.testing.assert_allclose(after.output, want, **TOLERANCE)
    np.testing.assert_array_equal(after.topk_ids, routing["topk_ids"])
    assert engine.compilations == compiled  # same shapes: the compiled steps serve the new placement
    # The same load again: nothing better to plan, nothing moves.
    assert asyncio.run(balancer.tick(loads, _run_now)) == []
    registry = metrics.registry
    assert registry.get_sample_value("expertd_eplb_rebalances_total", {"layer": "1"}) == 1
    assert registry.get_sample_value("expertd_eplb_rebalance_duration_seconds_count") == 1
    assert registry.get_sample_value("expertd_eplb_balancedness", {"layer": "1"}) == pytest.approx(
        moved.balancedness(loads.recent(1)))
    with pytest.raises(ValueError, match="the placement to replace is not the current one"):
        engine.swap_expert_placement(1, engine.layers[1].params, moved, engine._tables[1], replaces=start)


def test_plan_keeps_the_current_placement_unless_it_gains():
    current = eplb_kernels.plan_placement(np.ones(8), 4, 4)
    assert rebalancer.plan(np.ones(8), current) is None
    skew = np.array([1, 1, 1, 1, 1, 40, 1, 1], float)
    better = rebalancer.plan(skew, current)
    assert better is not None and better.balancedness(skew) >= current.balancedness(skew) * (1 + rebalancer.MIN_GAIN)


def test_options_are_checked():
    config = parse_args(["--num-redundant-experts", "8", "--eplb-interval-s", "2.5"], environ={})
    assert (config.model.num_redundant_experts, config.model.eplb_interval_s) == (8, 2.5)
    assert parse_args([], environ={}).model.num_redundant_experts == 0
    with pytest.raises(ValueError, match="--num-redundant-experts must be >= 0"):
        parse_args(["--num-redundant-experts", "-1"], environ={})
    with pytest.raises(ValueError, match="--eplb-interval-s must be >= 0"):
        parse_args(["--eplb-interval-s", "-1"], environ={})
    tiny = load_preset("tiny", num_layers=1, dtype="float32")
    with pytest.raises(ValueError, match="needs an expert-parallel mesh"):
        build_engine(tiny, buckets=(8,), dtype="float32", devices=1, num_redundant_experts=4)
    with pytest.raises(ValueError, match="8 experts \\+ 2 redundant slots cannot be split evenly over 4 devices"):
        build_engine(tiny, buckets=(8,), dtype="float32", devices=4, num_redundant_experts=2)
    single = build_engine(tiny, buckets=(8,), dtype="float32", devices=1).engine
    with pytest.raises(ValueError, match="--eplb-interval-s needs an expert-parallel mesh"):
        rebalancer.Rebalancer(single, Metrics(CollectorRegistry()), interval_s=1.0)
    assert rebalancer.Rebalancer(single, Metrics(CollectorRegistry()), interval_s=0).layers == []


def _placement(client, layer):
    return next(info.placement for info in client.model_info().layers if info.index == layer)


def test_rebalance_during_live_traffic_every_answer_equals_the_reference(tmp_path_factory, layer1):
    layer, params = layer1
    rng = np.random.default_rng(7)
    # Requests of 1-11 tokens (a part of 8 rows or two), two thirds skewed onto one expert's group:
    # HOT's first, OTHER's once answers have been seen, so that a swap comes after answers
    # whatever the first swap's timing (a busy machine may swap before the first answer returns).
    pools = {HOT: [], OTHER: []}
    for expert, pool in pools.items():
        for i in range(18):
            n = int(rng.integers(1, 12))
            x = (skewed_tokens(params, n, seed=i, expert=expert) if i % 3
                 else rng.standard_normal((n, 64)).astype(np.float32))
            pool.append((x, reference_forward(params, layer.cfg, x, np.float32)[0]))
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", "--preset", "tiny", "--layers", "1", "--dtype", "float32",
               "--num-devices", "4", "--num-redundant-experts", "4", "--eplb-interval-s", "0.3",
               "--expert-load-window-s", "3", "--bucket-sizes", "8", "--max-queue-delay-ms", "1",
               "--drain-grace-s", "10", "--compile-cache-dir", str(cache_dir(tmp_path_factory))]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    stop, moved = threading.Event(), threading.Event()
    answers, failures, changes = [], [], []
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "ready:" in line or "error" in line:
                break
        output = "".join(lines)
        assert "ready:" in output, output
        port = int(re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", output).group(1))
        metrics_port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", output).group(1))
        target = f"127.0.0.1:{port}"
        with ExpertClient(target, timeout=30) as client:
            start = _placement(client, 1)
        assert (start.num_ranks, start.slots_per_rank, start.num_redundant_experts, start.version) == (4, 3, 4, 0)

        def traffic(worker):
            with ExpertClient(target, timeout=30) as c:
                i = worker
                while not stop.is_set():
                    pool = pools[OTHER if moved.is_set() else HOT]
                    x, want = pool[i % len(pool)]
                    began = time.monotonic()
                    try:
                        got = c.forward(x, layer=1)
                        np.testing.assert_allclose(got, want, **TOLERANCE)
                    except Exception as exc:  # noqa: BLE001 - collected, reported below
                        failures.append(exc)
                    answers.append((began, time.monotonic()))
                    i += 3

        def watch():  # (last poll that saw the old version, when the new one was seen, version)
            with ExpertClient(target, timeout=30) as c:
                seen, last = 0, time.monotonic()
                while not stop.is_set():
                    polled = time.monotonic()
                    version = _placement(c, 1).version
                    if version != seen:
                        changes.append((last, time.monotonic(), version))
                        seen = version
                    last = polled
                    time.sleep(0.02)

        threads = [threading.Thread(target=traffic, args=(w,)) for w in range(3)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        while len(answers) < 10 and time.monotonic() < deadline and not failures:
            time.sleep(0.05)
        assert len(answers) >= 10, "fewer than 10 answers within 90 s"
        answered = answers[9][1]
        moved.set()

        def after_answers():  # the first swap the watcher saw once answers had come back
            return next((c for c in list(changes) if c[0] > answered), None)

        while after_answers() is None and time.monotonic() < deadline and not failures:
            time.sleep(0.1)
        assert not failures, failures[:3]
        assert after_answers() is not None, f"no placement was swapped in after answers within 90 s: {changes}"
        old_seen, swapped_at, _ = after_answers()
        while len([a for a in answers if a[0] > swapped_at]) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not failures, failures[:3]
        assert any(end < old_seen for _, end in answers), "no answer before the first swap"
        assert any(began < swapped_at and end > old_seen for began, end in answers), "none in flight at the swap"
        assert sum(began > swapped_at for began, _ in answers) >= 30, "too few answers after the swap"
        # the rebalancer keeps running (its load window still holds the traffic): read the placement,
        # the load and the metrics between two reads of one placement version, so no swap falls between
        with ExpertClient(target, timeout=30) as client, grpc.insecure_channel(target) as channel:
            quiet_by = time.monotonic() + 30
            while True:
                now = _placement(client, 1)
                request = expert_pb2.GetExpertLoadRequest(layers=[1])
                (load,) = expert_pb2_grpc.ExpertServiceStub(channel).GetExpertLoad(request, timeout=30).layers
                text = scrape(metrics_port)
                if _placement(client, 1).version == now.version or time.monotonic() > quiet_by:
                    break
        assert now.version >= 1 and list(now.physical_to_logical) != list(start.physical_to_logical)
        assert max(now.replica_counts[HOT], now.replica_counts[OTHER]) > 1  # a hot expert got replicas
        assert list(load.placement.physical_to_logical) == list(now.physical_to_logical)
        assert len(load.rank_tokens_recent) == 4 and 0 < load.balancedness <= 1
        assert sample(text, "expertd_eplb_rebalances_total", layer="1") == now.version
        assert sample(text, "expertd_eplb_rebalance_duration_seconds_count") == now.version
        assert 0 < sample(text, "expertd_eplb_balancedness", layer="1") <= 1
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=30)
        assert server.returncode == 0 and "drained, exiting" in rest, rest
    finally:
        stop.set()
        if server.poll() is None:
            server.kill()
            server.wait()
