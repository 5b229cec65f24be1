"""The native port's request rules are the main port's, written once: C++ parses and answers, and
each call's content is decided by Python's one request path (``frontends.decode``, ``errors.status_of``).

The same bad request on either port gets the same answer: code, message and the packed
google.rpc.Status (its BadRequest field violation) byte for byte. A bad call merged into a batch
with good calls is answered alone, the good calls with their own rows, through the event loop and
through the direct runner alike. The refusals C++ still makes carry the messages Python gave it,
and its sources hold no request rule's text.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
import re
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
from native_front_fixtures import require_native_front
from service_support import Gate, poll, server_config, server_with_runner

from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server import native_front
from expertd.server.app import create_server
from expertd.server.config import ModelConfig
from expertd.server.metrics.families import LATENCY_BUCKETS

H = 64  # the tiny preset's hidden size
MAX_REQUEST_TOKENS = 16
FP32, BF16, FP16, INT32 = (expert_pb2.DTYPE_FLOAT32, expert_pb2.DTYPE_BFLOAT16, expert_pb2.DTYPE_FLOAT16,
                           expert_pb2.DTYPE_INT32)
DETAILS_KEY = "grpc-status-details-bin"
CSRC = pathlib.Path(native_front.__file__).with_name("csrc")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """fp32 tiny, two layers, buckets 1 / 8, the native port on, steps through a Gate (on the
    device thread; the direct runner is off with a step runner of the test's own)."""
    require_native_front()
    with server_with_runner(tmp_path_factory, Gate, native_port=0, max_queue_delay_ms=0.0, inline_step_max_ms=0.0,
                            model=ModelConfig(preset="tiny", num_layers=2, dtype="float32", num_devices=1),
                            max_request_tokens=MAX_REQUEST_TOKENS) as handle:
        yield handle


def rows(tokens: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, H)).astype(dtype)


def tensor(dtype: int, shape: list[int], nbytes: int | None = None) -> expert_pb2.Tensor:
    itemsize = 4 if dtype in (FP32, INT32) else 2
    return expert_pb2.Tensor(dtype=dtype, shape=shape, data=b"\0" * (int(np.prod(shape)) * itemsize
                                                                     if nbytes is None else nbytes))


def non_finite(dtype, value: float, at: tuple[int, int], tokens: int = 3) -> expert_pb2.Tensor:
    x = np.full((tokens, H), 0.5, dtype)
    x[at] = value
    return codec.encode(x)


def answer(target: str, request: expert_pb2.ForwardRequest) -> tuple:
    """(code, message, packed google.rpc.Status) of ``request`` at ``target``, or its output."""
    with grpc.insecure_channel(target) as channel:
        try:
            return codec.decode(expert_pb2_grpc.ExpertServiceStub(channel).Forward(request, timeout=30).output)
        except grpc.RpcError as refused:
            return refused.code(), refused.details(), dict(refused.trailing_metadata() or ()).get(DETAILS_KEY)


def ports(server) -> tuple[str, str]:
    return f"127.0.0.1:{server.port}", f"127.0.0.1:{server.native_port}"


