"""The batcher on its own: the expert-load window on a fake clock, and scheduling on a stand-in
engine whose arithmetic is trivial, so every merged or split step can be checked exactly (the real
engine is exercised by the end-to-end tests)."""
import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from expertd.kernels.moe import MoEConfig
from expertd.server.batching.batcher import Batcher
from expertd.server.batching.queues import LayerQueue, QueuedRequest, Queues
from expertd.server.batching.requests import ForwardRequest, RouteRequest
from expertd.server.config import BatchingConfig
from expertd.server.engine.api import ForwardOutput, RouteOutput
from expertd.server.engine.description import MeshDescription, ModelDescription
from expertd.server.errors import Overloaded, status_of
from expertd.server.metrics.expert_load import ExpertLoadTracker
from expertd.server.metrics.families import Metrics
from expertd.server.transport.event_loop import loop_factory


def test_recent_window_forgets_old_steps_and_total_keeps_everything():
    now = [100.0]
    tracker = ExpertLoadTracker({3: 4}, window_s=10.0, clock=lambda: now[0])
    tracker.add(3, np.array([2, 0, 0, 2]))
    assert tracker.imbalance(3) == 2.0  # max/mean = 2 / 1
    now[0] = 105.5
    tracker.add(3, np.array([0, 1, 1, 0]))
    np.testing.assert_array_equal(tracker.recent(3), [2, 1, 1, 2])
    now[0] = 111.0  # the first step's second [100, 101) is out of the 10 s window
    np.testing.assert_array_equal(tracker.recent(3), [0, 1, 1, 0])
    np.testing.assert_array_equal(tracker.total(3), [2, 1, 1, 2])
    now[0] = 200.0
    np.testing.assert_array_equal(tracker.recent(3), [0, 0, 0, 0])
    tracker.add(3, np.zeros(4, np.int64))
    assert tracker.imbalance(3) == 1.0  # no tokens: balanced by convention


POISON = 13.0  # a row holding this value makes the stand-in engine fail


MODEL = ModelDescription(name="doubling", layers={0: MoEConfig(num_experts=4, topk=1, hidden_size=3,
                                                                intermediate_size=3)},
                         dtype=np.float32, buckets=(2, 4), max_request_tokens=64, max_batch_tokens=4,
                         mesh=MeshDescription("ep", 1, "cpu"))


class DoublingEngine:
    """Engine contract with output = 2 * x, expert = first column mod 4; records each step's rows
    (valid, bucket)."""

    def __init__(self):
        self.steps = []
        self.token_ids = []  # each step's token_ids argument

    def forward(self, layer, tokens, num_valid, token_ids=None):
        self.steps.append((num_valid, len(tokens)))
        self.token_ids.append(token_ids)
        assert tokens.dtype == MODEL.dtype and len(tokens) in MODEL.buckets, "padded to a bucket by the batcher"
        x = tokens[:num_valid]
        if (x == POISON).any():
            raise RuntimeError("device fault with a secret detail")
        ids = (x[:, :1].astype(np.int32) % 4)
        return ForwardOutput(2 * x, ids, np.ones_like(ids, np.float32), np.bincount(ids[:, 0], minlength=4))


def run(coroutine_fn, **batching):
    async def main():
        engine = DoublingEngine()
        # the idle fast path off unless a test asks for it: these tests schedule concurrent requests
        batching.setdefault("inline_step_max_ms", 0.0)
        batcher = Batcher(engine, MODEL, BatchingConfig(bucket_sizes=(2, 4), **batching),
                          Metrics(CollectorRegistry(), token_buckets=(2, 4)))
        batcher.start()
        try:
            return await coroutine_fn(batcher), [valid for valid, _ in engine.steps]
        finally:
            await batcher.close()
    return asyncio.run(main())


def rows(start, n):
    return np.arange(start, start + n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)


def forward(batcher, x, *, deadline=None, out_dtype=np.float32, token_ids=None):
    """The batcher's result for x [T, 3] (already in the engine dtype, as decoded)."""
    async def call():
        result, _ = await batcher.forward(ForwardRequest(0, x, np.dtype(out_dtype), deadline,
                                                          token_ids=token_ids))
        return result
    return call()


def test_concurrent_requests_share_steps_and_big_ones_are_split():
    async def work(batcher):
        return await asyncio.gather(*(forward(batcher, rows(10 * i, n)) for i, n in enumerate((1, 1, 1, 1, 9))))

    results, steps = run(work, max_queue_delay_ms=50)
    for (i, n), result in zip(enumerate((1, 1, 1, 1, 9)), results):
        np.testing.assert_array_equal(result.output, 2 * rows(10 * i, n))
        np.testing.assert_array_equal(result.routing.tokens_per_expert,
                                      np.bincount(rows(10 * i, n)[:, 0].astype(int) % 4, minlength=4))
    assert sum(steps) == 13 and max(steps) <= 4 and len(steps) < 5 + 3  # merged, and 9 rows split into parts


