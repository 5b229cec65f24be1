"""Admission by cost and deadline, and fairness (issue 27).

First the batcher alone, on a stand-in engine whose steps take a fixed time (so every estimate and
every step's composition can be checked exactly); then a real server (one mid-size layer, the
default admission settings) driven from another process: fairness between 1-token and
8,192-token clients, and 4x its capacity for 10 s with 2 s deadlines. Timings are compared within
the run (capacity, unloaded latency, the server's own step time), never with absolute numbers.
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from service_support import cache_dir

from expertd.kernels.moe import MoEConfig
from expertd.server.batching import admission
from expertd.server.batching.batcher import Batcher
from expertd.server.batching.requests import ForwardRequest, Header
from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig
from expertd.server.engine import api
from expertd.server.engine.api import ForwardOutput, RouteOutput
from expertd.server.engine.description import MeshDescription, ModelDescription
from expertd.server.errors import DeadlineExpired, InvalidRequest, Overloaded, status_of
from expertd.server.metrics.families import Metrics

STEP_S = 0.03  # the stand-in engine's step time, any bucket
MODEL = ModelDescription(name="fixed-time", layers={0: MoEConfig(num_experts=4, topk=1, hidden_size=3,
                                                                 intermediate_size=3)},
                         dtype=np.float32, buckets=(2, 4, 8), max_request_tokens=64, max_batch_tokens=8,
                         mesh=MeshDescription("ep", 1, "cpu"))
OVERFLOW = -7.0  # a row holding this value makes the stand-in's output infinite


class FixedTimeEngine:
    """Output = 2 * x (inf where x == OVERFLOW), after STEP_S seconds (``per_row``: STEP_S x its bucket
    / M, a step that grows with its rows as on a CPU); records each step's first-column values."""

    def __init__(self, per_row: bool = False):
        self.steps: list[list[float]] = []
        self.per_row = per_row

    def forward(self, layer, tokens, num_valid, token_ids=None):
        time.sleep(STEP_S * len(tokens) / MODEL.max_batch_tokens if self.per_row else STEP_S)
        x = tokens[:num_valid]
        self.steps.append([float(v) for v in x[:, 0]])
        out = np.where(x == OVERFLOW, np.inf, 2 * x).astype(np.float32)
        ids = np.zeros((num_valid, 1), np.int32)
        return ForwardOutput(out, ids, np.ones_like(ids, np.float32), np.bincount(ids[:, 0], minlength=4))

    def route(self, layer, tokens, num_valid, from_logits, token_ids=None):
        time.sleep(STEP_S)
        ids = np.zeros((num_valid, 1), np.int32)
        return RouteOutput(ids, np.ones_like(ids, np.float32), np.bincount(ids[:, 0], minlength=4), 0.0,
                           np.zeros((num_valid, 4), np.float32))


def run(work, per_row=False, **batching):
    async def main():
        engine = FixedTimeEngine(per_row)
        batcher = Batcher(engine, MODEL, BatchingConfig(bucket_sizes=MODEL.buckets, max_queue_delay_ms=0,
                                                        max_request_tokens=64, **batching),
                          Metrics(CollectorRegistry(), token_buckets=MODEL.buckets))
        await batcher.calibrate()
        engine.steps.clear()
        batcher.start()
        try:
            return await work(batcher), engine.steps
        finally:
            await batcher.close()
    return asyncio.run(main())


def rows(first, n):
    return np.arange(first, first + n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)


def forward(batcher, x, deadline=None):
    async def call():
        result, _ = await batcher.forward(ForwardRequest(0, x, np.dtype(np.float32), deadline))
        return result.output
    return asyncio.ensure_future(call())


def header(tokens):
    return Header(0, api.FORWARD, tokens)


