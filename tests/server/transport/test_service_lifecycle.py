"""Overload, deadlines, cancellation, retries, health transitions and draining (in-process and on SIGTERM).

The servers here have one bucket of 8 tokens and a long ``--max-queue-delay-ms``: single-token
requests wait in the queue for others to fill the bucket (8 queued tokens would start at once),
which makes queue states observable without timing luck.

What the server itself answers is asked over a plain channel (``raw_forward``): the client balances
over healthy replicas only, so it never sends a call to a server that is not SERVING.
"""
import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_support import cache_dir, sample, scrape, server_config

from expertd.client import (
    AsyncExpertClient,
    Backoff,
    DeadlineExceededError,
    ExpertClient,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from expertd.client.messages import forward_request, stream_request
from expertd.client.pb.v1 import expert_pb2_grpc
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

H = 64
QUEUE_DELAY_MS = 1000.0
SLOW_BUCKETS = (8,)
ONE_LAYER = ModelConfig(preset="tiny", num_layers=1, dtype="float32", num_devices=1)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    # every request waits the long queue delay, the first one included (the idle fast path is off)
    config = server_config(tmp_path_factory, model=ONE_LAYER, bucket_sizes=SLOW_BUCKETS,
                           max_queue_delay_ms=QUEUE_DELAY_MS, max_queue_size=4, inline_step_max_ms=0.0)
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=5)


def token(seed=0):
    return np.random.default_rng(seed).standard_normal((1, H)).astype(np.float32)