def test_a_failing_request_does_not_fail_the_others_in_its_batch():
    async def work(batcher):
        calls = [forward(batcher, rows(0, 1)), forward(batcher, np.full((1, 3), POISON, np.float32)),
                 forward(batcher, rows(5, 1))]
        return await asyncio.gather(*calls, return_exceptions=True)

    (good, bad, other), steps = run(work, max_queue_delay_ms=50)
    np.testing.assert_array_equal(good.output, 2 * rows(0, 1))
    np.testing.assert_array_equal(other.output, 2 * rows(5, 1))
    assert isinstance(bad, RuntimeError)
    assert steps[0] == 3 and sorted(steps[1:]) == [1, 1, 1]  # the merged step failed; each part re-ran alone
    code, message, _ = status_of(bad)
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message and "RuntimeError" in message


def test_full_queue_is_overloaded_and_expired_requests_are_dropped():
    async def work(batcher):
        first = asyncio.ensure_future(forward(batcher, rows(0, 1), deadline=0.0))  # already expired
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await forward(batcher, rows(1, 1))
        return await asyncio.gather(first, return_exceptions=True)

    (expired,), steps = run(work, max_queue_size=1, max_queue_delay_ms=10)
    assert type(expired).__name__ == "DeadlineExpired" and steps == []
    assert status_of(expired)[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_each_request_reports_its_own_queue_and_compute_time():
    async def work(batcher):
        _, waited = await batcher.forward(ForwardRequest(0, rows(0, 3), np.dtype(np.float32)))  # 3 rows pad to
        _, split = await batcher.forward(ForwardRequest(0, rows(0, 9), np.dtype(np.float32)))  # bucket 4: waits
        # the 50 ms delay; 9 rows are three parts: three steps of compute
        registry = batcher.metrics.registry
        histogram = [registry.get_sample_value(f"expertd_queue_duration_seconds_{s}", {"kind": "forward"})
                     for s in ("count", "sum")]
        return waited, split, histogram

    (waited, split, (count, total)), steps = run(work, max_queue_delay_ms=50)
    assert steps == [3, 4, 4, 1]
    # Compute time depends on the machine's load, so it is only checked to be measured, not compared.
    assert waited.queue_seconds >= 0.045 and waited.compute_seconds > 0
    assert split.compute_seconds > 0 and split.queue_seconds >= 0
    assert count == 2 and total == pytest.approx(waited.queue_seconds + split.queue_seconds)  # once per request


def test_each_step_is_padded_once_to_its_bucket_and_answered_in_the_callers_dtype():
    async def work(batcher):
        halves = await asyncio.gather(forward(batcher, rows(0, 1), out_dtype=np.float16),
                                      forward(batcher, rows(1, 2)))
        return halves, batcher.engine.steps

    ((as_fp16, as_fp32), steps), _ = run(work, max_queue_delay_ms=50)
    assert steps == [(3, 4)]  # merged: 3 valid rows padded to bucket 4
    assert as_fp16.output.dtype == np.float16 and as_fp32.output.dtype == np.float32
    np.testing.assert_array_equal(as_fp16.output, (2 * rows(0, 1)).astype(np.float16))
    np.testing.assert_array_equal(as_fp32.output, 2 * rows(1, 2))


def test_a_lone_request_runs_inline_and_concurrent_ones_still_merge():
    """The idle fast path: a request that finds nothing else admitted and the device idle runs its
    step on the event loop at once (no queue delay, no hand-over to the device thread); requests
    arriving right behind a step (concurrent load) are queued and merged as before."""
    threads = []

    async def work(batcher):
        engine_forward = batcher.engine.forward

        def recording(*args, **kwargs):
            threads.append(threading.current_thread().name)
            time.sleep(0.003)  # a step of 3 ms: the gap between requests below is far shorter
            return engine_forward(*args, **kwargs)

        batcher.engine.forward = recording
        alone = await forward(batcher, rows(0, 1))  # nothing else admitted, the device idle: inline
        together = await asyncio.gather(*(forward(batcher, rows(10 * i, 1)) for i in range(1, 4)))
        return [alone, *together]

    results, steps = run(work, max_queue_delay_ms=50, inline_step_max_ms=50.0)
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.output, 2 * rows(10 * i, 1))
    assert threads[0] == threading.main_thread().name  # asyncio.run's loop runs on this thread
    assert steps[0] == 1 and sum(steps) == 4
    # the next arrived right after that step: queued, so the ones behind it could merge
    assert max(steps[1:]) >= 2 and all(name.startswith("expertd-device") for name in threads[1:])