def rejected(batcher, reason):
    return batcher.metrics.registry.get_sample_value("expertd_rejected_requests_total", {"reason": reason}) or 0


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_with_a_retry_delay():
    async def work(batcher):
        queued = [forward(batcher, rows(100 * i, 16)) for i in range(5)]  # 5 x 2 steps: about 10 steps of work
        await asyncio.sleep(0)
        backlog = batcher.backlog_seconds()
        now = time.monotonic()
        started = time.perf_counter()
        with pytest.raises(Overloaded) as refused:
            batcher.admit(header(16), now + 0.2)
        refused_in = time.perf_counter() - started
        late_ok = batcher.admit(header(16), now + 10 * backlog)  # a deadline it can meet: admitted
        late_ok.release()
        small = batcher.admit(header(1), now + 0.2)  # 1 token goes before the big ones: it fits
        small.release()
        await asyncio.gather(*queued)
        return backlog, refused_in, refused.value, rejected(batcher, "deadline")

    (backlog, refused_in, error, count), steps_run = run(work, max_queue_wait_ms=60_000)
    assert backlog == pytest.approx(10 * STEP_S, rel=0.5)
    assert refused_in < STEP_S  # decided at once, not after waiting
    assert error.reason == "deadline" and "too late for the deadline" in str(error) and count == 1
    # RetryInfo: when the queue will have drained enough for the same call to fit in its 0.2 s
    assert error.retry_after == pytest.approx(backlog + 2 * STEP_S - 0.2 / admission.MARGIN, abs=3 * STEP_S)
    code, _, details = status_of(error)
    assert code.name == "RESOURCE_EXHAUSTED" and details[0].retry_delay.ToTimedelta().total_seconds() > 0


def test_the_queue_is_bounded_in_tokens_in_expected_wait_and_in_requests():
    async def work(batcher):
        queued = [forward(batcher, rows(100 * i, 16)) for i in range(3)]  # 48 tokens, about 6 steps
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as by_tokens:
            batcher.admit(header(32), None)  # 48 + 32 > 64
        with pytest.raises(Overloaded) as by_wait:
            batcher.admit(header(8), None)  # about 6 steps ahead > 5 steps of wait allowed
        with batcher.admit(header(1), None):  # 1 token goes before them: admitted, the 4th pending request
            with pytest.raises(Overloaded) as by_size:
                batcher.admit(header(1), None)  # the hard cap on requests
        await asyncio.gather(*queued)
        return by_tokens.value, by_wait.value, by_size.value, [rejected(batcher, r) for r in
                                                              ("queue_tokens", "queue_wait", "queue_size")]

    (tokens, wait, size, counts), _ = run(work, max_queue_tokens=64, max_queue_wait_ms=5 * STEP_S * 1e3,
                                          max_queue_size=4)
    assert tokens.reason == "queue_tokens" and "--max-queue-tokens 64" in str(tokens) and tokens.retry_after > 0
    assert wait.reason == "queue_wait" and "--max-queue-wait-ms" in str(wait)
    assert wait.retry_after == pytest.approx(STEP_S, abs=2 * STEP_S)
    assert size.reason == "queue_size" and "--max-queue-size 4" in str(size)
    assert counts == [1, 1, 1]


def test_an_idle_server_tries_any_request():
    async def work(batcher):
        late = forward(batcher, rows(0, 64), deadline=time.monotonic() + 0.01)  # 8 steps in 10 ms: cannot
        with pytest.raises(DeadlineExpired):
            await late
        return batcher.metrics.registry.get_sample_value("expertd_dropped_requests_total", {"reason": "deadline"})

    dropped, steps_run = run(work)
    assert dropped == 1  # once per request, not once per part
    assert 1 <= len(steps_run) < 8  # it was tried, then dropped before its last parts ran


def test_a_small_request_waits_for_at_most_one_step_of_big_work_and_big_ones_keep_going():
    async def work(batcher):
        big = forward(batcher, rows(1000, 64))  # 8 steps of 8 rows
        await asyncio.sleep(STEP_S / 2)  # its first step runs
        smalls = []
        for i in range(6):  # a steady stream of 1-token requests, one per step
            smalls.append(forward(batcher, rows(i, 1)))
            await asyncio.sleep(STEP_S)
        await asyncio.gather(big, *smalls)
        return [(await s)[0, 0] / 2 for s in smalls]

    _, steps_run = run(work)
    for i in range(6):
        found = [n for n, step in enumerate(steps_run) if float(i) in step]
        assert len(found) == 1
        # it arrived during step i (or i + 1) and ran in the next one, beside the big request's rows
        assert found[0] <= i + 2 and any(v >= 1000 for v in steps_run[found[0]])
    assert all(sum(v >= 1000 for v in step) >= 4 for step in steps_run[:7])  # the big one kept half a step or more