def raw_forward(port: int, timeout: float = 10.0, channel: grpc.Channel | None = None) -> tuple[grpc.StatusCode, str]:
    """(code, details) of one Forward sent on a plain channel (no health checking, no retries): a
    new one, or ``channel``."""
    if channel is None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return raw_forward(port, timeout, channel)
    try:
        expert_pb2_grpc.ExpertServiceStub(channel).Forward(forward_request(token(), 0, False), timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


class IdleCalls:
    """A ForwardStream that got one answer and stays open, and a health Watch, on one channel."""

    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._items: queue.Queue = queue.Queue()
        self.stream = expert_pb2_grpc.ExpertServiceStub(self.channel).ForwardStream(iter(self._items.get, None))
        self._items.put(stream_request(0, token(), 0, False))
        assert next(self.stream).request_id == "0"
        self.watch = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(self.watch).status == SERVING

    def close(self):
        self._items.put(None)
        self.channel.close()


def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_full_queue_answers_resource_exhausted_at_once(slow_server):
    async def run():
        async with AsyncExpertClient(f"127.0.0.1:{slow_server.port}", retries=0, timeout=30) as c:
            queued = [asyncio.ensure_future(c.forward(token(i), layer=0)) for i in range(4)]
            while slow_server.batcher.pending < 4:
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            with pytest.raises(ResourceExhaustedError) as info:
                await c.forward(token(9), layer=0)
            refused_after = time.perf_counter() - started
            return await asyncio.gather(*queued), refused_after, info.value

    answers, refused_after, error = asyncio.run(run())
    assert len(answers) == 4 and all(a.shape == (1, H) for a in answers)
    assert refused_after < QUEUE_DELAY_MS / 1000 / 2  # not queued: refused while the others wait
    # RetryInfo: when the queued requests will be answered (they wait for the queue delay to pass)
    assert "--max-queue-size 4" in error.message and 0.5 <= error.retry_delay <= QUEUE_DELAY_MS / 1000


def test_client_retries_resource_exhausted_until_served(slow_server):
    target = f"127.0.0.1:{slow_server.port}"

    def fill(i):
        with ExpertClient(target, retries=0) as c:
            c.forward(token(i), layer=0)

    fillers = [threading.Thread(target=fill, args=(i,)) for i in range(4)]
    for t in fillers:
        t.start()
    wait_until(lambda: slow_server.batcher.pending == 4)
    before = sample(scrape(slow_server.metrics_port), "grpc_server_handled_total", grpc_type="unary",
                    grpc_service="expertd.v1.ExpertService", grpc_method="Forward", grpc_code="RESOURCE_EXHAUSTED")
    with ExpertClient(target, retries=4, backoff=Backoff(initial=0.01, maximum=0.01)) as client:
        y = client.forward(token(5), layer=0)  # waits for the server's RetryInfo hint between attempts
    for t in fillers:
        t.join()
    after = sample(scrape(slow_server.metrics_port), "grpc_server_handled_total", grpc_type="unary",
                   grpc_service="expertd.v1.ExpertService", grpc_method="Forward", grpc_code="RESOURCE_EXHAUSTED")
    assert y.shape == (1, H) and after - before >= 1


def test_deadline_passing_in_the_queue_drops_the_request_before_compute(slow_server):
    before = scrape(slow_server.metrics_port)
    with ExpertClient(f"127.0.0.1:{slow_server.port}", retries=0) as client:
        started = time.perf_counter()
        with pytest.raises(DeadlineExceededError):
            client.forward(token(), layer=0, timeout=0.3)
        assert time.perf_counter() - started < QUEUE_DELAY_MS / 1000
    wait_until(lambda: sample(scrape(slow_server.metrics_port), "expertd_dropped_requests_total", reason="deadline")
               == sample(before, "expertd_dropped_requests_total", reason="deadline") + 1)
    after = scrape(slow_server.metrics_port)
    assert sample(after, "expertd_executions_total", layer="0", kind="forward") == \
        sample(before, "expertd_executions_total", layer="0", kind="forward")


def test_a_split_request_past_its_deadline_is_dropped_once_and_ends_deadline_exceeded(slow_server):
    before = scrape(slow_server.metrics_port)
    x = np.random.default_rng(1).standard_normal((21, H)).astype(np.float32)  # 8 + 8 run, 5 wait for company
    with ExpertClient(f"127.0.0.1:{slow_server.port}", retries=0) as client:
        with pytest.raises(DeadlineExceededError):
            client.forward(x, layer=0, timeout=0.6)  # well before the 1 s wait for company, after the 16 rows
    wait_until(lambda: slow_server.batcher.pending == 0)
    after = scrape(slow_server.metrics_port)
    labels = dict(grpc_type="unary", grpc_service="expertd.v1.ExpertService", grpc_method="Forward")

    def delta(name, **extra):
        return sample(after, name, **extra) - sample(before, name, **extra)

    assert delta("expertd_dropped_requests_total", reason="deadline") == 1  # one request, not its 3 parts
    assert delta("expertd_dropped_requests_total", reason="cancelled") == 0
    assert delta("grpc_server_handled_total", **labels, grpc_code="DEADLINE_EXCEEDED") == 1
    assert delta("grpc_server_handled_total", **labels, grpc_code="CANCELLED") == 0
    assert delta("grpc_server_handled_total", **labels, grpc_code="UNKNOWN") == 0


def test_a_full_queue_refuses_before_decoding_the_body(slow_server):
    """Admission reads the header only: with the queue full, a body that would fail validation (NaN)
    is refused with RESOURCE_EXHAUSTED, not scanned; a bad header is still INVALID_ARGUMENT."""
    nan = np.full((1, H), np.nan, np.float32)

    async def run():
        async with AsyncExpertClient(f"127.0.0.1:{slow_server.port}", retries=0, timeout=30) as c:
            queued = [asyncio.ensure_future(c.forward(token(i), layer=0)) for i in range(4)]
            while slow_server.batcher.pending < 4:
                await asyncio.sleep(0.01)
            with pytest.raises(ResourceExhaustedError):
                await c.forward(nan, layer=0)
            with pytest.raises(InvalidArgumentError, match="hidden_states.shape"):
                await c.forward(np.zeros((1, H + 1), np.float32), layer=0)
            await asyncio.gather(*queued)
            with pytest.raises(InvalidArgumentError, match="NaN"):  # with room again, the body is checked
                await c.forward(nan, layer=0)

    asyncio.run(run())


def test_cancelled_request_is_dropped_before_compute(slow_server):
    before = scrape(slow_server.metrics_port)
    with grpc.insecure_channel(f"127.0.0.1:{slow_server.port}") as channel:
        call = expert_pb2_grpc.ExpertServiceStub(channel).Forward.future(forward_request(token(), 0, False))
        wait_until(lambda: slow_server.batcher.pending == 1)
        call.cancel()
    wait_until(lambda: sample(scrape(slow_server.metrics_port), "expertd_dropped_requests_total", reason="cancelled")
               == sample(before, "expertd_dropped_requests_total", reason="cancelled") + 1)
    assert slow_server.batcher.pending == 0
    assert sample(scrape(slow_server.metrics_port), "expertd_executions_total", layer="0", kind="forward") == \
        sample(before, "expertd_executions_total", layer="0", kind="forward")


def test_health_transitions_from_warm_up_through_drain(tmp_path_factory):
    release = threading.Event()
    config = server_config(tmp_path_factory, model=ONE_LAYER, bucket_sizes=SLOW_BUCKETS,
                           max_queue_delay_ms=QUEUE_DELAY_MS, inline_step_max_ms=0.0)  # requests wait
    handle = create_server(config, progress=lambda event: release.wait(60))  # warm-up waits for the test
    client = ExpertClient(f"127.0.0.1:{handle.port}", retries=0, timeout=10)
    try:
        # Warming up: alive, not ready, requests refused with a retryable status.
        assert client.health("liveness") == SERVING
        assert [client.health(s) for s in ("", "readiness", "expertd.v1.ExpertService")] == [NOT_SERVING] * 3
        with pytest.raises(UnavailableError):  # not sent: no replica is SERVING
            client.forward(token(), layer=0)
        code, details = raw_forward(handle.port)
        assert code == grpc.StatusCode.UNAVAILABLE and "warming up" in details
        assert sample(scrape(handle.metrics_port), "expertd_model_ready") == 0
        release.set()
        client.wait_ready(timeout=120)
        assert client.health("readiness") == SERVING
        assert sample(scrape(handle.metrics_port), "expertd_model_ready") == 1
        # Draining: a queued request still gets its answer; health and new requests say no.
        queued = ExpertClient(f"127.0.0.1:{handle.port}", retries=0, timeout=30)
        answer = []
        worker = threading.Thread(target=lambda: answer.append(queued.forward(token(3), layer=0)))
        worker.start()
        wait_until(lambda: handle.batcher.pending == 1)
        handle.request_stop(grace=20)
        wait_until(lambda: client.health("") == NOT_SERVING)
        assert client.health("readiness") == NOT_SERVING
        with pytest.raises(UnavailableError):
            client.forward(token(), layer=0)
        code, details = raw_forward(handle.port)
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
        worker.join()
        assert len(answer) == 1 and answer[0].shape == (1, H)
        assert handle.wait(timeout=30)
        with pytest.raises(UnavailableError):
            client.health("")
    finally:
        release.set()
        client.close()
        handle.stop(grace=0)


def test_drain_ends_idle_streams_and_watches_and_answers_late_calls_unavailable(tmp_path_factory):
    grace = 30.0
    config = server_config(tmp_path_factory, model=ONE_LAYER, bucket_sizes=SLOW_BUCKETS,
                           max_queue_delay_ms=QUEUE_DELAY_MS, inline_step_max_ms=0.0)  # requests wait
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    idle = IdleCalls(handle.port)
    busy_items: queue.Queue = queue.Queue()
    busy = expert_pb2_grpc.ExpertServiceStub(idle.channel).ForwardStream(iter(busy_items.get, None))
    late_channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        busy_items.put(stream_request(7, token(7), 0, False))  # waits in the queue for the bucket to fill
        wait_until(lambda: handle.batcher.pending == 1)
        grpc.channel_ready_future(late_channel).result(timeout=30)  # connected now: late calls are quick
        started = time.monotonic()
        handle.request_stop(grace=grace)
        assert next(idle.watch).status == NOT_SERVING  # the Watch hears it at once ...
        with pytest.raises(grpc.RpcError) as ended:    # ... the idle stream is ended, retryable elsewhere
            next(idle.stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in ended.value.details()
        # Calls that arrive while the drain lingers get UNAVAILABLE from the server, none CANCELLED.
        late = []
        while time.monotonic() - started < 0.6:
            late.append(raw_forward(handle.port, timeout=5, channel=late_channel))
        assert len(late) >= 3 and {code for code, _ in late} == {grpc.StatusCode.UNAVAILABLE}
        assert all("draining" in details for _, details in late)
        # The busy stream's accepted message is answered, then the stream ends the same way.
        answer = next(busy)
        assert answer.request_id == "7" and not answer.HasField("error")
        with pytest.raises(grpc.RpcError) as ended:
            next(busy)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert handle.wait(timeout=10)
        assert time.monotonic() - started < 5, "the open streams and Watch did not hold the process for the grace"
        assert list(idle.watch) == []  # the Watch ended with the server, cleanly
    finally:
        busy_items.put(None)
        idle.close()
        late_channel.close()
        handle.stop(grace=0)


def test_sigterm_drains_accepted_requests_and_exits_zero(tmp_path_factory):
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", "--preset", "tiny", "--num-layers", "1", "--dtype", "float32",
               "--num-devices", "1", "--bucket-sizes", ",".join(map(str, SLOW_BUCKETS)),
               "--max-queue-delay-ms", "1500", "--inline-step-max-ms", "0", "--drain-grace-s", "20",
               "--retain-freed-memory",
               "--compile-cache-dir", str(cache_dir(tmp_path_factory))]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in server.stdout:  # up to serve's last line after "ready:", which a CPU server always prints
            lines.append(line)
            if "host memory:" in line or "error" in line:
                break
        output = "".join(lines)
        assert "ready:" in output, output
        # --retain-freed-memory applied before JAX started (Linux/glibc; elsewhere the line says why not)
        if sys.platform.startswith("linux"):
            assert "host memory: freed buffers kept for reuse" in output, output
        port = int(re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", output).group(1))
        assert re.search(r"gRPC listening on 127\.0\.0\.1:\d+, event loop uvloop \d", output), output  # the default
        metrics_port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", output).group(1))
        assert f"security: TLS off, mTLS off, auth off; metrics: http://127.0.0.1:{metrics_port}/metrics " \
               "(TLS off, auth off)" in output, output
        assert re.search(r"compiled 3/3: \w+ bucket 8 for layers 0", output), output  # progress shown
        n = 6
        answers, errors = [], []

        def call(i):
            try:
                with ExpertClient(f"127.0.0.1:{port}", retries=0, timeout=30) as c:
                    answers.append(c.forward(token(i), layer=0))
            except Exception as exc:  # noqa: BLE001 - collected and checked below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: sample(scrape(metrics_port), "expertd_pending_requests") == n)
        idle = IdleCalls(port)  # an idle stream and Watch do not hold the exit
        sent = time.monotonic()
        server.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert not errors and len(answers) == n  # every accepted request was answered
        rest, _ = server.communicate(timeout=30)
        idle.close()
        assert server.returncode == 0, output + rest
        assert time.monotonic() - sent < 8  # well within --drain-grace-s 20: the queue delay (1.5 s) and a linger
        assert "drained, exiting" in rest
        with pytest.raises(UnavailableError):
            ExpertClient(f"127.0.0.1:{port}", retries=0, timeout=5).forward(token(), layer=0)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
