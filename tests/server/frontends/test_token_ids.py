"""Token ids on the wire: ``token_ids [T]`` int32 on Forward, Route, ForwardStream and KServe ModelInfer
reach the engine with their rows, and bad ones are INVALID_ARGUMENT naming ``token_ids``.

A real server on loopback whose step runner records what the engine is handed (``create_server``'s
``step_runner``: the real engine behind it), driven by the real clients (blocking, asyncio,
streams, tritonclient) and, for what the clients refuse to send, by raw stubs.
"""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from service_support import server_with_runner
from tritonclient.utils import InferenceServerException

from expertd.client import AsyncExpertClient, ExpertClient, codec
from expertd.client.kserve_protos import service_grpc, service_pb2
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

H = 64


class Recording:
    """The step runner: the real engine, recording each step's token_ids argument with its row counts."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []

    def forward(self, layer, tokens, num_valid, token_ids=None):
        self.steps.append(("forward", num_valid, len(tokens), token_ids))
        return self.engine.forward(layer, tokens, num_valid, token_ids=token_ids)

    def route(self, layer, tokens, num_valid, **options):
        self.steps.append(("route", num_valid, len(tokens), options.get("token_ids")))
        return self.engine.route(layer, tokens, num_valid, **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_with_runner(tmp_path_factory, Recording, max_queue_delay_ms=0.0) as handle:  # fp32 tiny, buckets 1, 8
        handle.recording = handle.runner
        yield handle


@pytest.fixture
def client(server):
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


@pytest.fixture
def recorded(server):
    server.recording.steps.clear()
    return server.recording.steps


def tokens(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)


def assert_step_ids(step, kind, ids):
    """``step`` ran ``ids`` in its first rows, zeros in its padding rows."""
    step_kind, valid, bucket, seen = step
    assert step_kind == kind and valid == len(ids)
    assert seen is not None and seen.dtype == np.int32 and seen.shape == (bucket,)
    np.testing.assert_array_equal(seen[:valid], ids)
    assert (seen[valid:] == 0).all()


def test_forward_and_route_pass_token_ids_to_the_engine(client, recorded):
    x, ids = tokens(3), [5, 0, 2**31 - 1]
    plain = client.forward(x, layer=0)
    with_ids = client.forward(x, layer=0, token_ids=ids)
    np.testing.assert_array_equal(plain, with_ids)  # the tiny model's layers are not hash-routed: ids ignored
    client.route(x, layer=1, token_ids=np.array(ids, np.int64))
    assert recorded[0][3] is None  # no ids sent: the engine gets None
    assert_step_ids(recorded[1], "forward", ids)
    assert_step_ids(recorded[2], "route", ids)


def test_streams_and_the_async_client_send_token_ids(server, client, recorded):
    x = tokens(2, seed=1)
    results = list(client.forward_stream([("a", x, [7, 8]), ("b", x)], layer=0))
    assert [r.error for r in results] == [None, None]

    async def main():
        async with AsyncExpertClient(f"127.0.0.1:{server.port}", timeout=60) as aio:
            await aio.forward(x, layer=0, token_ids=[9, 10])
            await aio.route(logits=np.zeros((2, 8), np.float32), layer=0, token_ids=[11, 12])
            async for result in aio.forward_stream([("c", x, [13, 14])], layer=0):
                assert result.error is None

    asyncio.run(main())
    forwards = [s for s in recorded if s[0] == "forward" and s[3] is not None]
    assert sorted(s[3][:2].tolist() for s in forwards) == [[7, 8], [9, 10], [13, 14]]
    route = next(s for s in recorded if s[0] == "route")
    assert_step_ids(route, "route", [11, 12])


@pytest.mark.parametrize("ids, message", [
    ([1, 2], "shape [T=3]"),
    ([1.0, 2.0, 3.0], "must be integers"),
    ([0, 1, 2**31], "in [0, 2**31 - 1]"),
    ([0, -1, 2], "in [0, 2**31 - 1]"),
    ([[1, 2, 3]], "shape [T=3]"),
])
def test_the_client_refuses_bad_token_ids_before_sending(client, ids, message):
    with pytest.raises(ValueError, match="token_ids") as excinfo:
        client.forward(tokens(3), layer=0, token_ids=ids)
    assert message in str(excinfo.value)


def _forward_message(ids_tensor, n=3):
    return expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(tokens(n)), token_ids=ids_tensor)


@pytest.mark.parametrize("ids_tensor, field", [
    (codec.encode(np.arange(2, dtype=np.int32)), "token_ids.shape"),                 # wrong length
    (codec.encode(np.arange(6, dtype=np.int32).reshape(3, 2)), "token_ids.shape"),  # rank 2
    (codec.encode(np.arange(3, dtype=np.float32)), "token_ids.dtype"),               # not int
    (codec.encode(np.array([0, -5, 1], np.int32)), "token_ids"),                     # negative
    (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_INT32, shape=[3], data=b"\0" * 8), "token_ids.data"),  # short
    (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_INT32, shape=[1] * 1_500_000), "token_ids.shape"),  # 1.5M dims
])
def test_bad_token_ids_are_invalid_argument_naming_them(server, ids_tensor, field):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        for call, message in ((stub.Forward, _forward_message(ids_tensor)),
                              (stub.Route, expert_pb2.RouteRequest(layer=0, hidden_states=codec.encode(tokens(3)),
                                                                   token_ids=ids_tensor))):
            with pytest.raises(grpc.RpcError) as excinfo:
                call(message, timeout=60)
            assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert excinfo.value.details().startswith(field + ":"), excinfo.value.details()[:200]
            assert len(excinfo.value.details()) < 300  # a bounded message, whatever was declared
        # in a stream the failure is in-band, and the stream goes on
        good = _forward_message(codec.encode(np.arange(3, dtype=np.int32)))
        answers = list(stub.ForwardStream(iter([_forward_message(ids_tensor), good]), timeout=60))
        assert answers[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answers[0].error.message.startswith(field + ":") and not answers[1].HasField("error")


def _infer_inputs(x, ids, datatype="INT32"):
    hidden = triton.InferInput("hidden_states", list(x.shape), "FP32")
    hidden.set_data_from_numpy(x)
    token_ids = triton.InferInput("token_ids", list(ids.shape), datatype)
    token_ids.set_data_from_numpy(ids)
    return [hidden, token_ids]


def test_kserve_takes_token_ids_as_an_optional_int32_input(server, recorded):
    x = tokens(3, seed=2)
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        with_ids = client.infer("moe-layer-0", _infer_inputs(x, np.array([4, 5, 6], np.int32))).as_numpy("output")
        bad = [(np.array([4, 5], np.int32), "INT32", "inputs['token_ids'].shape"),
               (np.array([4, 5, 6], np.int64), "INT64", "inputs['token_ids'].datatype"),
               (np.array([4, -5, 6], np.int32), "INT32", "inputs['token_ids']")]
        for ids, datatype, field in bad:
            with pytest.raises(InferenceServerException) as excinfo:
                client.infer("moe-layer-0", _infer_inputs(x, ids, datatype))
            assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert excinfo.value.message().startswith(field), excinfo.value.message()
    finally:
        client.close()
    assert_step_ids(recorded[0], "forward", [4, 5, 6])
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as expert:
        np.testing.assert_array_equal(with_ids, expert.forward(x, layer=0))


def test_kserve_token_ids_in_typed_contents(server, recorded):
    request = service_pb2.ModelInferRequest(model_name="moe-layer-0")
    x = tokens(2, seed=3)
    request.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
    request.inputs.add(name="token_ids", datatype="INT32", shape=[2]).contents.int_contents.extend([3, 4])
    request.raw_input_contents.append(x.tobytes())  # one raw entry: only hidden_states uses raw contents
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response = service_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert response.outputs[0].shape == [2, H]
    assert_step_ids(recorded[0], "forward", [3, 4])


def test_hash_routed_layers_check_token_ids_against_the_vocabulary_at_the_edge():
    """Out-of-vocabulary or missing ids of a hash-routed layer end at decoding, naming the field,
    before any step (issue 53, item 8), on expertd.v1 and KServe alike."""
    from expertd.kernels.config import MoEConfig
    from expertd.server.engine.api import MeshDescription, ModelDescription
    from expertd.server.errors import InvalidRequest
    from expertd.server.frontends import decode, kserve_decode

    cfg = MoEConfig(num_experts=8, topk=2, hidden_size=H, intermediate_size=128, score_function="sqrtsoftplus",
                    norm_topk_prob=True, hash_vocab_size=100)
    model = ModelDescription(name="hashed", layers={0: cfg}, dtype=np.float32, buckets=(1, 8), max_request_tokens=8,
                             max_batch_tokens=8, mesh=MeshDescription("ep", 1, "cpu"))
    x = tokens(3)
    for ids, message in ((np.array([1, 100, 2], np.int32), "expected ids < 100"), (None, "required")):
        forward = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x))
        infer = service_pb2.ModelInferRequest(model_name="moe-layer-0")
        infer.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
        infer.raw_input_contents.append(x.tobytes())
        if ids is not None:
            forward.token_ids.CopyFrom(codec.encode(ids))
            infer.inputs.add(name="token_ids", datatype="INT32", shape=ids.shape)
            infer.raw_input_contents.append(ids.tobytes())
        with pytest.raises(InvalidRequest, match=message) as v1:
            decode.decode_forward(forward, model, deadline=None)
        with pytest.raises(InvalidRequest, match=message) as kserve:
            kserve_decode.decode_model_infer(infer, model, 0, None, None)
        assert v1.value.field == "token_ids" and kserve.value.field == "inputs['token_ids']"
    good = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x),
                                     token_ids=codec.encode(np.arange(3, dtype=np.int32)))
    assert decode.decode_forward(good, model, deadline=None).token_ids.tolist() == [0, 1, 2]
