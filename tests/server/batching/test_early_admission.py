"""Admission before the body (issue 27, item 7): a Forward call that carries the
``expertd-admission`` metadata is admitted or refused from it before its message is read, through
the real server on loopback; ExpertClient sends it with large bodies only."""
import asyncio
import contextlib
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from service_support import one_place_server, poll, queue_full, reference_forward, server_config

from expertd.client import AsyncExpertClient, ExpertClient, admission, errors, messages
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server.app import create_server
from expertd.server.config import SecurityConfig
from expertd.server.frontends.expert_v1 import ADMITTED_MESSAGE_WAIT_S

KEY = admission.ADMISSION_METADATA
TOKEN = "early-admission-token"


def _received(registry, direction="received") -> float:
    labels = {"grpc_type": "unary", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "Forward"}
    return registry.get_sample_value(f"grpc_server_msg_{direction}_total", labels) or 0.0


def _cancel(call, registry):
    """Cancel the call holding the one place; it is dropped from the queue at once."""
    call.cancel()
    poll(lambda: registry.get_sample_value("expertd_pending_requests") == 0)


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    with one_place_server(tmp_path_factory) as server:  # service_support: one queue place, a long gather
        yield server


def test_a_refused_call_with_the_metadata_is_never_read(busy_server):
    handle, registry = busy_server
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    request = messages.forward_request(x, 1, False)
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        waiting = stub.Forward.future(messages.forward_request(x[:2], 1, False), timeout=60)
        poll(lambda: registry.get_sample_value("expertd_pending_requests") == 1)
        before, sent = _received(registry), _received(registry, "sent")
        with pytest.raises(grpc.RpcError) as early:
            stub.Forward(request, metadata=((KEY, "1,8"),), timeout=30)
        assert _received(registry) == before  # refused from the metadata: the message was not read
        with pytest.raises(grpc.RpcError) as late:
            stub.Forward(request, timeout=30)
        assert _received(registry) == before + 1  # the same call without it: read, then refused
        assert _received(registry, "sent") == sent  # a refusal sends a status, no response message
        _cancel(waiting, registry)
    for refused in (early.value, late.value):
        error = errors.from_rpc_error(refused)
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue-size 1" in str(error)
        assert error.retry_delay is not None and error.retry_delay > 0
    assert registry.get_sample_value("expertd_rejected_requests_total", {"reason": "queue_size"}) == 2