def test_where_steps_grow_with_rows_a_small_request_gets_a_step_sized_for_it_and_big_ones_keep_going():
    async def work(batcher):
        big = forward(batcher, rows(1000, 64))  # 8 full steps of 8 rows
        await asyncio.sleep(STEP_S / 2)  # its first step runs
        smalls = []
        for i in range(6):  # a steady stream of 1-token requests
            smalls.append(forward(batcher, rows(i, 1)))
            await asyncio.sleep(STEP_S)
        outputs = await asyncio.gather(big, *smalls)
        np.testing.assert_array_equal(outputs[0], 2 * rows(1000, 64))
        return [out[0, 0] / 2 for out in outputs[1:]]

    values, steps_run = run(work, per_row=True)
    assert values == list(range(6))
    sized = [len(step) <= 4 for step in steps_run]  # the small rows' bucket (2), or 4 if a step ran slow: not M
    assert sum(sized) >= 4
    for i in range(6):
        (n,) = [n for n, step in enumerate(steps_run) if float(i) in step]
        # it ran in a step sized for it, or in the full step owed to the big request after such a step
        assert sized[n] or (n > 0 and sized[n - 1] and len(steps_run[n]) == MODEL.max_batch_tokens)
    big_left = 64
    for n, step in enumerate(steps_run[:-1]):
        big_left -= sum(v >= 1000 for v in step)
        if sized[n] and big_left >= MODEL.max_batch_tokens:  # the next step is owed to the big request: full
            assert len(steps_run[n + 1]) == MODEL.max_batch_tokens and not sized[n + 1]


def test_with_small_step_slack_0_a_small_request_joins_full_steps():
    async def work(batcher):
        big = forward(batcher, rows(1000, 64))
        await asyncio.sleep(STEP_S / 2)
        small = forward(batcher, rows(0, 1))
        await asyncio.gather(big, small)

    _, steps_run = run(work, per_row=True, small_step_slack=0)
    (n,) = [n for n, step in enumerate(steps_run) if 0.0 in step]
    assert len(steps_run[n]) == MODEL.max_batch_tokens  # filled with the big request's rows, as before
    assert all(len(step) == MODEL.max_batch_tokens for step in steps_run[:-1])


def test_step_growth_follows_the_measured_times():
    times = admission.StepTimes()
    assert times.rows_at_cost_of("k", 2, (2, 4, 8), 1.25) == 8  # nothing measured: free
    for bucket, seconds in ((2, 0.010), (4, 0.012), (8, 0.040)):
        times.seed("k", bucket, seconds)
    assert times.rows_at_cost_of("k", 2, (2, 4, 8), 1.25) == 4  # 4 rows within 1.25 x the 2-row step, 8 not
    assert times.rows_at_cost_of("k", 8, (2, 4, 8), 1.25) == 8
    assert times.rows_at_cost_of("k", 2, (2, 4, 8), 4.0) == 8
    for bucket in (2, 4, 8):
        times.seed("flat", bucket, 0.010)
    assert times.rows_at_cost_of("flat", 2, (2, 4, 8), 1.25) == 8  # a GPU: the step fills as before
    for _ in range(20):  # small steps slowed by the host: the estimate follows, the sizing does not
        times.observe("k", 2, 0.050)
    assert times.estimate("k", 2) > 0.040 and times.rows_at_cost_of("k", 2, (2, 4, 8), 1.25) == 4


def test_non_finite_results_fail_their_request_alone():
    async def work(batcher):
        calls = [forward(batcher, rows(1, 2)), forward(batcher, np.full((2, 3), OVERFLOW, np.float32)),
                 forward(batcher, rows(3, 2))]
        return await asyncio.gather(*calls, return_exceptions=True)

    (good, bad, other), _ = run(work)
    np.testing.assert_array_equal(good, 2 * rows(1, 2))
    np.testing.assert_array_equal(other, 2 * rows(3, 2))
    assert isinstance(bad, InvalidRequest) and bad.field == "hidden_states" and "not finite at token 0" in str(bad)


# ---------------------------------------------------------------------- a real server under load

LOAD = pathlib.Path(__file__).with_name("overload_load.py")
HEAVY = {  # compute-bound enough that the load generator's share of a small CI box stays small
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 512,
    "intermediate_size": 1024, "moe_intermediate_size": 1024, "num_hidden_layers": 1, "num_experts": 16,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu",
}
DEADLINE_S = 2.0
TOKENS = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from expertd.server.app import create_server
    from expertd.server.models.hf_config import moe_config_from_hf
    from expertd.server.models.presets import LoadedLayer, SeededParams

    cfg = moe_config_from_hf(HEAVY)
    layers = [LoadedLayer(0, cfg, SeededParams(cfg, layer_index=0, seed=0, dtype="float32"), source="test heavy")]
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, compile_cache_dir=str(cache_dir(tmp_path_factory)),
                          model=ModelConfig(dtype="float32", num_devices=1),
                          batching=BatchingConfig(bucket_sizes=(1, 16, 256)))  # admission: the defaults
    handle = create_server(config, layers=layers)
    handle.wait_ready(timeout=600)
    yield handle
    handle.stop(grace=5)


