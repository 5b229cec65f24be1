"""Client-side adaptive throttling (issue 27, overload): while the server refuses most of a
client's Forward and Route calls, ExpertClient and AsyncExpertClient refuse some themselves,
unsent; the counts and the decision rule of ``expertd.client.throttle``, and the clients against
the real server on loopback (its refusal counter shows which refusals it paid for)."""
import asyncio
import itertools
import random
import time

import grpc
import numpy as np
import pytest
from service_support import BUCKETS as TOKEN_BUCKETS
from service_support import one_place_server, queue_full

from expertd.client import (
    AsyncExpertClient,
    Backoff,
    ExpertClient,
    ResourceExhaustedError,
    Throttle,
    ThrottledError,
)
from expertd.client.loadtest import LoadTestConfig, _Target
from expertd.client.throttle import BUCKETS, AdaptiveThrottle

# ------------------------------------------------------------------ the rule, on a clock of its own


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(k=2.0, window_s=10.0, rand=0.0, max_probability=0.9, min_requests=0):
    clock = _Clock()
    settings = Throttle(k=k, window_s=window_s, max_probability=max_probability, min_requests=min_requests)
    return AdaptiveThrottle(settings, clock=clock, rand=lambda: rand), clock


def _server_refuses(throttle: AdaptiveThrottle) -> bool:
    """One first attempt the server refuses when it is sent; whether it was sent."""
    sent = throttle.allow()
    if sent:
        throttle.refused(None)
    return sent


def test_nothing_is_refused_while_the_server_accepts_at_least_one_call_in_k():
    throttle, _clock = _throttle(k=2.0, rand=0.0)  # rand 0: any positive probability refuses
    for n in range(200):
        assert throttle.allow()
        if n % 2 == 0:
            throttle.accepted()  # exactly half accepted: requests - 2 * accepts <= 0 throughout
        else:
            throttle.refused(None)
    assert throttle.counts() == (200, 100)


def test_attempts_in_flight_are_not_judged():
    """A burst of concurrent first calls, none answered yet, is all sent: their outcome is unknown."""
    throttle, _clock = _throttle(k=2.0, rand=0.0, min_requests=20)
    assert all(throttle.allow() for _ in range(64))
    assert throttle.counts() == (0, 0)
    for _ in range(64):
        throttle.accepted()
    assert throttle.counts() == (64, 64) and throttle.allow()


@pytest.mark.parametrize("requests,accepts,k", [(10, 0, 2.0), (100, 25, 2.0), (100, 40, 2.0), (60, 10, 3.0),
                                               (100, 0, 2.0)])
def test_an_attempt_is_refused_with_the_sre_probability_up_to_the_cap(requests, accepts, k):
    want = min(0.9, max(0.0, (requests - k * accepts) / (requests + 1)))
    for rand, refused in ((want - 1e-9, True), (want + 1e-9, False)):
        throttle, _clock = _throttle(k=k, max_probability=0.9, rand=1.0)  # every attempt sent while counting
        for n in range(requests):
            assert throttle.allow()
            throttle.accepted() if n < accepts else throttle.refused(None)
        throttle._rand = lambda rand=rand: rand
        assert throttle.allow() is not refused, (rand, want)


def test_refusals_stop_as_accepts_return_and_old_counts_leave_the_window():
    throttle, clock = _throttle(window_s=10.0, rand=0.0)
    for _ in range(50):
        _server_refuses(throttle)  # nothing accepted
    assert not throttle.allow()
    clock.now += 10.0 / BUCKETS  # one bucket on: the refusals are still in the window
    assert not throttle.allow()
    clock.now += 10.0  # a whole window on: forgotten
    assert throttle.counts() == (0, 0) and throttle.allow()
    throttle.refused(None)
    for _ in range(30):
        _server_refuses(throttle)
    assert not throttle.allow()
    for _ in range(33):  # the server accepts again (retries): accepts catch up with half the attempts
        throttle.accepted()
    assert throttle.allow()


