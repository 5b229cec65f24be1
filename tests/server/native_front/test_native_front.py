"""The native Forward port (``--native-port``) of the real server, called with the real client and raw stubs.

It must answer what the main port answers (every float dtype, token ids, calls merged into one
batch each getting its own rows), refuse bad calls naming the field while the server keeps
serving, bound what is queued on it (RESOURCE_EXHAUSTED at once), not compute calls whose caller
has gone, count its calls in the metrics, carry the main port's token and TLS, and drain: calls
queued when the drain begins are answered, later ones are UNAVAILABLE.

The port needs the system's gRPC C++ to build (``native_front_fixtures.require_native_front``:
skipped with the reason where it cannot be built, a failure under EXPERTD_REQUIRE_NATIVE_FRONT=1).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http2_bodies import send_declared
from native_front_fixtures import require_native_front
from service_support import Gate, poll, sample, scrape, server_config, server_with_runner
from tls_fixtures import make_pki

from expertd.client import ExpertClient, TlsOptions, codec, errors
from expertd.client.errors import (
    DeadlineExceededError,
    ExpertError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server import errors as errors_log
from expertd.server import native_front
from expertd.server.app import create_server
from expertd.server.batching.admission import MIN_RETRY_S
from expertd.server.config import ModelConfig, SecurityConfig
from expertd.server.engine import api
from expertd.server.metrics.families import LATENCY_BUCKETS
from expertd.server.models.presets import load_preset
from expertd.server.native_front import front

H = 64  # the tiny preset's hidden size
MAX_REQUEST_TOKENS = 16
MAX_QUEUE_TOKENS = 64
TOKEN = "native-s3cret"
CLIENT_LOG = "expertd.server.client_errors"
ONE_LAYER = ModelConfig(preset="tiny", num_layers=1, dtype="float32", num_devices=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """fp32 tiny, two layers, buckets 1 / 8, the native port on; steps go through a Gate, so they
    run on the device thread (never inline on the event loop, where a held step would stop every call)."""
    require_native_front()
    with server_with_runner(tmp_path_factory, Gate, native_port=0, max_queue_delay_ms=0.0, inline_step_max_ms=0.0,
                            model=ModelConfig(preset="tiny", num_layers=2, dtype="float32", num_devices=1),
                            max_request_tokens=MAX_REQUEST_TOKENS, max_queue_tokens=MAX_QUEUE_TOKENS) as handle:
        handle.gate = handle.runner
        yield handle


def native(server, **options) -> ExpertClient:
    return ExpertClient(f"127.0.0.1:{server.native_port}", retries=0, **options)


def main(server) -> ExpertClient:
    return ExpertClient(f"127.0.0.1:{server.port}", retries=0)


def rows(tokens: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, H)).astype(dtype)


def raw(server, request: expert_pb2.ForwardRequest, timeout: float = 30) -> expert_pb2.ForwardResponse:
    with grpc.insecure_channel(f"127.0.0.1:{server.native_port}") as channel:
        return expert_pb2_grpc.ExpertServiceStub(channel).Forward(request, timeout=timeout)


def native_handled(server, code: str) -> float:
    return sample(scrape(server.metrics_port), "expertd_native_forward_handled_total", grpc_code=code)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["fp32", "bf16", "fp16"])
def test_forward_answers_what_the_main_port_answers(server, dtype):
    with main(server) as reference, native(server) as client:
        for layer, tokens in ((0, 1), (1, 5), (0, 8), (1, MAX_REQUEST_TOKENS)):  # 16 rows: split over two steps
            x = rows(tokens, tokens, dtype)
            got = client.forward(x, layer=layer)
            assert got.dtype == np.dtype(dtype) and got.shape == (tokens, H)
            np.testing.assert_array_equal(got, reference.forward(x, layer=layer))


def test_token_ids_and_request_ids_travel(server):
    x = rows(3, 7)
    ids = np.array([5, 0, 9], np.int32)
    request = expert_pb2.ForwardRequest(layer=1, hidden_states=codec.encode(x), token_ids=codec.encode(ids),
                                        request_id="r-42")
    answer = raw(server, request)
    assert answer.request_id == "r-42"
    with main(server) as reference:
        np.testing.assert_array_equal(codec.decode(answer.output), reference.forward(x, layer=1))


def test_concurrent_callers_each_get_their_own_rows(server):
    inputs = [rows(1 + i % 3, 100 + i) for i in range(48)]
    with main(server) as reference:
        expected = [reference.forward(x, layer=i % 2) for i, x in enumerate(inputs)]
    with native(server) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(lambda i: client.forward(inputs[i], layer=i % 2), range(len(inputs))))
    for got, want in zip(outputs, expected, strict=True):  # merged: other buckets, last-bit differences
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_calls_arriving_together_at_an_idle_port_get_steps_of_their_own(tmp_path_factory):
    """One client's micro-batches arrive together; sharing a step would tie their answers together
    and undo the pipeline's overlap (benchmarks/disaggregated.py). As on the main port, an idle
    port starts the first call at once and the other joins the next step."""
    require_native_front()
    with server_with_runner(tmp_path_factory, Gate, native_port=0, model=ONE_LAYER, max_queue_delay_ms=0.0) as handle, \
            native(handle) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        def steps() -> float:
            return sample(scrape(handle.metrics_port), "expertd_executions_total", layer="0", kind="forward")

        def call(seed: int, together: threading.Barrier) -> np.ndarray:
            together.wait()
            return client.forward(rows(4, seed), layer=0)

        before = steps()
        for pair in range(20):
            together = threading.Barrier(2)
            assert all(out.shape == (4, H) for out in pool.map(call, (2 * pair, 2 * pair + 1), (together, together)))
        poll(lambda: steps() - before >= 40, 30)  # a step is recorded after its answers are sent
        assert steps() - before == 40


def test_calls_that_queued_behind_a_batch_leave_together_even_once_it_is_answered():
    """The port's take policy (C++; driven here through the module as front.py drives it): a call
    reaching an idle port goes alone; calls that queued while a batch was in flight leave as one
    batch even when it was answered before they are taken (64 closed-loop callers otherwise got a
    one-call step before nearly every full one); calls arriving after that, at an idle port, go
    alone again."""
    require_native_front()
    module = native_front.load()
    handle, port, _ = module.start("127.0.0.1:0", {0: H}, {expert_pb2.DTYPE_FLOAT32: 4}, MAX_REQUEST_TOKENS, 256,
                                   1024, 64, 1 << 22, expert_pb2.GetModelInfoResponse().SerializeToString(), None, None,
                                   LATENCY_BUCKETS, "warming up", "unauthenticated", "undecodable")
    module.set_accepting(handle, True, "")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = expert_pb2_grpc.ExpertServiceStub(channel)
    calls, taken = [], {}  # the calls sent; the batches taken and not answered yet (id -> calls)

    def send(n: int) -> None:
        queued = module.stats(handle)["queued_calls"]
        calls.extend(stub.Forward.future(expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(rows(1, i))),
                                         timeout=30) for i in range(n))
        poll(lambda: module.stats(handle)["queued_calls"] == queued + n)

    def take() -> tuple[int, int]:
        batch = module.take(handle)
        taken[batch[0]] = len(batch[1])  # its calls (their bodies): one row each
        return batch[0], taken[batch[0]]

    def finish(batch: int) -> None:
        module.finish(handle, batch, np.zeros((taken.pop(batch), H), np.float32))

    try:
        send(1)
        first, n = take()
        assert n == 1
        send(3)  # while the first is in flight
        finish(first)  # nothing in flight now, three calls queued behind it
        behind, n = take()
        assert n == 3, "the calls that queued behind a batch leave together"
        finish(behind)
        send(2)  # arriving at an idle port
        alone, n = take()
        assert n == 1, "an idle port starts the first call alone"
        second, n = take()
        assert n == 1 and module.take(handle) is None
        finish(alone)
        finish(second)
        assert all(list(call.result().output.shape) == [1, H] for call in calls)
    finally:
        for batch in list(taken):  # a failed check must not leave the port waiting for answers
            finish(batch)
        channel.close()
        module.stop(handle, 0.0)


def _tensor(dtype: int, shape: list[int], nbytes: int | None = None) -> expert_pb2.Tensor:
    itemsize = 4 if dtype in (expert_pb2.DTYPE_FLOAT32, expert_pb2.DTYPE_INT32) else 2
    return expert_pb2.Tensor(dtype=dtype, shape=shape, data=b"\0" * (int(np.prod(shape)) * itemsize
                                                                      if nbytes is None else nbytes))


FP32 = expert_pb2.DTYPE_FLOAT32
NAN = np.full((2, H), 0.5, np.float32)
NAN[1, 3] = np.nan
INF16 = np.full((1, H), 0.5, ml_dtypes.bfloat16)
INF16[0, 0] = np.inf


@pytest.mark.parametrize(("request_fields", "code", "names"), [
    ({"layer": 9, "hidden_states": _tensor(FP32, [1, H])}, grpc.StatusCode.NOT_FOUND,
     r"layer 9 is not served; layers: \[0, 1\]"),
    ({"hidden_states": _tensor(expert_pb2.DTYPE_INT32, [1, H])}, grpc.StatusCode.INVALID_ARGUMENT,
     "hidden_states.dtype"),
    ({"hidden_states": _tensor(FP32, [1, H - 1])}, grpc.StatusCode.INVALID_ARGUMENT,
     r"hidden_states.shape: expected \[T, H=64\], got \[1, 63\]"),
    ({"hidden_states": _tensor(FP32, [H])}, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shape"),
    ({"hidden_states": _tensor(FP32, [0, H])}, grpc.StatusCode.INVALID_ARGUMENT, "1 <= T <= 16"),
    ({"hidden_states": _tensor(FP32, [MAX_REQUEST_TOKENS + 1, H])}, grpc.StatusCode.INVALID_ARGUMENT, "1 <= T <= 16"),
    ({"hidden_states": _tensor(FP32, [2, H], nbytes=7)}, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.data"),
    ({"hidden_states": codec.encode(NAN)}, grpc.StatusCode.INVALID_ARGUMENT, r"NaN or Inf \(first at token 1\)"),
    ({"hidden_states": codec.encode(INF16)}, grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
    ({"hidden_states": _tensor(FP32, [2, H]), "token_ids": _tensor(expert_pb2.DTYPE_INT32, [3])},
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids.shape"),
    ({"hidden_states": _tensor(FP32, [1, H]), "token_ids": codec.encode(np.array([-4], np.int32))},
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids: expected ids >= 0"),
    ({"hidden_states": _tensor(FP32, [1, H]), "token_ids": _tensor(FP32, [1])}, grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids.dtype"),
    ({"hidden_states": _tensor(FP32, [1, H]), "return_routing": True}, grpc.StatusCode.INVALID_ARGUMENT,
     r"return_routing: .*main port"),
    ({"hidden_states": expert_pb2.Tensor(dtype=FP32, shape=[1, H], shared_memory=expert_pb2.SharedMemoryRef(
        region="r", byte_size=4 * H))}, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shared_memory"),
    ({"hidden_states": _tensor(FP32, [1, H]), "output_shared_memory": expert_pb2.SharedMemoryRef(region="r")},
     grpc.StatusCode.INVALID_ARGUMENT, "output_shared_memory"),
])
def test_bad_calls_are_refused_naming_the_field_and_the_server_keeps_serving(server, request_fields, code, names):
    with pytest.raises(grpc.RpcError) as refused:
        raw(server, expert_pb2.ForwardRequest(**request_fields))
    assert refused.value.code() == code
    assert re.search(names, refused.value.details())
    # As on the main port: the field and what was expected also travel as a BadRequest violation.
    violations = errors.from_rpc_error(refused.value).field_violations
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert [f"{field}: {description}" for field, description in violations] == [refused.value.details()]
    else:
        assert violations == []
    x = rows(2, 0)
    with native(server) as client, main(server) as reference:
        np.testing.assert_array_equal(client.forward(x, layer=0), reference.forward(x, layer=0))


def test_bodies_that_are_not_a_forward_request_are_refused_as_on_the_main_port(server):
    """Random bytes: a body that does not parse gets the main port's INVALID_ARGUMENT (not gRPC C++'s
    UNIMPLEMENTED); one that happens to parse is checked like any request. Every body gets the main
    port's code, and the port keeps serving."""
    rng = np.random.default_rng(0)
    unparsable = 0
    with grpc.insecure_channel(f"127.0.0.1:{server.native_port}") as native_channel, \
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as main_channel:
        method = "/expertd.v1.ExpertService/Forward"  # raw bytes both ways
        native_forward, main_forward = native_channel.unary_unary(method), main_channel.unary_unary(method)
        for _ in range(50):
            body = rng.integers(0, 256, rng.integers(1, 300), dtype=np.uint8).tobytes()
            with pytest.raises(grpc.RpcError) as refused:
                native_forward(body, timeout=10)
            with pytest.raises(grpc.RpcError) as reference:
                main_forward(body, timeout=10)
            assert refused.value.code() == reference.value.code(), refused.value.details()
            try:
                expert_pb2.ForwardRequest.FromString(body)
            except DecodeError:
                unparsable += 1
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == "request is not a valid expertd.v1.ForwardRequest message"
    assert unparsable >= 10  # the seed's bodies exercise the parser's refusal, not only the checks
    x = rows(2, 0)
    with native(server) as client, main(server) as reference:
        np.testing.assert_array_equal(client.forward(x, layer=0), reference.forward(x, layer=0))