BAD = {
    "layer not served": {"layer": 9, "hidden_states": tensor(FP32, [1, H])},
    "no hidden_states": {"layer": 0},
    "dtype int32": {"hidden_states": tensor(INT32, [1, H])},
    "dtype unknown": {"hidden_states": tensor(77, [1, H], nbytes=4 * H)},
    "rank 1": {"hidden_states": tensor(FP32, [H])},
    "many dimensions": {"hidden_states": tensor(FP32, [1] * 40 + [H])},
    "width": {"hidden_states": tensor(FP32, [2, H + 1])},
    "no tokens": {"hidden_states": tensor(FP32, [0, H])},
    "negative tokens": {"hidden_states": tensor(FP32, [-3, H], nbytes=0)},
    "over the token limit": {"hidden_states": tensor(FP32, [MAX_REQUEST_TOKENS + 1, H])},
    "byte length": {"hidden_states": tensor(FP32, [2, H], nbytes=8 * H - 1)},
    "NaN fp32": {"hidden_states": non_finite(np.float32, np.nan, (2, 5))},
    "Inf bf16": {"hidden_states": non_finite(ml_dtypes.bfloat16, np.inf, (1, 0))},
    "-Inf fp16": {"hidden_states": non_finite(np.float16, -np.inf, (0, H - 1))},
    "token_ids dtype": {"hidden_states": tensor(FP32, [1, H]), "token_ids": tensor(FP32, [1])},
    "token_ids shape": {"hidden_states": tensor(FP32, [2, H]), "token_ids": tensor(INT32, [3])},
    "token_ids rank": {"hidden_states": tensor(FP32, [2, H]), "token_ids": tensor(INT32, [2, 1])},
    "token_ids bytes": {"hidden_states": tensor(FP32, [2, H]), "token_ids": tensor(INT32, [2], nbytes=5)},
    "token_ids negative": {"hidden_states": tensor(FP32, [3, H]),
                           "token_ids": codec.encode(np.array([4, -2, 7], np.int32))},
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_request_gets_the_main_ports_answer_byte_for_byte(server, kind):
    request = expert_pb2.ForwardRequest(**BAD[kind])
    main, native = (answer(target, request) for target in ports(server))
    assert isinstance(main, tuple), f"the main port served {kind}"
    assert main[0] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert native == main


def test_a_bad_call_merged_with_good_ones_fails_alone(server, monkeypatch):
    """Calls queued behind a held step leave as one batch: the bad ones (bytes and shape that would
    not have concatenated, a NaN) are answered alone with the main port's answers, the good ones with
    their own rows, computed as one request of their rows only."""
    good = {i: rows(1 + i % 2, 30 + i) for i in (0, 2, 4, 5)}
    bad = {1: {"hidden_states": non_finite(np.float32, np.nan, (0, 5), tokens=1)}, 3: BAD["byte length"],
           6: BAD["width"]}  # with the good ones 8 rows: one batch (the largest bucket)
    requests = {i: expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x)) for i, x in good.items()}
    requests |= {i: expert_pb2.ForwardRequest(layer=0, **fields) for i, fields in bad.items()}
    main_target, native_target = ports(server)
    expected = {i: answer(main_target, requests[i]) for i in sorted(requests)}
    batches = []
    forward = server.batcher.forward

    def noting(request, *args, **options):
        batches.append(len(request.tokens))
        return forward(request, *args, **options)

    monkeypatch.setattr(server.batcher, "forward", noting)
    gate = server.runner
    gate.hold, gate.entered = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(requests) + 2) as pool:
        try:
            held = pool.submit(answer, native_target, requests[0])
            assert gate.entered.wait(30)
            behind = pool.submit(answer, native_target, requests[2])  # the second batch in flight
            poll(lambda: server.batcher.pending == 2)
            queued = {i: pool.submit(answer, native_target, requests[i]) for i in (1, 3, 4, 5, 6)}
            poll(lambda: server._parts.native.stats()["queued_calls"] == len(queued))
        finally:
            gate.hold.set()
        got = {0: held.result(60), 2: behind.result(60)} | {i: call.result(60) for i, call in queued.items()}
    for i in bad:
        assert got[i] == expected[i]
    for i in good:
        np.testing.assert_allclose(got[i], expected[i], rtol=1e-6, atol=1e-6)  # merged: another bucket
    assert batches == [len(good[0]), len(good[2]), len(good[4]) + len(good[5])]


@pytest.fixture(scope="module")
def direct_server(tmp_path_factory):
    """fp32 tiny, one layer, the native port with its direct runner (the default), no Gate."""
    require_native_front()
    config = server_config(tmp_path_factory, model=ModelConfig(preset="tiny", num_layers=1, dtype="float32",
                                                               num_devices=1))
    handle = create_server(dataclasses.replace(config, native_port=0))
    try:
        handle.wait_ready(timeout=300)
        yield handle
    finally:
        handle.stop(grace=5)


def _behind_a_direct_step(handle, target: str, requests: dict) -> dict:
    """Every answer of ``requests`` sent to the native port, the first alone in a direct step held
    by the engine's lock, the others queued behind it (the runner's next batch)."""
    first, *rest = sorted(requests)
    native = handle._parts.native
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        with handle.engine.lock:  # the first call's direct step waits for it
            lone = pool.submit(answer, target, requests[first])
            poll(lambda: native.stats()["batches_in_flight"] == 1)
            queued = {i: pool.submit(answer, target, requests[i]) for i in rest}
            poll(lambda: native.stats()["queued_calls"] == len(queued))
        return {first: lone.result(60)} | {i: call.result(60) for i, call in queued.items()}


def test_a_bad_call_merged_into_a_direct_step_fails_alone(direct_server, monkeypatch):
    """The same through the direct runner: calls queued behind a direct step are its next batch."""
    handle = direct_server
    good = {0: rows(2, 1), 2: rows(1, 2), 4: rows(3, 3)}
    bad = {1: BAD["Inf bf16"], 3: BAD["token_ids negative"]}  # the latter: a batch of its own (token ids)
    bad[5] = {"hidden_states": non_finite(np.float32, np.inf, (0, 1), tokens=1)}
    requests = {i: expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x)) for i, x in good.items()}
    requests |= {i: expert_pb2.ForwardRequest(layer=0, **fields) for i, fields in bad.items()}
    main_target, native_target = ports(handle)
    expected = {i: answer(main_target, requests[i]) for i in sorted(requests)}
    computed = []
    forward_now = handle.batcher.direct.forward_now

    def noting(request, respond):
        computed.append(len(request.tokens))
        return forward_now(request, respond)

    monkeypatch.setattr(handle.batcher.direct, "forward_now", noting)
    got = _behind_a_direct_step(handle, native_target, requests)
    for i in bad:
        assert got[i] == expected[i]
    for i in good:
        np.testing.assert_allclose(got[i], expected[i], rtol=1e-6, atol=1e-6)
    assert computed[0] == len(good[0]) and len(good[2]) + len(good[4]) in computed[1:]


