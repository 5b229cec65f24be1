"""The native port's direct path (``--native-direct``, on by default): a lone call that finds the
server idle is computed on the gRPC thread it arrived on, without the event loop, and the calls
that queue behind it on the port's runner thread.

It must answer exactly what the main port answers and record its step as every step is recorded;
fall back to the event loop whenever anything else is admitted or running (no deadlock, every call
its own rows, whatever the order); refuse an overflowing result naming the field; be answered, not
lost, when the drain begins while it computes; and stay off with ``--no-native-direct``.
Steps are seen through a pass-through around the real engine's ``forward`` that notes the thread
each step runs on: the event loop is ``expertd-grpc``, the device thread ``expertd-device_0``,
anything else a thread C++ started (gRPC's, or the runner thread).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import ml_dtypes
import numpy as np
import pytest
from native_front_fixtures import require_native_front
from service_support import poll, sample, scrape, server_config

from expertd.client import ExpertClient
from expertd.client.errors import InvalidArgumentError
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

H = 64  # the tiny preset's hidden size
TOPK = 2  # the tiny preset's top-k
PYTHON_THREADS = ("expertd-grpc", "expertd-device")


class StepThreads:
    """Notes the thread of every engine step (and signals ``entered``), then runs it unchanged."""

    def __init__(self, engine):
        self.names: list[str] = []
        self.entered = threading.Event()
        self.hold: threading.Event | None = None  # set: the next step to enter waits for it first
        forward = engine.forward

        def noting(*args, **options):
            self.names.append(threading.current_thread().name)
            self.entered.set()
            hold, self.hold = self.hold, None
            if hold is not None:
                hold.wait(60)
            return forward(*args, **options)

        engine.forward = noting

    def since(self, start: int) -> list[str]:
        return ["grpc" if not name.startswith(PYTHON_THREADS) else name.split("_")[0] for name in self.names[start:]]


def start(tmp_path_factory, batching: dict | None = None, **options):
    """A started server, tiny fp32 with one layer, the native port on (``options``: ServerConfig
    fields; ``batching``: BatchingConfig fields)."""
    require_native_front()
    config = server_config(tmp_path_factory, model=ModelConfig(preset="tiny", num_layers=1, dtype="float32",
                                                               num_devices=1), **(batching or {}))
    handle = create_server(dataclasses.replace(config, native_port=0, **options))
    handle.wait_ready(timeout=300)
    handle.steps = StepThreads(handle.engine)
    return handle


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start(tmp_path_factory)
    yield handle
    handle.stop(grace=5)


def direct_calls(server, outcome: str) -> float:
    """``expertd_native_forward_direct_total{outcome}``, read from the registry (the event loop, which
    serves /metrics, may be held by a test)."""
    return server.registry.get_sample_value("expertd_native_forward_direct_total", {"outcome": outcome})


def counted(server, outcome: str, want: float) -> None:
    """Wait until ``direct_calls(server, outcome)`` reaches ``want``: a batch is counted after its
    answers are sent (the runner thread sends them before ``_direct`` returns), so a client can
    see its answer first."""
    poll(lambda: direct_calls(server, outcome) >= want, 30)
    assert direct_calls(server, outcome) == want


def pending(server) -> float:
    return server.registry.get_sample_value("expertd_pending_requests")


def batches_in_flight(server) -> int:
    """Batches the native port has handed out and not answered (its own counter)."""
    return server._parts.native.stats()["batches_in_flight"]


def queued_calls(server) -> int:
    """Calls queued on the native port (its own counter)."""
    return server._parts.native.stats()["queued_calls"]


def rows(tokens: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, H)).astype(dtype)


def client(server, port: str = "native", **options) -> ExpertClient:
    return ExpertClient(f"127.0.0.1:{server.native_port if port == 'native' else server.port}", retries=0, **options)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_a_lone_call_at_an_idle_server_is_computed_on_its_grpc_thread(server, dtype):
    inputs = [rows(tokens, tokens, dtype) for tokens in (1, 3, 8)]  # up to the largest bucket
    with client(server, "main") as main:
        expected = [main.forward(x, layer=0) for x in inputs]
    text = scrape(server.metrics_port)
    executions = sample(text, "expertd_executions_total", layer="0", kind="forward")
    routed = sum(sample(text, "expertd_routed_tokens_total", layer="0", expert=str(e)) for e in range(8))
    computed = direct_calls(server, "computed")
    first = len(server.steps.names)
    with client(server) as native:
        for x, want in zip(inputs, expected, strict=True):
            got = native.forward(x, layer=0)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, want)  # the same bucket, the same compiled step
    assert server.steps.since(first) == ["grpc"] * len(inputs)
    counted(server, "computed", computed + len(inputs))  # then the scrape sees every step recorded
    text = scrape(server.metrics_port)
    assert sample(text, "expertd_executions_total", layer="0", kind="forward") == executions + len(inputs)
    routed_now = sum(sample(text, "expertd_routed_tokens_total", layer="0", expert=str(e)) for e in range(8))
    assert routed_now == routed + TOPK * sum(len(x) for x in inputs)
    assert sample(text, "expertd_native_forward_direct_total", outcome="computed") == computed + len(inputs)


def test_a_call_larger_than_one_step_goes_through_the_event_loop(server):
    x = rows(12, 2)  # two steps of the largest bucket, 8
    with client(server, "main") as main:
        want = main.forward(x, layer=0)
    first, handed_over = len(server.steps.names), direct_calls(server, "handed_over")
    with client(server) as native:
        np.testing.assert_array_equal(native.forward(x, layer=0), want)
    assert server.steps.since(first) == ["expertd-device"] * 2
    counted(server, "handed_over", handed_over + 1)


def test_a_result_that_overflows_is_refused_naming_the_field_and_the_next_call_is_served(server):
    first, computed = len(server.steps.names), direct_calls(server, "computed")
    with client(server) as native:
        with pytest.raises(InvalidArgumentError, match="hidden_states: the layer's result is not finite at token 0"):
            native.forward(np.full((2, H), 3e38, np.float32), layer=0)
        assert np.isfinite(native.forward(rows(2, 1), layer=0)).all()
    assert server.steps.since(first) == ["grpc", "grpc"]
    counted(server, "computed", computed + 2)


def test_calls_meeting_a_busy_server_wait_their_turn_and_each_gets_its_rows(server):
    """The engine's lock held as a long step would hold it. A native call first takes the direct path
    and waits in its step; meanwhile a main-port call goes through the event loop and a second native
    call queues on the port behind the first. Released, every call gets its own rows (the queued one
    on the event loop or, should the main-port call be answered first, direct); then a lone call is
    direct again."""
    inputs = [rows(1 + i, 40 + i) for i in range(3)]
    with client(server, "main") as main:
        expected = [main.forward(x, layer=0) for x in inputs]
    steps = server.steps
    with client(server, timeout=60) as native, client(server, "main", timeout=60) as main, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = len(steps.names)
        with server.engine.lock:
            steps.entered.clear()
            direct = pool.submit(native.forward, inputs[0], layer=0)
            assert steps.entered.wait(30)
            behind = [pool.submit(main.forward, inputs[1], layer=0), pool.submit(native.forward, inputs[2], layer=0)]
            poll(lambda: len(steps.names) >= first + 2 and queued_calls(server) == 1, 30)
        outputs = [direct.result(60)] + [future.result(60) for future in behind]
        for got, want in zip(outputs, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # merged steps: other buckets
        names = steps.since(first)
        assert names[0] == "grpc" and names[1] == "expertd-device", names
        poll(lambda: batches_in_flight(server) == 0 and pending(server) == 0)  # idle again
        again = len(steps.names)
        np.testing.assert_array_equal(native.forward(inputs[0], layer=0), expected[0])
        assert steps.since(again) == ["grpc"]


def test_calls_queued_behind_a_direct_step_are_the_next_direct_step(server):
    """While a direct step runs, native calls queue on the port without waking the event loop; when
    it ends, the port's runner thread takes them (they queued behind a batch, so they merge) as the
    next direct step, and each call gets its own rows."""
    inputs = [rows(tokens, 60 + tokens) for tokens in (2, 1, 2, 3)]  # the queued 6 fit one step (8)
    with client(server, "main") as main:
        expected = [main.forward(x, layer=0) for x in inputs]
    steps, computed = server.steps, direct_calls(server, "computed")
    with client(server, timeout=60) as native, concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = len(steps.names)
        with server.engine.lock:
            steps.entered.clear()
            direct = pool.submit(native.forward, inputs[0], layer=0)
            assert steps.entered.wait(30)
            behind = [pool.submit(native.forward, x, layer=0) for x in inputs[1:]]
            poll(lambda: queued_calls(server) == 3, 30)
            assert batches_in_flight(server) == 1 and pending(server) == 0  # the loop has seen none of them
        outputs = [direct.result(60)] + [future.result(60) for future in behind]
    for got, want in zip(outputs, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # merged: another bucket
    assert steps.since(first) == ["grpc", "grpc"]
    counted(server, "computed", computed + 2)


def test_a_direct_answer_is_sent_before_the_step_queued_behind_it_runs(server):
    """The lone call's answer leaves when its step ends, not after the next one: the runner thread,
    not the call's gRPC thread (whose answer gRPC sends only once it returns), runs what queued."""
    inputs = [rows(2, 70), rows(3, 71)]
    with client(server, "main") as main:
        expected = [main.forward(x, layer=0) for x in inputs]
    steps, release = server.steps, threading.Event()
    with client(server, timeout=60) as native, concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            with server.engine.lock:
                steps.entered.clear()
                first = pool.submit(native.forward, inputs[0], layer=0)
                assert steps.entered.wait(30)
                second = pool.submit(native.forward, inputs[1], layer=0)
                poll(lambda: queued_calls(server) == 1, 30)
                steps.hold = release  # the queued call's step will wait
            np.testing.assert_array_equal(first.result(30), expected[0])
            assert not second.done()
        finally:
            release.set()
        np.testing.assert_allclose(second.result(60), expected[1], rtol=1e-6, atol=1e-6)