def test_other_methods_point_to_the_main_port_and_model_info_and_health_are_served(server):
    with native(server) as client, main(server) as reference:
        assert client.model_info() == reference.model_info()
        with pytest.raises(ExpertError) as unimplemented:
            client.route(rows(1, 0), layer=0)
        assert unimplemented.value.code == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(f"127.0.0.1:{server.native_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "expertd.v1.ExpertService", "readiness", "liveness"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_model_info_carries_the_placements_the_rebalancer_swaps_in(tmp_path_factory):
    """On an expert-parallel server GetModelInfo carries each layer's expert placement, which the
    rebalancer replaces under skewed load: the native port answers what the main port answers, at
    start and after a swap."""
    require_native_front()
    model = ModelConfig(preset="tiny", layers="1", dtype="float32", num_devices=4, num_redundant_experts=4,
                        eplb_interval_s=0.2)
    config = dataclasses.replace(server_config(tmp_path_factory, model=model, expert_load_window_s=5.0),
                                 native_port=0)
    (layer,) = load_preset("tiny", layers="1", dtype="float32")
    column = np.asarray(layer.params["router_weight"])[:, 5]  # tokens along it go to expert 5 and its group
    skewed = (0.3 * rows(8, 0) + 3.0 * column / np.linalg.norm(column)).astype(np.float32)
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        with native(handle) as client, main(handle) as reference:
            def placements(info):
                return [(entry.index, entry.placement) for entry in info.layers]

            answers = []

            def agreeing() -> bool:  # two main-port reads with no swap between them, the native one between
                before, answer, after = reference.model_info(), client.model_info(), reference.model_info()
                answers.append(answer)
                return before == answer == after

            assert agreeing()
            start = answers[-1]
            assert [(p.num_ranks, p.num_redundant_experts, p.version) for _, p in placements(start)] == [(4, 4, 0)]
            for _ in range(200):
                client.forward(skewed, layer=1)
                if reference.model_info().layers[0].placement.version > 0:
                    break
            assert reference.model_info().layers[0].placement.version > 0, "no placement swapped in"
            poll(agreeing)
            assert answers[-1].layers[0].placement.version > 0
            assert placements(answers[-1]) != placements(start)
    finally:
        handle.stop(grace=2)


def test_metrics_count_the_ports_calls_and_its_batches_reach_the_batcher(server):
    text = scrape(server.metrics_port)
    ok, invalid = sample(text, "expertd_native_forward_handled_total", grpc_code="OK"), \
        sample(text, "expertd_native_forward_handled_total", grpc_code="INVALID_ARGUMENT")
    steps = sample(text, "expertd_executions_total", layer="0", kind="forward")
    seconds = sample(text, "expertd_native_forward_handling_seconds_count")
    with native(server) as client:
        for seed in range(3):
            client.forward(rows(2, seed), layer=0)
        with pytest.raises(InvalidArgumentError):
            client.forward(NAN, layer=0)
    poll(lambda: sample(scrape(server.metrics_port), "expertd_executions_total", layer="0", kind="forward")
         >= steps + 3, 30)  # a step is recorded after its answer is sent
    text = scrape(server.metrics_port)
    assert sample(text, "expertd_native_forward_handled_total", grpc_code="OK") == ok + 3
    assert sample(text, "expertd_native_forward_handled_total", grpc_code="INVALID_ARGUMENT") == invalid + 1
    assert sample(text, "expertd_native_forward_handling_seconds_count") == seconds + 4
    assert sample(text, "expertd_executions_total", layer="0", kind="forward") == steps + 3
    assert sample(text, "expertd_native_forward_queued_tokens") == 0


def test_a_forward_on_either_port_counts_in_the_same_grpc_server_series(server):
    forward = {"grpc_type": "unary", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "Forward"}

    def counts():
        text = scrape(server.metrics_port)
        return (sample(text, "grpc_server_handled_total", grpc_code="OK", **forward) or 0,
                sample(text, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **forward) or 0,
                sample(text, "grpc_server_started_total", **forward) or 0,
                sample(text, "grpc_server_handling_seconds_count", **forward) or 0)

    ok, invalid, started, timed = counts()
    with native(server) as client:
        for seed in range(3):
            client.forward(rows(2, seed), layer=0)
        with pytest.raises(InvalidArgumentError):
            client.forward(NAN, layer=0)
    with main(server) as client:
        client.forward(rows(2, 7), layer=0)
    assert counts() == (ok + 4, invalid + 1, started + 5, timed + 5)


def _held(server):
    """Hold the device thread with one call's step in it; (release, the held call's future, pool)."""
    gate = server.gate
    gate.hold, gate.entered = threading.Event(), threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(16)
    client = native(server, timeout=60)
    first = pool.submit(client.forward, rows(8, 1), layer=0)
    assert gate.entered.wait(30)
    return gate.hold, first, pool, client


def test_refused_calls_are_logged_as_on_the_main_port(server, caplog, monkeypatch):
    """One rate-limited client-error line per status code: the latest refusal's message and how many
    calls it stands for, never a traceback."""
    monkeypatch.setattr(errors_log, "client_errors", errors_log.RateLimitedLog(logging.getLogger(CLIENT_LOG)))
    caplog.set_level(logging.INFO, logger=CLIENT_LOG)
    with native(server) as client:
        for _ in range(3):
            with pytest.raises(ExpertError):
                client.forward(rows(1, 0), layer=7)

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == CLIENT_LOG and "layer 7" in r.getMessage()]

    poll(logged, timeout=30)
    (line,) = logged()
    assert re.fullmatch(r"NOT_FOUND: /expertd\.v1\.ExpertService/Forward on the native port: layer 7 is not "
                        r"served; layers: \[0, 1\] \(and \d+ more NOT_FOUND calls\)", line), line
    assert int(re.search(r"and (\d+) more", line).group(1)) >= 2
    assert not any(r.exc_info for r in caplog.records)