def test_the_transports_own_refusals_carry_the_messages_python_gave():
    """The token and parse refusals are C++'s to make, their text Python's (given at start)."""
    require_native_front()
    module = native_front.load()
    handle, port, _ = module.start("127.0.0.1:0", {0: H}, {FP32: 4}, MAX_REQUEST_TOKENS, 8, 64, 8, 1 << 20,
                                   expert_pb2.GetModelInfoResponse().SerializeToString(), b"s3cret", None,
                                   LATENCY_BUCKETS, "warming up", "no token, no answer", "not a request")
    module.set_accepting(handle, True, "")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            forward = channel.unary_unary("/expertd.v1.ExpertService/Forward")
            for metadata, message in ((None, "no token, no answer"), ((("authorization", "Bearer s3cret"),),
                                                                       "not a request")):
                with pytest.raises(grpc.RpcError) as refused:
                    forward(b"\xff\xff not a request", metadata=metadata, timeout=10)
                assert refused.value.details() == message
    finally:
        module.stop(handle, 0.0)


RULE_TEXT = re.compile(r"\bNaN\b|\bInf\b|not served|token.ids|hidden_states|return_routing|shared.memory|\bdtype\b|"
                       r"\bshape\b|request-tokens|main port|is not a valid|missing or invalid|Bearer <")
"""Words of the main port's request rules and auth message (``frontends.decode``, ``transport``)."""


def test_the_cpp_sources_hold_no_request_rule_text():
    """No string literal in csrc/ words a rule about a request's content, or the token and parse
    refusals: those messages are Python's (``frontends.decode``, ``errors``, ``transport``)."""
    literals = {path.name: re.findall(r'"((?:[^"\\\n]|\\.)*)"', re.sub(r"//[^\n]*", "", path.read_text()))
                for path in sorted(CSRC.glob("*.[ch]*"))}
    assert sum(map(len, literals.values())) > 20, "the sources' literals read"
    wrong = [(name, text) for name, texts in literals.items() for text in texts if RULE_TEXT.search(text)]
    assert not wrong, wrong


def _overflowing(tokens: int = 2) -> np.ndarray:
    """Finite fp32 hidden states whose layer result is not: 3e38 overflows the layer's arithmetic."""
    return np.full((tokens, 64), 3e38, np.float32)


def test_a_call_that_overflows_the_layer_fails_alone_in_a_merged_batch(server):
    """Issue 53, item 1: one call whose finite input overflows the layer, merged with good calls
    behind a held step: it gets the main port's answer for itself alone (its own row numbers), the
    good calls their rows."""
    good = {i: rows(1 + i % 2, 50 + i) for i in (0, 2, 4, 5)}
    requests = {i: expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x)) for i, x in good.items()}
    requests[3] = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(_overflowing()))
    main_target, native_target = ports(server)
    expected = {i: answer(main_target, requests[i]) for i in sorted(requests)}
    assert expected[3][0] == grpc.StatusCode.INVALID_ARGUMENT and "token 0" in expected[3][1]
    gate = server.runner
    gate.hold, gate.entered = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(requests) + 2) as pool:
        try:
            held = pool.submit(answer, native_target, requests[0])
            assert gate.entered.wait(30)
            behind = pool.submit(answer, native_target, requests[2])
            poll(lambda: server.batcher.pending == 2)
            queued = {i: pool.submit(answer, native_target, requests[i]) for i in (3, 4, 5)}
            poll(lambda: server._parts.native.stats()["queued_calls"] == len(queued))
        finally:
            gate.hold.set()
        got = {0: held.result(60), 2: behind.result(60)} | {i: call.result(60) for i, call in queued.items()}
    assert got[3] == expected[3]
    for i in good:
        np.testing.assert_allclose(got[i], expected[i], rtol=1e-6, atol=1e-6)


def test_a_call_that_overflows_the_layer_fails_alone_on_the_direct_runner(direct_server):
    good = {0: rows(2, 11), 1: rows(1, 12), 3: rows(3, 13)}
    requests = {i: expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x)) for i, x in good.items()}
    requests[2] = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(_overflowing(1)))
    main_target, native_target = ports(direct_server)
    expected = {i: answer(main_target, requests[i]) for i in sorted(requests)}
    got = _behind_a_direct_step(direct_server, native_target, requests)
    assert got[2] == expected[2] and got[2][0] == grpc.StatusCode.INVALID_ARGUMENT
    for i in good:
        np.testing.assert_allclose(got[i], expected[i], rtol=1e-6, atol=1e-6)