def load(server, duration, *streams):
    spec = {"target": f"127.0.0.1:{server.port}", "hidden": 512, "duration": duration, "streams": list(streams)}
    done = subprocess.run([sys.executable, str(LOAD), json.dumps(spec)], capture_output=True, text=True,
                          timeout=duration + 120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def latencies(calls, code="OK"):
    return [latency for _, latency, got in calls if got == code]


@pytest.mark.exclusive
def test_a_1_token_client_is_not_held_up_by_an_8192_token_client(server):
    small = {"name": "small", "tokens": 1, "concurrency": 1, "deadline": 30.0}
    alone = latencies(load(server, 1.5, small)["calls"]["small"])
    beside = load(server, 4.0, small, {"name": "big", "tokens": 8192, "concurrency": 2, "deadline": 60.0})["calls"]
    near = latencies(beside["small"])
    big = latencies(beside["big"])
    step = server.batcher.times.estimate(server.batcher.step_key(server.model.layers[0], api.FORWARD), 256)
    assert len(alone) >= 20 and len(near) >= 20 and big
    p50_alone, p50_near = np.percentile(alone, 50), np.percentile(near, 50)
    print(dict(p50_alone=p50_alone, p50_near=p50_near, step=step, big_p50=np.percentile(big, 50)))
    # the running step and the one it joins (the exact bound: the fixed-time test above), with slack for a
    # shared CI box and the event loop's own work on the big requests: a few steps, not a big request's 32
    assert p50_near <= p50_alone + 6 * step, (p50_alone, p50_near, step)
    assert p50_near < np.percentile(big, 50) / 4  # never behind a whole 8192-token request (32 steps)


@pytest.mark.slow
@pytest.mark.exclusive
def test_4x_capacity_for_10_s_keeps_the_goodput_and_refuses_the_rest_at_once(server):
    run = load(server, 3.0, {"name": "capacity", "tokens": TOKENS, "concurrency": 16, "deadline": 30.0})
    capacity = len(latencies(run["calls"]["capacity"])) / run["duration"]
    before = {r: server.registry.get_sample_value("expertd_rejected_requests_total", {"reason": r}) or 0
              for r in ("deadline", "queue_wait", "queue_tokens", "queue_size")}
    run = load(server, 10.0, {"name": "open", "tokens": TOKENS, "rate": 4 * capacity, "deadline": DEADLINE_S})
    calls = run["calls"]["open"]
    ok, refused = latencies(calls), latencies(calls, "RESOURCE_EXHAUSTED")
    late = len(latencies(calls, "DEADLINE_EXCEEDED"))
    goodput = sum(lat <= DEADLINE_S for lat in ok) / run["duration"]
    summary = dict(capacity=capacity, goodput=goodput, sent=len(calls), ok=len(ok), refused=len(refused), late=late,
                   ok_p50=np.percentile(ok, 50), refused_p50=np.percentile(refused, 50))
    print(summary)  # shown with pytest -rP
    # The goal is 0.8, measured by benchmarks/overload.py on a quiet machine (BENCHMARKS.md);
    # here the load generator shares the cores and the CI box is not quiet: a margin below the goal,
    # far above the collapse this guards against (0.09-0.18).
    assert goodput >= 0.6 * capacity, summary
    assert len(ok) + len(refused) + late == len(calls), summary  # nothing else: no UNKNOWN, no INTERNAL
    assert late <= 0.05 * len(ok), summary  # admitted requests are answered within their deadline
    assert np.percentile(refused, 50) < 0.1 * DEADLINE_S, summary  # a refusal comes back at once
    assert np.percentile(refused, 50) < np.percentile(ok, 50) / 4, summary
    after = {r: server.registry.get_sample_value("expertd_rejected_requests_total", {"reason": r}) or 0
             for r in before}
    assert sum(after.values()) - sum(before.values()) == len(refused), (before, after)