def test_an_answer_of_the_wrong_size_fails_its_call_internal_and_the_port_keeps_serving(server, caplog):
    """A server bug (a step's output one column too wide) reaches the caller as INTERNAL, is logged
    with its traceback, and the next call is answered."""
    caplog.set_level(logging.ERROR, logger=front.__name__)
    server.gate.widen = True
    try:
        with native(server) as client, pytest.raises(ExpertError) as failed:
            client.forward(rows(2, 0), layer=0)
    finally:
        server.gate.widen = False
    assert failed.value.code == grpc.StatusCode.INTERNAL and "output size" in failed.value.message

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == front.__name__ and "could not be answered" in r.getMessage()]

    poll(logged, timeout=30)
    (record,) = logged()
    assert record.exc_info is not None and "expected 512 bytes ([2, 64] of 4-byte items), got 520" in \
        str(record.exc_info[1])
    with main(server) as reference, native(server) as client:
        np.testing.assert_array_equal(client.forward(rows(2, 0), layer=0), reference.forward(rows(2, 0), layer=0))


def test_a_full_native_queue_answers_resource_exhausted_at_once(server):
    release, first, pool, client = _held(server)
    try:
        # One more call goes to the batcher behind the held step; the next wait on the port itself.
        waiting = [pool.submit(client.forward, rows(8, 2 + i), layer=0) for i in range(1 + MAX_QUEUE_TOKENS // 8)]
        poll(lambda: sample(scrape(server.metrics_port), "expertd_native_forward_queued_tokens") == MAX_QUEUE_TOKENS)
        with pytest.raises(ResourceExhaustedError, match="tokens queued on the native port") as refused:
            client.forward(rows(8, 99), layer=0)  # answered while the step is still held: never a hang
        assert not first.done()
        assert refused.value.retry_delay >= MIN_RETRY_S  # RetryInfo, as on the main port
    finally:
        release.set()
    assert first.result(60).shape == (8, H)
    for future in waiting:
        assert future.result(60).shape == (8, H)
    client.close()
    pool.shutdown()


def test_the_calls_queued_on_the_port_are_bounded_too(tmp_path_factory):
    """--max-queue-size bounds the calls waiting on the port, however few tokens each carries."""
    require_native_front()
    with server_with_runner(tmp_path_factory, Gate, native_port=0, model=ONE_LAYER, max_queue_delay_ms=0.0,
                            inline_step_max_ms=0.0, max_queue_size=3) as handle:
        handle.gate = handle.runner
        release, first, pool, client = _held(handle)
        try:
            behind = pool.submit(client.forward, rows(1, 1), layer=0)  # to the batcher, behind the held step
            poll(lambda: handle.batcher.pending == 2)
            waiting = [pool.submit(client.forward, rows(1, 2 + i), layer=0) for i in range(3)]
            poll(lambda: sample(scrape(handle.metrics_port), "expertd_native_forward_queued_tokens") == 3)
            with pytest.raises(ResourceExhaustedError, match="3 calls queued on the native port") as refused:
                client.forward(rows(1, 9), layer=0)
            # RetryInfo: a queued call's tokens (1) at the batcher's seconds per token, at least the
            # main port's minimum (no step has ended since the port took the rates at warm-up's end).
            batcher = handle.batcher
            rate = batcher.admission.seconds_per_token(batcher.step_key(handle.model.layers[0], api.FORWARD))
            assert refused.value.retry_delay == pytest.approx(max(rate, MIN_RETRY_S), abs=1e-6)
        finally:
            release.set()
        for future in (first, behind, *waiting):
            assert future.result(60).shape[1] == H
        client.close()
        pool.shutdown()


def test_a_call_whose_caller_has_gone_is_not_computed(server):
    release, first, pool, client = _held(server)
    cancelled = native_handled(server, "CANCELLED")
    try:
        behind = pool.submit(client.forward, rows(1, 3), layer=0)  # in the batcher, behind the held step
        poll(lambda: server.batcher.pending == 2)
        with native(server, timeout=0.3) as impatient:
            with pytest.raises(DeadlineExceededError):
                impatient.forward(rows(1, 4), layer=1)  # waits on the port; its deadline passes there
    finally:
        release.set()
    assert first.result(60).shape == (8, H) and behind.result(60).shape == (1, H)
    poll(lambda: native_handled(server, "CANCELLED") == cancelled + 1)
    assert server.batcher.pending == 0
    client.close()
    pool.shutdown()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("mutual", [False, True], ids=["tls-token", "mtls"])
def test_the_main_ports_token_and_tls_guard_the_native_port(tmp_path_factory, pki, mutual):
    require_native_front()
    security = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), auth_token=TOKEN,
                              tls_client_ca=str(pki.ca) if mutual else None)
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER, security=security), native_port=0)
    handle = create_server(config)
    target = f"127.0.0.1:{handle.native_port}"
    tls = TlsOptions(root_certificates=pki.ca, server_name="localhost",
                     **({"client_certificate": pki.client_cert, "client_key": pki.client_key} if mutual else {}))
    x = rows(2, 0)
    try:
        handle.wait_ready(timeout=300)
        assert "native Forward port" in handle.listening_summary()
        with ExpertClient(target, tls=tls, token=TOKEN, retries=0) as client:
            assert client.forward(x, layer=0).shape == (2, H)
        for token in (None, "wrong-token"):
            with ExpertClient(target, tls=tls, token=token, retries=0) as client:
                with pytest.raises(UnauthenticatedError, match="bearer token"):
                    client.forward(x, layer=0)
        # The token is checked before the body is parsed: a caller without it learns nothing of its bytes.
        keys = (pki.client_key.read_bytes(), pki.client_cert.read_bytes()) if mutual else ()
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(pki.ca.read_bytes(), *keys)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/expertd.v1.ExpertService/Forward")(b"\xff\xff not a request", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ExpertClient(target, token=TOKEN, retries=0, timeout=5) as plaintext:
            with pytest.raises(UnavailableError):
                plaintext.forward(x, layer=0)
        if mutual:
            anonymous = TlsOptions(root_certificates=pki.ca, server_name="localhost")
            with ExpertClient(target, tls=anonymous, token=TOKEN, retries=0, timeout=5) as client:
                with pytest.raises(UnavailableError):
                    client.forward(x, layer=0)
    finally:
        handle.stop(grace=2)