def test_a_call_at_a_busy_server_goes_through_the_event_loop(server):
    """The main port's call holds the engine first: the native call finds it admitted and is handed
    to the event loop, not computed on its gRPC thread."""
    x, y = rows(2, 7), rows(1, 8)
    with client(server, "main") as main:
        want_x, want_y = main.forward(x, layer=0), main.forward(y, layer=0)
    steps = server.steps
    with client(server, timeout=60) as native, client(server, "main", timeout=60) as main, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, handed_over = len(steps.names), direct_calls(server, "handed_over")
        with server.engine.lock:
            steps.entered.clear()
            held = pool.submit(main.forward, x, layer=0)
            assert steps.entered.wait(30)
            waiting = pool.submit(native.forward, y, layer=0)
            counted(server, "handed_over", handed_over + 1)
        np.testing.assert_array_equal(held.result(60), want_x)
        np.testing.assert_allclose(waiting.result(60), want_y, rtol=1e-6, atol=1e-6)
    assert "grpc" not in steps.since(first)


def test_a_direct_call_computing_when_the_drain_begins_and_the_calls_queued_behind_it_are_answered(
        tmp_path_factory):
    handle = start(tmp_path_factory)
    stopped = threading.Thread(target=handle.stop, kwargs={"grace": 30})
    inputs = [rows(4, 3), rows(1, 4), rows(2, 5)]
    with client(handle, "main") as main:
        expected = [main.forward(x, layer=0) for x in inputs]
    with client(handle, timeout=60) as native, concurrent.futures.ThreadPoolExecutor(3) as pool:
        with handle.engine.lock:
            handle.steps.entered.clear()
            direct = pool.submit(native.forward, inputs[0], layer=0)
            assert handle.steps.entered.wait(30)
            behind = [pool.submit(native.forward, x, layer=0) for x in inputs[1:]]
            poll(lambda: queued_calls(handle) == 2, 30)
            stopped.start()
            poll(lambda: handle.registry.get_sample_value("expertd_model_ready") == 0, 30)  # the drain began
        np.testing.assert_array_equal(direct.result(60), expected[0])
        for call, want in zip(behind, expected[1:], strict=True):
            np.testing.assert_allclose(call.result(60), want, rtol=1e-6, atol=1e-6)  # merged: another bucket
    stopped.join(60)
    assert not stopped.is_alive()


def test_no_native_direct_sends_every_call_through_the_event_loop(tmp_path_factory):
    handle = start(tmp_path_factory, native_direct=False)
    try:
        x = rows(3, 5)
        first = len(handle.steps.names)
        with client(handle, "main") as main, client(handle) as native:
            np.testing.assert_array_equal(native.forward(x, layer=0), main.forward(x, layer=0))
        assert "grpc" not in handle.steps.since(first)
    finally:
        handle.stop(grace=5)


def test_the_event_loops_step_limit_does_not_bound_the_direct_path(tmp_path_factory):
    """--inline-step-max-ms 0 keeps every step off the event loop; a direct step holds a gRPC
    thread, not the loop, so lone native calls still run there."""
    handle = start(tmp_path_factory, batching={"inline_step_max_ms": 0.0})
    try:
        x = rows(3, 6)
        with client(handle, "main") as main, client(handle) as native:
            want = main.forward(x, layer=0)
            first = len(handle.steps.names)
            np.testing.assert_array_equal(native.forward(x, layer=0), want)
        assert handle.steps.since(first) == ["grpc"]
    finally:
        handle.stop(grace=5)