def test_the_fast_path_is_off_with_zero():
    threads = []

    async def work(batcher):
        engine_forward = batcher.engine.forward

        def recording(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return engine_forward(*args, **kwargs)

        batcher.engine.forward = recording
        await forward(batcher, rows(0, 1))
        await asyncio.sleep(0.01)
        await forward(batcher, rows(0, 1))

    run(work, inline_step_max_ms=0.0)
    assert len(threads) == 2 and all(name.startswith("expertd-device") for name in threads)


def ids_of(x):
    """Token ids that name their rows: 100 + the row's first value."""
    return (100 + x[:, 0]).astype(np.int32)


def test_token_ids_travel_with_their_rows_and_are_padded_to_the_bucket():
    async def work(batcher):
        xs = [rows(10 * i, n) for i, n in enumerate((1, 2, 7))]
        await asyncio.gather(*(forward(batcher, x, token_ids=ids_of(x)) for x in xs))
        return batcher.engine.steps, batcher.engine.token_ids, xs

    (steps, token_ids, xs), _ = run(work, max_queue_delay_ms=50)
    assert sum(valid for valid, _ in steps) == 10 and all(ids is not None for ids in token_ids)
    seen = []
    for (valid, bucket), ids in zip(steps, token_ids):
        assert ids.dtype == np.int32 and ids.shape == (bucket,)  # one id per row of the padded step
        assert (ids[valid:] == 0).all()
        seen.extend(ids[:valid].tolist())
    assert sorted(seen) == sorted(np.concatenate([ids_of(x) for x in xs]).tolist())


def test_a_step_mixing_requests_with_and_without_token_ids_gets_none():
    async def work(batcher):
        with_ids, without = rows(0, 1), rows(10, 2)
        await asyncio.gather(forward(batcher, with_ids, token_ids=ids_of(with_ids)), forward(batcher, without))
        return batcher.engine.steps, batcher.engine.token_ids

    (steps, token_ids), _ = run(work, max_queue_delay_ms=50)
    assert steps == [(3, 4)] and token_ids == [None]


def test_route_passes_token_ids_to_the_engine():
    seen = []

    class RoutingEngine(DoublingEngine):
        def route(self, layer, tokens, num_valid, *, from_logits=False, token_ids=None):
            seen.append(token_ids)
            ids = (tokens[:, :1].astype(np.int32) % 4)
            return RouteOutput(ids, np.ones_like(ids, np.float32), np.bincount(ids[:num_valid, 0], minlength=4), 0.0,
                               np.full((len(tokens), 4), 0.25, np.float32))

    async def main():
        batcher = Batcher(RoutingEngine(), MODEL, BatchingConfig(bucket_sizes=(2, 4)),
                          Metrics(CollectorRegistry(), token_buckets=(2, 4)))
        batcher.start()
        try:
            x = rows(0, 2)
            await batcher.route(RouteRequest(0, x, False, 1.0, None, token_ids=ids_of(x)))
        finally:
            await batcher.close()

    asyncio.run(main())
    np.testing.assert_array_equal(seen[0], ids_of(rows(0, 2)))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_one_deadline_timer_per_queue_expires_each_queued_request_at_its_deadline(loop):
    """Queues arm one timer per queue, for the earliest queued deadline: a later deadline arms
    nothing, an earlier one re-arms; when it fires, every queued request past its deadline is
    expired and the timer re-armed for the next. On either event loop (uvloop's clock is its own)."""
    async def until(condition, limit_s=10.0):
        deadline = time.monotonic() + limit_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    async def main():
        loop = asyncio.get_running_loop()
        expired = []
        queues = Queues(4, lambda request: (expired.append(request), queues.end(request)))
        queue = queues.add(LayerQueue(0, "forward", "key"))
        now = time.monotonic()  # request deadlines are on this clock, whatever the loop's is
        made = []
        for delay in (60.0, 0.05, 60.0, 1.0):
            queues.reserve(queue, 1, small=True)
            made.append(QueuedRequest(queue, rows(0, 1), "hidden_states", now + delay, now, loop.create_future(),
                                      small=True))
            queues.enqueue(made[-1])
        first_timer = queue.expiry
        assert queue.expiry_at == now + 0.05
        await until(lambda: expired)
        assert expired == [made[1]] and queue.expiry_at == now + 1.0 and queue.expiry is not first_timer
        assert time.monotonic() >= now + 0.05  # not before its deadline
        await until(lambda: len(expired) == 2)
        assert expired == [made[1], made[3]] and queue.expiry_at == now + 60.0 and time.monotonic() >= now + 1.0
        assert queue.rows == 2 and queues.queued_tokens == 2  # the expired left the accounting
        queues.close()
        assert queue.expiry is None
    with asyncio.Runner(loop_factory=loop_factory(loop)[0]) as runner:
        runner.run(main())