def test_drain_answers_what_was_queued_and_refuses_what_comes_after(tmp_path_factory):
    require_native_front()
    with server_with_runner(tmp_path_factory, Gate, native_port=0, model=ONE_LAYER, max_queue_delay_ms=0.0,
                            inline_step_max_ms=0.0) as handle, concurrent.futures.ThreadPoolExecutor(8) as pool:
        handle.gate = handle.runner
        release, first, _, client = _held(handle)
        behind = pool.submit(client.forward, rows(1, 0), layer=0)  # the second batch in flight, behind the held step
        poll(lambda: handle.batcher.pending == 2)
        queued = [behind] + [pool.submit(client.forward, rows(1, i), layer=0) for i in range(1, 5)]
        # every call is in: the later four wait on the port itself when the drain begins
        poll(lambda: sample(scrape(handle.metrics_port), "expertd_native_forward_queued_tokens") == 4)
        handle.request_stop(grace=30)
        with grpc.insecure_channel(f"127.0.0.1:{handle.native_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            poll(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status ==
                 health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as refused:
            raw(handle, expert_pb2.ForwardRequest(hidden_states=codec.encode(rows(1, 9))), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        release.set()
        assert first.result(60).shape == (8, H)
        for future in queued:
            assert future.result(60).shape == (1, H)
        assert handle.wait(60)
        client.close()


def test_a_call_whose_body_is_still_arriving_when_the_port_stops_gets_unavailable(tmp_path_factory):
    """The drain's last step closes the native port: a call whose body is half sent then is answered
    UNAVAILABLE (retryable elsewhere) by the port itself, not left for gRPC to cancel at the close."""
    require_native_front()
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER), native_port=0)
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    declared = 16 * H * 4  # a body the port never gets all of
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        half = pool.submit(send_declared, handle.native_port, "/expertd.v1.ExpertService/Forward", declared,
                           send_at_most=declared // 2, timeout_s=60)
        time.sleep(0.5)  # the half body is in
        handle.stop(grace=1)
        outcome = half.result(60)
    assert outcome.code == grpc.StatusCode.UNAVAILABLE.value[0], outcome
    assert outcome.message == "the server is shutting down"


def test_a_native_port_that_cannot_be_built_fails_start_up_naming_the_flag(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-path")))
    config = dataclasses.replace(server_config(tmp_path_factory), native_port=0,
                                 native_cpu=dataclasses.replace(server_config(tmp_path_factory).native_cpu,
                                                                cache_dir=str(tmp_path_factory.mktemp("no-cache"))))
    with pytest.raises(ValueError, match=r"--native-port: .*not found \(Debian / Ubuntu: apt-get install libgrpc\+\+"):
        create_server(config)


@pytest.mark.parametrize(("ports", "message"), [
    ({"port": 9000, "native_port": 9000}, "--port and --native-port must differ"),
    ({"metrics_port": 9001, "native_port": 9001}, "--metrics-port and --native-port must differ"),
    ({"native_port": 70000}, "--native-port must be between 0 and 65535"),
])
def test_native_port_flag_is_checked(tmp_path_factory, ports, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(server_config(tmp_path_factory), **ports)