def test_an_admitted_call_with_the_metadata_answers_as_without_it(busy_server):
    handle, _ = busy_server
    from expertd.server.models.presets import load_preset

    (layer,) = load_preset("tiny", layers="1", dtype="float32")
    params = {name: np.asarray(layer.params[name]) for name in layer.params}
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    want = reference_forward(params, layer.cfg, x, np.float32)[0]
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        request = messages.forward_request(x, 1, True)
        early = messages.forward_result(stub.Forward(request, metadata=((KEY, "1,8"),), timeout=60), None)
        plain = messages.forward_result(stub.Forward(request, timeout=60), None)
    np.testing.assert_allclose(early.output, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(early.output, plain.output)
    np.testing.assert_array_equal(early.routing.topk_ids, plain.routing.topk_ids)


@pytest.mark.parametrize("value, code, message", [
    ("1,7", "INVALID_ARGUMENT", "declares layer 1 with 7 tokens; the message has layer 1 with 8"),
    ("0,8", "INVALID_ARGUMENT", "declares layer 0 with 8 tokens; the message has layer 1 with 8"),
    ("1;8", "INVALID_ARGUMENT", "must be '<layer>,<tokens>' (two decimal integers), got '1;8'"),
    ("1,-8", "INVALID_ARGUMENT", "must be '<layer>,<tokens>'"),
    ("1," + "9" * 40, "INVALID_ARGUMENT", "must be '<layer>,<tokens>'"),
    ("1,0", "INVALID_ARGUMENT", "tokens must be in [1, "),
    ("1,100000000", "INVALID_ARGUMENT", "tokens must be in [1, "),
    ("9,8", "NOT_FOUND", "layer 9 is not served"),
])
def test_bad_or_disagreeing_metadata_names_the_key_and_the_server_keeps_serving(busy_server, value, code, message):
    handle, registry = busy_server
    x = np.ones((8, 64), np.float32)
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Forward(messages.forward_request(x, 1, False), metadata=((KEY, value),), timeout=30)
        assert failed.value.code().name == code and message in failed.value.details()
        if code == "INVALID_ARGUMENT" and "tokens;" not in message:
            assert f"metadata {KEY!r}" in failed.value.details()
        assert stub.Forward(messages.forward_request(x, 1, False), timeout=60).output.shape[:] == [8, 64]
    assert registry.get_sample_value("expertd_pending_requests") == 0  # a failed call's ticket was released


def test_a_declared_request_whose_body_never_comes_gives_its_place_back(busy_server):
    handle, registry = busy_server
    release = threading.Event()

    def withheld():  # the call is open, its metadata sent; its message never is
        release.wait(60)
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        declare = channel.stream_unary("/expertd.v1.ExpertService/Forward",
                                       request_serializer=lambda m: m.SerializeToString())
        started = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as dropped:
                declare(withheld(), metadata=((KEY, "1,8"),), timeout=60)
        finally:
            release.set()
    assert dropped.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"did not arrive within {ADMITTED_MESSAGE_WAIT_S:g} s" in dropped.value.details()
    assert time.monotonic() - started < 30
    assert registry.get_sample_value("expertd_pending_requests") == 0


def test_the_token_is_checked_before_the_metadata(tmp_path_factory):
    handle = create_server(server_config(tmp_path_factory, security=SecurityConfig(auth_token=TOKEN)),
                           registry=CollectorRegistry())
    handle.wait_ready(timeout=300)
    try:
        x = np.ones((4, 64), np.float32)
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            with pytest.raises(grpc.RpcError) as denied:
                stub.Forward(messages.forward_request(x, 1, False), metadata=((KEY, "1,4"),), timeout=30)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = stub.Forward(messages.forward_request(x, 1, False), timeout=30,
                                  metadata=((KEY, "1,4"), ("authorization", f"Bearer {TOKEN}")))
            assert answer.output.shape[:] == [4, 64]
    finally:
        handle.stop(grace=5)


def test_the_client_sends_the_metadata_with_large_bodies_only(busy_server):
    big_rows = admission.ADMISSION_MIN_BYTES // (64 * 4)
    big = messages.forward_request(np.zeros((big_rows, 64), np.float32), 1, False)
    assert admission.admission_metadata(big) == ((KEY, f"1,{big_rows}"),)
    small = messages.forward_request(np.zeros((big_rows - 1, 64), np.float32), 1, False)
    assert admission.admission_metadata(small) == ()
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    with ExpertClient(target, timeout=60, retries=0) as client, grpc.insecure_channel(target) as channel:
        waiting = expert_pb2_grpc.ExpertServiceStub(channel).Forward.future(
            messages.forward_request(np.ones((2, 64), np.float32), 1, False), timeout=60)
        poll(lambda: registry.get_sample_value("expertd_pending_requests") == 1)
        before = _received(registry)
        for rows in (big_rows, big_rows - 1):  # refused, the first from its metadata
            with pytest.raises(errors.ExpertError) as refused:
                client.forward(np.zeros((rows, 64), np.float32), layer=1)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _received(registry) == before + 1  # only the small one's body was read

        async def async_big():  # AsyncExpertClient sends it alike
            async with AsyncExpertClient(target, timeout=60, retries=0) as aclient:
                with pytest.raises(errors.ExpertError) as refused:
                    await aclient.forward(np.zeros((big_rows, 64), np.float32), layer=1)
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

        asyncio.run(async_big())
        assert _received(registry) == before + 1
        _cancel(waiting, registry)
        assert client.forward(np.ones((big_rows, 64), np.float32), layer=1).shape == (big_rows, 64)


def _counting_forward(channel, sent: list):
    """Forward as a stream-unary call whose serializer records each message it sends."""
    def serialize(message):
        sent.append(message.layer)
        return message.SerializeToString()

    return channel.stream_unary("/expertd.v1.ExpertService/Forward", request_serializer=serialize,
                                response_deserializer=expert_pb2.ForwardResponse.FromString)


def test_a_held_body_is_sent_only_once_admitted_and_never_when_refused(busy_server):
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    request = messages.forward_request(x, 1, False)
    declared = ((KEY, "1,8"),)
    sent: list = []
    with grpc.insecure_channel(target) as channel:
        held = _counting_forward(channel, sent)
        admitted = admission.call_after_admission_blocking(held, request, timeout=60, metadata=declared)
        assert sent == [1]
        plain = expert_pb2_grpc.ExpertServiceStub(channel).Forward(request, timeout=60)
        np.testing.assert_array_equal(messages.forward_result(admitted, None).output,
                                      messages.forward_result(plain, None).output)
        waiting = expert_pb2_grpc.ExpertServiceStub(channel).Forward.future(
            messages.forward_request(x[:2], 1, False), timeout=60)
        poll(lambda: registry.get_sample_value("expertd_pending_requests") == 1)
        before = _received(registry)
        with pytest.raises(grpc.RpcError) as refused:
            admission.call_after_admission_blocking(held, request, timeout=30, metadata=declared)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert errors.from_rpc_error(refused.value).retry_delay > 0

        async def async_refused():
            async with grpc.aio.insecure_channel(target) as achannel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await admission.call_after_admission(_counting_forward(achannel, sent), request,
                                                         timeout=30, metadata=declared)
                return failed.value.code()

        assert asyncio.run(async_refused()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sent == [1] and _received(registry) == before  # neither refused body left the client
        _cancel(waiting, registry)

    async def async_admitted():
        async with grpc.aio.insecure_channel(target) as achannel:
            return await admission.call_after_admission(_counting_forward(achannel, sent), request,
                                                        timeout=60, metadata=declared)

    np.testing.assert_array_equal(messages.forward_result(asyncio.run(async_admitted()), None).output,
                                  messages.forward_result(admitted, None).output)
    assert sent == [1, 1]


@pytest.mark.parametrize("value", ["100-continue", "", "admission " * 10])
def test_an_unknown_expectation_names_the_key(busy_server, value):
    handle, _ = busy_server
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        with pytest.raises(grpc.RpcError) as failed:
            expert_pb2_grpc.ExpertServiceStub(channel).Forward(
                messages.forward_request(np.ones((8, 64), np.float32), 1, False), timeout=30,
                metadata=((KEY, "1,8"), (admission.EXPECT_METADATA[0], value)))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"metadata {admission.EXPECT_METADATA[0]!r}" in failed.value.details()
    assert "must be 'admission'" in failed.value.details()


def test_pushback_holds_for_its_window_after_each_refusal():
    now = [100.0]
    pushback = admission.Pushback(hold_s=1.0, clock=lambda: now[0])
    assert not pushback.active()
    pushback.refused()
    now[0] += 0.9
    assert pushback.active()
    pushback.refused()  # a later refusal extends the window
    now[0] += 0.9
    assert pushback.active()
    now[0] += 0.2
    assert not pushback.active()


def _big_and_small(seed):
    rows = admission.ADMISSION_MIN_BYTES // (64 * 4)
    x = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    return x, messages.forward_request(x, 1, False), messages.forward_request(x[:4], 1, False)


def test_expert_client_holds_large_bodies_while_the_server_pushes_back(busy_server, monkeypatch):
    """After a refusal, large Forwards go with the expectation (the body held until admitted) and
    answer as the plain call does; small ones stay plain unary calls."""
    monkeypatch.setattr(admission, "PUSHBACK_HOLD_S", 120.0)  # the window outlasts a slow machine
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x, big, small = _big_and_small(3)
    with ExpertClient(target, timeout=60, retries=0) as client:
        want = client.forward(x, layer=1)
        assert client._forward_call(big) == (client._stub.Forward, admission.admission_metadata(big))
        with queue_full(target, registry), pytest.raises(errors.ResourceExhaustedError):
            client.forward(x, layer=1)
        assert client._forward_call(big)[0] is client._forward_held
        assert client._forward_call(small) == (client._stub.Forward, ())
        np.testing.assert_array_equal(client.forward(x, layer=1), want)
        with queue_full(target, registry), pytest.raises(errors.ResourceExhaustedError) as refused:
            client.forward(x, layer=1)  # held and refused: raised as the unary call's refusal is
        assert refused.value.retry_delay > 0


def test_async_client_holds_large_bodies_while_the_server_pushes_back(busy_server, monkeypatch):
    monkeypatch.setattr(admission, "PUSHBACK_HOLD_S", 120.0)
    handle, registry = busy_server
    target = f"127.0.0.1:{handle.port}"
    x, big, small = _big_and_small(4)

    async def run():
        async with AsyncExpertClient(target, timeout=60, retries=0) as client:
            want = await client.forward(x, layer=1)
            assert client._forward_call(big)[0] is client._stub.Forward
            with queue_full(target, registry), pytest.raises(errors.ResourceExhaustedError):
                await client.forward(x, layer=1)
            assert client._forward_call(big)[0] is client._forward_held
            assert client._forward_call(small) == (client._stub.Forward, ())
            np.testing.assert_array_equal(await client.forward(x, layer=1), want)
            with queue_full(target, registry), pytest.raises(errors.ResourceExhaustedError):
                await client.forward(x, layer=1)

    asyncio.run(run())


@contextlib.contextmanager
def _server_before_the_expectation():
    """A stand-in for a server from before ``expertd-expect``: Forward's early handler reads the
    message and answers it, its initial metadata sent only with the response."""
    from concurrent import futures

    def forward(request_iterator, context):
        message = next(request_iterator)
        return expert_pb2.ForwardResponse(request_id=message.request_id)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("expertd.v1.ExpertService", {
        "Forward": grpc.stream_unary_rpc_method_handler(
            forward, request_deserializer=expert_pb2.ForwardRequest.FromString,
            response_serializer=expert_pb2.ForwardResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_a_held_body_is_sent_without_a_verdict_from_a_server_that_gives_none():
    request = messages.forward_request(np.ones((8, 64), np.float32), 1, False, request_id="old-server")
    declared = ((KEY, "1,8"),)
    with _server_before_the_expectation() as target:
        with grpc.insecure_channel(target) as channel:
            held = _counting_forward(channel, [])
            answer = admission.call_after_admission_blocking(held, request, timeout=30, metadata=declared)
        assert answer.request_id == "old-server"  # not DEADLINE_EXCEEDED after 30 s

        async def run():
            async with grpc.aio.insecure_channel(target) as achannel:
                return await admission.call_after_admission(_counting_forward(achannel, []), request,
                                                            timeout=30, metadata=declared)

        assert asyncio.run(run()).request_id == "old-server"


def test_an_undecodable_body_after_the_metadata_is_refused_as_without_it(busy_server, caplog):
    """Issue 53, item 6: the same INVALID_ARGUMENT and message on both paths, no traceback logged."""
    handle, registry = busy_server
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        forward = channel.unary_unary("/expertd.v1.ExpertService/Forward")  # raw bytes in, raw bytes out
        answers = []
        for metadata in ((), ((KEY, "1,2"),)):
            with pytest.raises(grpc.RpcError) as refused:
                forward(b"\xff\xff\xff not a protobuf", metadata=metadata, timeout=30)
            answers.append((refused.value.code(), refused.value.details()))
    assert answers[0] == answers[1] == (grpc.StatusCode.INVALID_ARGUMENT,
                                        "request is not a valid expertd.v1.ForwardRequest message")
    assert not [r for r in caplog.records if r.exc_info or "internal error" in r.getMessage()]
    poll(lambda: registry.get_sample_value("expertd_pending_requests") == 0)  # its place given back


def test_declarations_whose_bodies_are_withheld_cost_other_callers_nothing(busy_server):
    """Issue 53, item 5: eight calls declaring the largest request and never sending it hold no place
    (the server has one): a plain call is admitted and answered beside them."""
    handle, registry = busy_server
    release = threading.Event()
    x = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)  # a full step: no gather

    def withheld():
        release.wait(60)
        return
        yield

    labels = {"grpc_type": "unary", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "Forward"}
    started = registry.get_sample_value("grpc_server_started_total", labels) or 0.0
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        declare = channel.stream_unary("/expertd.v1.ExpertService/Forward",
                                       request_serializer=lambda m: m.SerializeToString())
        pending = [declare.future(withheld(), metadata=((KEY, f"1,{handle.model.max_request_tokens}"),), timeout=60)
                   for _ in range(8)]
        try:
            poll(lambda: registry.get_sample_value("grpc_server_started_total", labels) >= started + 8)
            answer = expert_pb2_grpc.ExpertServiceStub(channel).Forward(messages.forward_request(x, 1, False),
                                                                        timeout=30)
            np.testing.assert_array_equal(messages.forward_result(answer, None).output,
                                          reference_forward_output(handle, x))
        finally:
            release.set()
        for call in pending:
            with pytest.raises(grpc.RpcError):
                call.result(timeout=60)
    assert registry.get_sample_value("expertd_pending_requests") == 0


def reference_forward_output(handle, x):
    with ExpertClient(f"127.0.0.1:{handle.port}", timeout=30, retries=0) as client:
        return client.forward(x, layer=1)