def test_nothing_is_refused_before_the_window_holds_min_requests():
    throttle, _clock = _throttle(min_requests=20)
    assert all(_server_refuses(throttle) for _ in range(20))  # 20 refused by the server: still sent
    assert not throttle.allow()
    throttle, _clock = _throttle(min_requests=20)
    for _ in range(19):
        throttle.refused(None)  # retries' refusals are counted too (retries are never refused here)
    assert _server_refuses(throttle) and not throttle.allow()


@pytest.mark.parametrize("rate", [50, 1000])
def test_refusals_stop_within_two_windows_of_the_server_recovering(rate):
    """The default settings, a client sending ``rate`` calls a second: the server refuses every
    attempt for 5 s, then accepts every one; the client's own refusals thin out and stop."""
    clock = _Clock()
    throttle = AdaptiveThrottle(Throttle(), clock=clock, rand=random.Random(0).random)
    refused_after = []
    for n in range(10 * rate):
        clock.now = 1000.0 + n / rate
        sent = throttle.allow()
        if n < 5 * rate:
            if sent:
                throttle.refused(0.01)
        elif sent:
            throttle.accepted()
        else:
            refused_after.append(n / rate - 5.0)
    assert refused_after and max(refused_after) < 2 * Throttle().window_s, max(refused_after)
    assert sum(t < 0.5 for t in refused_after) > sum(1.0 <= t < 1.5 for t in refused_after)  # thinning out


def test_some_attempts_always_go_out():
    throttle, _clock = _throttle(rand=0.95, max_probability=0.9)
    for _ in range(1000):
        _server_refuses(throttle)
    # refused with probability 0.9 at most, however many were refused
    assert throttle.counts() == (1000, 0) and throttle.allow()


def test_buckets_leave_the_window_one_at_a_time():
    throttle, clock = _throttle(window_s=float(BUCKETS))  # one bucket a second: exact clock steps
    for _bucket in range(BUCKETS):
        throttle.allow()
        throttle.accepted()
        clock.now += 1.0
    assert throttle.counts() == (BUCKETS - 1, BUCKETS - 1)  # the oldest bucket is forgotten now
    clock.now += 3.0  # a jump forgets every bucket it passes, not only the one it lands in
    assert throttle.counts() == (BUCKETS - 4, BUCKETS - 4)
    clock.now += 100.0
    assert throttle.counts() == (0, 0)


@pytest.mark.parametrize("field,value,message", [("k", 0.5, "Throttle.k must be >= 1"),
                                                 ("k", float("nan"), "Throttle.k must be >= 1"),
                                                 ("window_s", 0.0, "Throttle.window_s must be > 0"),
                                                 ("max_probability", 1.0, r"max_probability must be in \[0, 1\)"),
                                                 ("min_requests", -1, "Throttle.min_requests must be >= 0")])
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        Throttle(**{field: value})


def test_the_refusal_is_a_resource_exhausted_error_that_says_why_with_the_servers_delay():
    throttle, _clock = _throttle()
    for _ in range(8):
        _server_refuses(throttle)
    throttle.accepted()
    error = throttle.refusal()
    assert isinstance(error, ResourceExhaustedError) and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retryable and error.retry_delay is None  # no hint from the server yet: the backoff decides
    assert "accepted 1 of its last 9 attempts" in error.message and "throttle=None" in error.message
    throttle.refused(0.25)
    throttle.refused(None)  # a refusal without RetryInfo keeps the last hint
    assert throttle.refusal().retry_delay == 0.25


# ------------------------------------------------------------------ the clients and the real server

CALLS = 40
ROWS = max(TOKEN_BUCKETS)  # a full step: it runs at once, not after the fixture's 30 s gather


def _seeded(seed=0, **settings) -> AdaptiveThrottle:
    """A client's throttle with repeatable draws and a window longer than any test."""
    return AdaptiveThrottle(Throttle(window_s=600.0, **settings), rand=random.Random(seed).random)


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    with one_place_server(tmp_path_factory) as server:  # service_support: one queue place, a long gather
        yield server


def _refused_by_server(registry) -> float:
    return registry.get_sample_value("expertd_rejected_requests_total", {"reason": "queue_size"}) or 0.0


def _outcomes(call) -> tuple[int, int, int]:
    """(answered, refused by the server, refused here) of CALLS calls of ``call()``."""
    answered = server = here = 0
    for _ in range(CALLS):
        try:
            call()
            answered += 1
        except ThrottledError:
            here += 1
        except ResourceExhaustedError:
            server += 1
    return answered, server, here


