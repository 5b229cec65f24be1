"""The real server (tiny preset, fp32, loopback port 0) called by the real clients.

Checks results against the in-process kernels on the same weights, batching of concurrent
clients (through the scraped metrics), every INVALID_ARGUMENT / NOT_FOUND path, streams, model
info, expert load, health and reflection.
"""
import asyncio
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from service_support import host_params, reference_aux_loss, reference_forward, sample, scrape, server_config

from expertd.client import AsyncExpertClient, ExpertClient, InvalidArgumentError, NotFoundError, codec
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server.app import create_server
from expertd.server.batching import offload
from expertd.server.frontends import decode
from expertd.server.version import VERSION

H, E, K = 64, 8, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the idle fast path off: requests that trickle in (32 client threads share this process's GIL
    # with the server) would each find the server idle and run alone on the event loop, and this
    # module checks that concurrent requests merge; test_service_batcher tests the fast path
    handle = create_server(server_config(tmp_path_factory, max_queue_delay_ms=20.0, inline_step_max_ms=0.0))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=5)


@pytest.fixture(scope="module")
def client(server):
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def params(server):
    return {i: host_params(layer, np.float32) for i, layer in server.engine.layers.items()}


def cfg_of(server, layer):
    return server.engine.layers[layer].cfg


def tokens(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(dtype)


@pytest.mark.parametrize("layer", [0, 1])  # softmax top-2; grouped sigmoid + bias + shared expert
def test_forward_equals_in_process_moe_layer(server, client, params, layer):
    x = tokens(5, seed=layer)
    result = client.forward(x, layer=layer, return_routing=True)
    expected, routing = reference_forward(params[layer], cfg_of(server, layer), x, np.float32)
    assert result.output.dtype == np.float32 and result.output.shape == (5, H)
    np.testing.assert_allclose(result.output, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(result.routing.topk_ids, routing["topk_ids"])
    np.testing.assert_allclose(result.routing.topk_weights, routing["topk_weights"], rtol=1e-6)
    np.testing.assert_array_equal(result.routing.tokens_per_expert, routing["tokens_per_expert"])


def test_forward_bfloat16_in_bfloat16_out(server, client, params):
    x = tokens(3, seed=7, dtype=ml_dtypes.bfloat16)
    y = client.forward(x, layer=0)
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == (3, H)
    expected, _ = reference_forward(params[0], cfg_of(server, 0), x, np.float32)  # the server computes in fp32
    np.testing.assert_allclose(y.astype(np.float32), expected.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_request_larger_than_the_largest_bucket_is_split_not_refused(server, client, params):
    x = tokens(21, seed=3)  # buckets (1, 8): three parts
    result = client.forward(x, layer=1, return_routing=True)
    expected, routing = reference_forward(params[1], cfg_of(server, 1), x, np.float32)
    np.testing.assert_allclose(result.output, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(result.routing.tokens_per_expert, routing["tokens_per_expert"])


@pytest.mark.parametrize("layer", [0, 1])
def test_route_from_hidden_states_equals_the_router(server, client, params, layer):
    x = tokens(6, seed=10 + layer)
    result = client.route(x, layer=layer, aux_loss_coeff=0.5)
    _, routing = reference_forward(params[layer], cfg_of(server, layer), x, np.float32)
    assert result.topk_ids.dtype == np.int32 and result.topk_weights.dtype == np.float32
    np.testing.assert_array_equal(result.topk_ids, routing["topk_ids"])
    np.testing.assert_allclose(result.topk_weights, routing["topk_weights"], rtol=1e-6)
    np.testing.assert_array_equal(result.tokens_per_expert, routing["tokens_per_expert"])
    expected_aux = reference_aux_loss(params[layer], cfg_of(server, layer), x, routing["topk_ids"], 0.5)
    assert result.aux_loss == pytest.approx(expected_aux, rel=1e-5)


def test_route_from_logits_uses_the_given_logits_and_the_config_coefficient(server, client, params):
    x = tokens(4, seed=20)
    logits = x @ params[0]["router_weight"]
    from_logits = client.route(logits=logits, layer=0)
    from_hidden = client.route(x, layer=0)
    np.testing.assert_array_equal(from_logits.topk_ids, from_hidden.topk_ids)
    np.testing.assert_allclose(from_logits.topk_weights, from_hidden.topk_weights, rtol=1e-5)
    coeff = server.config.aux_loss_coeff
    expected = reference_aux_loss(params[0], cfg_of(server, 0), x, from_logits.topk_ids, coeff, logits=logits)
    assert from_logits.aux_loss == pytest.approx(expected, rel=1e-5)


def call_together(server, calls):
    """Run ``calls[i](client_i)`` on one thread and one connected client each, released together;
    returns (results, metrics delta function over the calls)."""
    n = len(calls)
    before = scrape(server.metrics_port)
    clients = [ExpertClient(f"127.0.0.1:{server.port}", timeout=60) for _ in range(n)]
    for c in clients:  # connect first, so the calls below really arrive together
        c.model_info()
    barrier, results = threading.Barrier(n), [None] * n

    def call(i):
        barrier.wait()
        results[i] = calls[i](clients[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    after = scrape(server.metrics_port)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    return results, delta


def test_concurrent_clients_are_batched_and_each_gets_its_own_result(server, params):
    n = 32
    xs = [tokens(1, seed=100 + i) for i in range(n)]
    expected, _ = reference_forward(params[0], cfg_of(server, 0), np.concatenate(xs), np.float32)
    results, delta = call_together(server, [lambda c, x=x: c.forward(x, layer=0) for x in xs])
    for i in range(n):
        np.testing.assert_allclose(results[i], expected[i:i + 1], rtol=2e-5, atol=2e-6)
    assert delta("grpc_server_handled_total", grpc_type="unary", grpc_service="expertd.v1.ExpertService",
                 grpc_method="Forward", grpc_code="OK") == n
    executions = delta("expertd_executions_total", layer="0", kind="forward")
    assert 1 <= executions < n
    assert delta("expertd_batch_requests_sum", kind="forward") == n
    assert sum(delta("expertd_routed_tokens_total", layer="0", expert=str(e)) for e in range(E)) == n * K


def test_forward_stream_answers_in_order_with_in_band_errors(server, client, params):
    xs = [tokens(n, seed=30 + n) for n in (1, 3, 9, 2)]
    items = [("a", xs[0]), ("b", xs[1]), ("bad", tokens(2)[:, :5]), ("c", xs[2]), ("d", xs[3])]
    results = list(client.forward_stream(items, layer=1))
    assert [r.request_id for r in results] == ["a", "b", "bad", "c", "d"]
    assert isinstance(results[2].error, InvalidArgumentError) and results[2].output is None
    assert "hidden_states.shape" in results[2].error.message
    for result, x in zip([r for r in results if r.error is None], xs):
        expected, _ = reference_forward(params[1], cfg_of(server, 1), x, np.float32)
        np.testing.assert_allclose(result.output, expected, rtol=2e-5, atol=2e-6)


def test_async_client_forward_route_and_stream(server, params):
    x = tokens(4, seed=50)
    expected, routing = reference_forward(params[0], cfg_of(server, 0), x, np.float32)

    async def run():
        async with AsyncExpertClient(f"127.0.0.1:{server.port}", timeout=60) as c:
            await c.wait_ready(timeout=10)
            outputs = await asyncio.gather(*(c.forward(x, layer=0) for _ in range(4)))
            route = await c.route(x, layer=0)
            streamed = [r async for r in c.forward_stream([x, x[:1]], layer=0, return_routing=True)]
            with pytest.raises(NotFoundError):
                await c.forward(x, layer=9)
            return outputs, route, streamed

    outputs, route, streamed = asyncio.run(run())
    for y in outputs:
        np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(route.topk_ids, routing["topk_ids"])
    assert [r.request_id for r in streamed] == ["0", "1"]
    np.testing.assert_allclose(streamed[1].output, expected[:1], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(streamed[0].routing.topk_ids, routing["topk_ids"])


def test_large_requests_decoded_and_answered_off_the_event_loop(server, client, params):
    """Requests of OFFLOAD_ELEMENTS or more have their body decoded and their answer built on a
    worker thread (``expertd.server.batching.offload``): the same results, and their errors still name the
    field."""
    big = offload.OFFLOAD_ELEMENTS // H + 3  # rows: over the threshold, several steps
    x = tokens(big, seed=11, dtype=ml_dtypes.bfloat16)
    result = client.forward(x, layer=1, return_routing=True)
    chunks = [reference_forward(params[1], cfg_of(server, 1), x[i:i + 32], np.float32) for i in range(0, big, 32)]
    expected = np.concatenate([out for out, _ in chunks])
    topk_ids = np.concatenate([routing["topk_ids"] for _, routing in chunks])
    assert result.output.dtype == np.dtype(ml_dtypes.bfloat16) and result.output.shape == (big, H)
    np.testing.assert_allclose(result.output.astype(np.float32), expected, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(result.routing.topk_ids, topk_ids)
    np.testing.assert_array_equal(result.routing.tokens_per_expert, np.bincount(topk_ids.ravel(), minlength=E))
    route = client.route(x, layer=1, aux_loss_coeff=0.5)
    np.testing.assert_array_equal(route.topk_ids, topk_ids)
    bad = tokens(big, seed=12)
    bad[big - 2, 5] = np.nan
    with pytest.raises(InvalidArgumentError) as info:
        client.forward(bad, layer=0)
    assert info.value.field_violations == [("hidden_states", f"contains NaN or Inf (first at token {big - 2})")]


def test_only_bodies_in_the_message_count_as_work_to_decode(server):
    """``Header.body_elements`` sizes a body's decoding (``offload``): T x width for a tensor in the
    message, 0 for one in shared memory (decoded as a view of its region)."""
    inline = expert_pb2.ForwardRequest(layer=0, hidden_states=tensor(expert_pb2.DTYPE_FLOAT32, [5, H]))
    region = expert_pb2.SharedMemoryRef(region="r", byte_size=5 * H * 4)
    shared = expert_pb2.ForwardRequest(layer=0, hidden_states=expert_pb2.Tensor(
        dtype=expert_pb2.DTYPE_FLOAT32, shape=[5, H], shared_memory=region))
    assert decode.forward_header(inline, server.model).body_elements == 5 * H
    assert decode.forward_header(shared, server.model).body_elements == 0
    route = expert_pb2.RouteRequest(layer=0, logits=tensor(expert_pb2.DTYPE_FLOAT32, [3, E]))
    assert decode.route_header(route, server.model).body_elements == 3 * E


# -- INVALID_ARGUMENT and NOT_FOUND, through the raw stub (the client would refuse some inputs) --

def raw_forward(server, request):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return expert_pb2_grpc.ExpertServiceStub(channel).Forward(request, timeout=30)


def tensor(dtype, shape, nbytes=None):
    itemsize = np.dtype(codec.numpy_dtype(dtype)).itemsize if dtype in (1, 2, 3, 4) else 4
    size = int(np.prod(shape)) * itemsize if nbytes is None else nbytes
    return expert_pb2.Tensor(dtype=dtype, shape=shape, data=b"\0" * size)


NAN = np.full((2, H), 0.5, np.float32)
NAN[1, 3] = np.nan
INF = np.full((1, H), 0.5, ml_dtypes.bfloat16)
INF[0, 0] = np.inf


@pytest.mark.parametrize(
    "request_fields, field, text",
    [
        ({"hidden_states": tensor(expert_pb2.DTYPE_INT32, [2, H])}, "hidden_states.dtype", "got int32"),
        ({"hidden_states": tensor(0, [2, H])}, "hidden_states.dtype", "got DType(0)"),
        ({"hidden_states": tensor(expert_pb2.DTYPE_FLOAT32, [2, H + 1])}, "hidden_states.shape", "H=64"),
        ({"hidden_states": tensor(expert_pb2.DTYPE_FLOAT32, [2 * H])}, "hidden_states.shape", "expected 2 dimensions"),
        ({"hidden_states": tensor(expert_pb2.DTYPE_FLOAT32, [2, H], nbytes=7)}, "hidden_states.data",
         "expected 512 bytes"),
        ({"hidden_states": tensor(expert_pb2.DTYPE_BFLOAT16, [0, H])}, "hidden_states.shape", "got T=0"),
        ({"hidden_states": tensor(expert_pb2.DTYPE_FLOAT32, [8193, H])}, "hidden_states.shape", "--max-request-tokens"),
        ({"hidden_states": codec.encode(NAN)}, "hidden_states", "NaN or Inf (first at token 1)"),
        ({"hidden_states": codec.encode(INF)}, "hidden_states", "NaN or Inf (first at token 0)"),
        ({"hidden_states": codec.encode(NAN.astype(ml_dtypes.bfloat16))}, "hidden_states", "(first at token 1)"),
        ({"hidden_states": codec.encode(-NAN.astype(np.float16))}, "hidden_states", "(first at token 1)"),
        ({"hidden_states": codec.encode(np.concatenate([NAN, -INF.astype(np.float32)]).astype(np.float16))},
         "hidden_states", "(first at token 1)"),
        ({}, "hidden_states", "required"),
    ],
)
def test_forward_invalid_argument_names_the_field(server, request_fields, field, text):
    with pytest.raises(grpc.RpcError) as info:
        raw_forward(server, expert_pb2.ForwardRequest(layer=0, **request_fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":") and text in info.value.details()


def test_invalid_argument_carries_bad_request_field_violations(client):
    with pytest.raises(InvalidArgumentError) as info:
        client.forward(np.zeros((2, 3), np.float32), layer=1)
    assert info.value.field_violations == [("hidden_states.shape", "expected [T, H=64], got [2, 3]")]


def test_unknown_layer_is_not_found(client):
    with pytest.raises(NotFoundError, match=r"layer 5 is not served; layers: \[0, 1\]"):
        client.forward(tokens(1), layer=5)
    with pytest.raises(NotFoundError):
        client.route(tokens(1), layer=5)
    with pytest.raises(NotFoundError):
        client.expert_load([5])


def test_route_invalid_arguments(server, client):
    with pytest.raises(InvalidArgumentError, match="logits.shape: expected \\[T, E=8\\]"):
        client.route(logits=np.zeros((2, 7), np.float32), layer=0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            expert_pb2_grpc.ExpertServiceStub(channel).Route(expert_pb2.RouteRequest(layer=0), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("input:")


@pytest.mark.parametrize("coeff, text", [
    (-0.5, "must be finite and >= 0, got -0.5"),
    (float("inf"), "must be finite and >= 0, got inf"),
    (3e38, r"the aux loss with coefficient 3e\+38 overflows float32"),  # finite; the loss (~4 x coeff) is not
])
def test_aux_loss_coeff_is_bounded(client, coeff, text):
    peaked = np.array([[60.0, 30.0] + [0.0] * (E - 2)], np.float32)  # top-2 take all the probability
    with pytest.raises(InvalidArgumentError, match=f"aux_loss_coeff: {text}"):
        client.route(logits=peaked, layer=0, aux_loss_coeff=coeff)
    assert np.isfinite(client.route(logits=peaked, layer=0, aux_loss_coeff=1e30).aux_loss)


def test_finite_inputs_whose_results_overflow_are_refused_not_answered(client):
    """3e38 is a finite float32; the layer's arithmetic on it is not: INVALID_ARGUMENT, never NaN / Inf with OK."""
    huge = np.full((2, H), 3e38, np.float32)
    with pytest.raises(InvalidArgumentError, match="hidden_states: the layer's result is not finite at token 0"):
        client.forward(huge, layer=0)
    with pytest.raises(InvalidArgumentError, match="hidden_states: the layer's result is not finite"):
        client.route(huge, layer=0)
    assert np.isfinite(client.forward(tokens(2), layer=0)).all()


def test_a_bad_request_does_not_disturb_the_good_ones_next_to_it(server, params):
    good = tokens(2, seed=60)
    expected, _ = reference_forward(params[0], cfg_of(server, 0), good, np.float32)
    bad = np.full((2, H), np.nan, np.float32)

    async def run():
        async with AsyncExpertClient(f"127.0.0.1:{server.port}", timeout=60) as c:
            return await asyncio.gather(*(c.forward(good if i % 2 else bad, layer=0) for i in range(8)),
                                        return_exceptions=True)

    results = asyncio.run(run())
    for i, result in enumerate(results):
        if i % 2:
            np.testing.assert_allclose(result, expected, rtol=2e-5, atol=2e-6)
        else:
            assert isinstance(result, InvalidArgumentError)


def test_concurrent_route_requests_share_steps_and_each_aux_loss_is_its_own(server, params):
    n = 12
    xs = [tokens(1 + i % 3, seed=200 + i) for i in range(n)]  # 1-3 tokens each: merged steps mix requests
    results, delta = call_together(server, [lambda c, x=x: c.route(x, layer=1, aux_loss_coeff=0.5) for x in xs])
    assert delta("grpc_server_handled_total", grpc_type="unary", grpc_service="expertd.v1.ExpertService",
                 grpc_method="Route", grpc_code="OK") == n
    assert 1 <= delta("expertd_executions_total", layer="1", kind="route") < n
    assert delta("expertd_batch_requests_sum", kind="route") == n
    cfg = cfg_of(server, 1)
    for x, result in zip(xs, results):
        _, routing = reference_forward(params[1], cfg, x, np.float32)
        np.testing.assert_array_equal(result.topk_ids, routing["topk_ids"])
        np.testing.assert_array_equal(result.tokens_per_expert, routing["tokens_per_expert"])
        expected = reference_aux_loss(params[1], cfg, x, routing["topk_ids"], 0.5)  # over its own tokens only
        assert result.aux_loss == pytest.approx(expected, rel=1e-5)


def test_split_route_request_has_the_unsplit_aux_loss(server, client, params):
    x = tokens(21, seed=30)  # buckets (1, 8): three parts
    result = client.route(x, layer=1, aux_loss_coeff=2.0)
    _, routing = reference_forward(params[1], cfg_of(server, 1), x, np.float32)
    np.testing.assert_array_equal(result.topk_ids, routing["topk_ids"])
    # the reference: one fused_moe_aux_loss over all 21 tokens at once
    expected = reference_aux_loss(params[1], cfg_of(server, 1), x, routing["topk_ids"], 2.0)
    assert result.aux_loss == pytest.approx(expected, rel=1e-5)


# -- info, load, health, reflection, metrics --------------------------------------------------

def test_model_info_describes_layers_buckets_and_mesh(client):
    info = client.model_info()
    assert info.model == "tiny" and info.dtype == expert_pb2.DTYPE_FLOAT32
    assert list(info.buckets) == [1, 8] and info.max_batch_tokens == 8 and info.max_request_tokens == 8192
    assert [(l.index, l.hidden_size, l.num_experts, l.topk) for l in info.layers] == [(0, H, E, K), (1, H, E, K)]
    assert info.layers[0].router.score_function == "softmax"
    assert info.layers[1].router.score_function == "sigmoid" and info.layers[1].router.has_expert_bias
    assert info.layers[1].num_shared_experts == 1
    assert info.mesh.platform == "cpu" and info.mesh.num_devices == 1 and list(info.mesh.axis_names) == ["ep"]


def test_expert_load_counts_the_routed_tokens(client):
    before = client.expert_load([1])[1]
    result = client.route(tokens(7, seed=70), layer=1)
    after = client.expert_load()[1]
    np.testing.assert_array_equal(after.tokens_total - before.tokens_total, result.tokens_per_expert)
    np.testing.assert_array_equal(after.tokens_recent - before.tokens_recent, result.tokens_per_expert)
    assert after.window_seconds == 60.0 and after.tokens_total.sum() >= 7 * K


@pytest.mark.parametrize("service", ["", "expertd.v1.ExpertService", "liveness", "readiness"])
def test_health_is_serving_after_warm_up(client, service):
    assert client.health(service) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_every_service(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        # a reflection client (as grpcurl does) resolves methods and their message types by name
        remote = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        infer = remote.FindServiceByName("inference.GRPCInferenceService").methods_by_name["ModelInfer"]
        forward = remote.FindServiceByName("expertd.v1.ExpertService").methods_by_name["Forward"]
        route = remote.FindMethodByName("expertd.v1.ExpertService.Route")
        stats = remote.FindMethodByName("inference.GRPCInferenceService.ModelStatistics")
        health = remote.FindServiceByName("grpc.health.v1.Health")
    assert {"expertd.v1.ExpertService", "inference.GRPCInferenceService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert (infer.input_type.full_name, infer.output_type.full_name) == \
        ("inference.ModelInferRequest", "inference.ModelInferResponse")
    assert "raw_input_contents" in infer.input_type.fields_by_name
    assert forward.input_type.full_name == "expertd.v1.ForwardRequest"
    assert forward.input_type.fields_by_name["hidden_states"].message_type.full_name == "expertd.v1.Tensor"
    assert route.output_type.fields_by_name["aux_loss"].number == 2
    # ModelStatisticsResponse is in grpc_service.proto; ModelConfig (an import) resolves too
    assert stats.output_type.full_name == "inference.ModelStatisticsResponse"
    assert remote.FindMessageTypeByName("inference.ModelConfig").fields_by_name["max_batch_size"].number == 4
    assert set(health.methods_by_name) >= {"Check", "Watch"}


def test_metrics_endpoint_exports_every_family(server, client):
    client.forward(tokens(3), layer=0)
    client.route(tokens(3), layer=1)
    client.health()  # health registers through the same wrapping as ExpertService: counted too
    with pytest.raises(InvalidArgumentError):
        client.forward(tokens(3)[:, :2], layer=0)
    assert all(r.error is None for r in client.forward_stream([tokens(1)] * 5, layer=0))
    text = scrape(server.metrics_port)
    assert sample(text, "expertd_model_ready") == 1.0
    assert sample(text, "expertd_build_info", version=VERSION, jax_version=__import__("jax").__version__,
                  grpc_version=grpc.__version__, platform="cpu") == 1.0
    assert sample(text, "expertd_compilations_total") == 12  # 2 layer shapes x 2 buckets x 3 step kinds
    assert sample(text, "expertd_compile_duration_seconds_count") == 12
    assert sample(text, "grpc_server_handled_total", grpc_type="unary", grpc_service="expertd.v1.ExpertService",
                  grpc_method="Route", grpc_code="OK") >= 1
    assert sample(text, "expertd_pending_requests") == 0
    assert sample(text, "expertd_tokens_total", kind="forward") >= 3
    assert sample(text, "expertd_batch_padding_ratio_count", kind="route") >= 1
    assert sample(text, "expertd_queue_duration_seconds_count", kind="forward") >= 1
    assert sample(text, "expertd_compute_duration_seconds_count", kind="forward") >= 1
    assert sample(text, "expertd_stream_messages_total", code="OK") >= 5
    # one family counts calls: the expertd.v1 counters of the past are gone
    assert "expertd_requests_total" not in text and "expertd_request_duration_seconds" not in text
    assert sample(text, "expertd_expert_load_imbalance", layer="1") >= 1.0
    assert sample(text, "expertd_aux_loss", layer="1") > 0
    labels = {"grpc_type": "unary", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "Forward"}
    assert sample(text, "grpc_server_started_total", **labels) >= 2
    assert sample(text, "grpc_server_handled_total", **labels, grpc_code="OK") >= 1
    assert sample(text, "grpc_server_handled_total", **labels, grpc_code="INVALID_ARGUMENT") >= 1
    assert sample(text, "grpc_server_handling_seconds_count", **labels) >= 2
    assert sample(text, "grpc_server_msg_received_total", **labels) >= 2
    stream = {"grpc_type": "bidi_stream", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "ForwardStream"}
    assert sample(text, "grpc_server_msg_received_total", **stream) >= 5
    assert sample(text, "grpc_server_msg_sent_total", **stream) >= 5
    check = {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
    assert sample(text, "grpc_server_handled_total", **check, grpc_code="OK") >= 1


def test_messages_beyond_the_size_limit_are_refused_by_grpc(server, client):
    from expertd.client import messages

    limit = server.model.max_message_bytes()
    too_many = limit // (4 * H) + 1  # fp32 rows past the limit, and past --max-request-tokens
    request = messages.forward_request(np.zeros((too_many, H), np.float32), 0, False)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # a client without admission metadata
        with pytest.raises(grpc.RpcError) as refused:
            expert_pb2_grpc.ExpertServiceStub(channel).Forward(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in refused.value.details()
    # ExpertClient declares the tokens in its metadata: refused from that, the body never read
    with ExpertClient(f"127.0.0.1:{server.port}", retries=0) as c:
        with pytest.raises(InvalidArgumentError, match=r"tokens must be in \[1, \d+\], got " + str(too_many)):
            c.forward(np.zeros((too_many, H), np.float32), layer=0)
    assert client.forward(tokens(1), layer=0).shape == (1, H)  # the server is unaffected