def test_expert_client_refuses_calls_itself_while_the_server_refuses_them(busy_server):
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x = np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)
    with ExpertClient(target, timeout=60, retries=0, throttle=_seeded()) as client:
        want = client.forward(x, layer=1)
        with queue_full(target, registry):
            before = _refused_by_server(registry)
            answered, server, here = _outcomes(lambda: client.forward(x, layer=1))
            assert answered == 0 and server + here == CALLS
            assert here >= CALLS // 4, (server, here)  # about half after the first few
            assert _refused_by_server(registry) - before == server  # the server paid only for those it saw
            _answered, _server, route_here = _outcomes(lambda: client.route(x, layer=1))
            assert route_here > 0  # Route is throttled too, on the same counts
            client.model_info()  # other methods never are
        for _ in range(200):  # the server accepts again: within a few calls every call goes through
            try:
                np.testing.assert_array_equal(client.forward(x, layer=1), want)
                break
            except ThrottledError:
                continue
        else:
            pytest.fail("the client kept refusing its calls after the server recovered")
        requests, accepts = client._throttle.counts()
        assert accepts >= 2


def test_without_throttling_the_server_refuses_every_call(busy_server):
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x = np.ones((ROWS, 64), np.float32)
    with ExpertClient(target, timeout=60, retries=0, throttle=None) as client, queue_full(target, registry):
        before = _refused_by_server(registry)
        assert _outcomes(lambda: client.forward(x, layer=1)) == (0, CALLS, 0)
        assert _refused_by_server(registry) - before == CALLS


def test_async_client_refuses_calls_itself_too(busy_server):
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x = np.ones((ROWS, 64), np.float32)

    async def run():
        async with AsyncExpertClient(target, timeout=60, retries=0, throttle=_seeded(1, k=1.5)) as client:
            answered = here = 0
            for _ in range(CALLS):
                try:
                    await client.forward(x, layer=1)
                    answered += 1
                except ThrottledError:
                    here += 1
                except ResourceExhaustedError:
                    pass
            return answered, here

    with queue_full(target, registry):
        answered, here = asyncio.run(run())
    assert answered == 0 and here >= CALLS // 4


def test_a_call_refused_here_is_retried_after_the_servers_delay_and_answered(busy_server):
    """Only first attempts are refused here; a refusal carries the server's latest RetryInfo delay,
    and the retry goes out (counted) and is answered once the server has room. Two clients given
    one AdaptiveThrottle share its counts."""
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x = np.ones((ROWS, 64), np.float32)
    draws = itertools.cycle([0.0])  # every first attempt with a positive probability is refused
    shared = AdaptiveThrottle(Throttle(window_s=600.0, min_requests=0), rand=lambda: next(draws))
    fast = Backoff(initial=0.001, maximum=0.002)
    with ExpertClient(target, timeout=60, retries=0, throttle=shared) as refused, \
            ExpertClient(target, timeout=60, retries=1, throttle=shared, backoff=fast) as retrying:
        with queue_full(target, registry):
            with pytest.raises(ResourceExhaustedError) as by_server:
                refused.forward(x, layer=1)
            assert not isinstance(by_server.value, ThrottledError) and by_server.value.retry_delay > 0
            with pytest.raises(ThrottledError) as here:
                refused.forward(x, layer=1)
            assert here.value.retry_delay == by_server.value.retry_delay  # the server's hint
            assert _refused_by_server(registry) >= 1
        assert shared.counts() == (2, 0)
        shared.refused(0.05)  # a later refusal and its hint (the one above covers the fixture's 30 s gather)
        started = time.monotonic()
        assert retrying.forward(x, layer=1).shape == (ROWS, 64)  # refused here, then retried and answered
        assert time.monotonic() - started >= 0.05
        assert shared.counts() == (5, 1)


def test_the_load_test_never_throttles_itself():
    async def made():
        target = _Target(LoadTestConfig(target="127.0.0.1:1"))
        throttle = target._client._throttle
        await target.close()
        return throttle

    assert asyncio.run(made()) is None
