"""The KServe v2 / Triton service of the real server (tiny preset, fp32, loopback port 0), called by
the official tritonclient gRPC clients (sync and aio) and, for what tritonclient cannot send, by
our own stubs. Results must equal expertd.v1 Forward on the same server."""
import asyncio
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from service_support import sample, scrape, server_config
from tritonclient.utils import InferenceServerException

from expertd.client import ExpertClient
from expertd.client.kserve_protos import service_grpc, service_pb2
from expertd.server.app import create_server

H, K = 64, 2
MODEL = "moe-layer-0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A small queue and a queue delay that keeps accepted requests waiting: overload is certain. The
    # idle fast path is off, so a lone request waits the queue delay too (the statistics test reads it).
    handle = create_server(server_config(tmp_path_factory, max_queue_delay_ms=20.0, max_queue_size=4,
                                         inline_step_max_ms=0.0))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=5)


@pytest.fixture(scope="module")
def url(server):
    return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def triton_client(url):
    client = triton.InferenceServerClient(url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def expert_client(url):
    with ExpertClient(url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(url):
    with grpc.insecure_channel(url) as channel:
        yield service_grpc.GRPCInferenceServiceStub(channel)


def tokens(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(dtype)


def infer_input(x, datatype):
    tensor = triton.InferInput("hidden_states", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return tensor


def status_of(excinfo) -> str:
    return excinfo.value.status()


def test_health_and_server_metadata(triton_client):
    assert triton_client.is_server_live() and triton_client.is_server_ready()
    assert triton_client.is_model_ready(MODEL) and triton_client.is_model_ready("moe-layer-1", "1")
    assert not triton_client.is_model_ready("moe-layer-7")
    metadata = triton_client.get_server_metadata(as_json=True)
    assert metadata["name"] == "expertd" and metadata["version"]
    assert {"model_configuration", "statistics"} <= set(metadata["extensions"])


def test_model_metadata_and_config_describe_the_layer(triton_client):
    metadata = triton_client.get_model_metadata(MODEL, as_json=True)
    assert metadata["name"] == MODEL and metadata["versions"] == ["1"] and metadata["platform"] == "jax"
    assert metadata["inputs"] == [{"name": "hidden_states", "datatype": "FP32", "shape": ["-1", str(H)]}]
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("output", "FP32", ["-1", str(H)]), ("router_topk_ids", "INT32", ["-1", str(K)]),
        ("router_topk_weights", "FP32", ["-1", str(K)])]
    config = triton_client.get_model_config(MODEL).config  # perf_analyzer reads these fields
    assert config.name == MODEL and config.platform == "jax" and config.max_batch_size == 8192
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("hidden_states",
                                                                            triton.model_config_pb2.TYPE_FP32, [H])]
    assert [o.name for o in config.output] == ["output", "router_topk_ids", "router_topk_weights"]
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 20000
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 4
    assert config.parameters["num_experts"].string_value == "8" and config.parameters["topk"].string_value == str(K)


def test_infer_fp32_equals_expertd_forward_and_echoes_the_id(triton_client, expert_client):
    x = tokens(5, seed=1)
    result = triton_client.infer(MODEL, [infer_input(x, "FP32")], request_id="req-42")
    assert result.get_response().id == "req-42" and result.get_response().model_version == "1"
    expected = expert_client.forward(x, layer=0, return_routing=True)
    output = result.as_numpy("output")
    assert output.dtype == np.float32 and output.shape == (5, H)
    np.testing.assert_array_equal(output, expected.output)
    np.testing.assert_array_equal(result.as_numpy("router_topk_ids"), expected.routing.topk_ids)
    np.testing.assert_array_equal(result.as_numpy("router_topk_weights"), expected.routing.topk_weights)


def test_infer_bf16_with_the_aio_client_equals_expertd_forward(url, expert_client):
    x = tokens(3, seed=2, dtype=ml_dtypes.bfloat16)

    async def call():
        client = triton_aio.InferenceServerClient(url)
        try:
            assert await client.is_model_ready("moe-layer-1")
            outputs = [triton_aio.InferRequestedOutput("output")]
            return await client.infer("moe-layer-1", [infer_input(x, "BF16")], outputs=outputs, request_id="bf")
        finally:
            await client.close()

    result = asyncio.run(call())
    assert [o.name for o in result.get_response().outputs] == ["output"]  # only what was asked for
    output = result.as_numpy("output")
    assert output.dtype == ml_dtypes.bfloat16 and output.shape == (3, H)
    np.testing.assert_array_equal(output, expert_client.forward(x, layer=1))


def test_typed_fp32_contents_give_the_same_result_as_raw(stub, triton_client):
    x = tokens(4, seed=3)
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed")
    tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request.outputs.add(name="router_topk_ids")
    response = stub.ModelInfer(request, timeout=60)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["router_topk_ids"]
    ids = np.frombuffer(response.raw_output_contents[0], np.int32).reshape(4, K)
    raw = triton_client.infer(MODEL, [infer_input(x, "FP32")], outputs=[triton.InferRequestedOutput("router_topk_ids")])
    np.testing.assert_array_equal(ids, raw.as_numpy("router_topk_ids"))


@pytest.mark.parametrize("model, version, code", [
    ("moe-layer-9", "", "StatusCode.NOT_FOUND"),
    ("llama", "", "StatusCode.NOT_FOUND"),
    (MODEL, "2", "StatusCode.NOT_FOUND"),
    ("moe-layer-00", "", "StatusCode.NOT_FOUND"),  # no aliases: only the canonical name is a model
    ("moe-layer-01", "", "StatusCode.NOT_FOUND"),
    ("moe-layer-\u0661", "", "StatusCode.NOT_FOUND"),  # ARABIC-INDIC DIGIT ONE: int() reads it as 1
    ("moe-layer-+1", "", "StatusCode.NOT_FOUND"),
])
def test_unknown_models_and_versions_are_not_found(triton_client, model, version, code):
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(model, [infer_input(tokens(1), "FP32")], model_version=version)
    assert status_of(excinfo) == code and "moe-layer-0" in excinfo.value.message() + model
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.get_model_metadata(model, version)
    assert status_of(excinfo) == code
    assert not triton_client.is_model_ready(model, version)


@pytest.mark.parametrize("build, text", [
    (lambda: [triton.InferInput("x", [1, H], "FP32")], "expected 'hidden_states' [T, H=64] and optionally 'token_ids'"),
    (lambda: [triton.InferInput("hidden_states", [1, H], "INT32")], "datatype"),
    (lambda: [triton.InferInput("hidden_states", [1, H + 1], "FP32")], f"expected [T, H={H}]"),
    (lambda: [triton.InferInput("hidden_states", [H], "FP32")], "shape"),
])
def test_bad_inputs_are_invalid_argument_naming_the_field(triton_client, build, text):
    inputs = build()
    shape = inputs[0].shape()
    inputs[0].set_data_from_numpy(np.zeros(shape, dtype=triton.triton_to_np_dtype(inputs[0].datatype())))
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, inputs)
    assert status_of(excinfo) == "StatusCode.INVALID_ARGUMENT" and text in excinfo.value.message()


def test_nan_and_reserved_parameters_are_rejected(triton_client):
    x = tokens(2)
    x[1, 3] = np.nan
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, [infer_input(x, "FP32")])
    assert status_of(excinfo) == "StatusCode.INVALID_ARGUMENT" and "NaN" in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, [infer_input(tokens(1), "FP32")], sequence_id=7)
    assert status_of(excinfo) == "StatusCode.INVALID_ARGUMENT" and "stateless" in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, [infer_input(tokens(1), "FP32")], parameters={"temperature": 0.5})
    assert "parameters['temperature']" in excinfo.value.message()
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, [infer_input(tokens(1), "FP32")], outputs=[triton.InferRequestedOutput("logits")])
    assert "outputs[0].name" in excinfo.value.message()
    # priority is accepted (one priority level)
    assert triton_client.infer(MODEL, [infer_input(tokens(1), "FP32")], priority=3).as_numpy("output").shape == (1, H)


def _raw_request(x, datatype="FP32"):
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="hidden_states", datatype=datatype, shape=x.shape)
    request.raw_input_contents.append(x.tobytes())
    return request


def test_protocol_violations_tritonclient_cannot_send(stub):
    x = tokens(2)
    mixed = _raw_request(x)
    mixed.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    short = _raw_request(x)
    short.raw_input_contents[0] = x.tobytes()[:-4]
    typed_bf16 = service_pb2.ModelInferRequest(model_name=MODEL)
    typed_bf16.inputs.add(name="hidden_states", datatype="BF16", shape=x.shape).contents.fp32_contents.extend(x.ravel())
    timeout_as_string = _raw_request(x)
    timeout_as_string.parameters["timeout"].string_param = "soon"
    cases = [(mixed, "not both"), (short, "raw_input_contents[0]"), (typed_bf16, "raw_input_contents"),
             (timeout_as_string, "parameters['timeout']")]
    for request, text in cases:
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.ModelInfer(request, timeout=60)
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in excinfo.value.details()
    assert stub.ModelInfer(_raw_request(x), timeout=60).outputs[0].shape == [2, H]  # still serving


def test_rpcs_outside_the_subset_are_unimplemented(triton_client):
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.get_model_repository_index()
    assert status_of(excinfo) == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.get_cuda_shared_memory_status()
    assert status_of(excinfo) == "StatusCode.UNIMPLEMENTED"


def test_timeout_parameter_drops_a_queued_request(triton_client):
    # 1 us of server-side timeout passes while the request waits for its batch (queue delay 20 ms).
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer(MODEL, [infer_input(tokens(1), "FP32")], timeout=1)
    assert status_of(excinfo) == "StatusCode.DEADLINE_EXCEEDED"


def test_statistics_count_requests_like_perf_analyzer_expects(triton_client):
    before = triton_client.get_inference_statistics("moe-layer-1").model_stats[0]
    for n in (1, 3):
        triton_client.infer("moe-layer-1", [infer_input(tokens(n), "FP32")])
    with pytest.raises(InferenceServerException) as excinfo:  # H + 1 columns: a failed request
        triton_client.infer("moe-layer-1", [infer_input(np.zeros((1, H + 1), np.float32), "FP32")])
    assert status_of(excinfo) == "StatusCode.INVALID_ARGUMENT"
    after = triton_client.get_inference_statistics("moe-layer-1").model_stats[0]
    stats, old = after.inference_stats, before.inference_stats
    assert stats.success.count - old.success.count == 2 and stats.fail.count - old.fail.count == 1
    assert stats.queue.count == stats.compute_input.count == stats.compute_infer.count == stats.compute_output.count \
        == stats.success.count
    assert stats.success.ns > old.success.ns and stats.compute_infer.ns > old.compute_infer.ns
    # 3 rows pad to bucket 8, so that request waited the 20 ms queue delay for company; 1 row fills bucket 1
    queue_ns = stats.queue.ns - old.queue.ns
    assert 15e6 <= queue_ns
    parts = sum(getattr(stats, n).ns - getattr(old, n).ns
                for n in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert parts <= stats.success.ns - old.success.ns + 1e6  # the parts of the time add up to at most the whole
    assert after.inference_count - before.inference_count == 4
    assert after.execution_count >= before.execution_count + 2 and after.last_inference >= before.last_inference
    everything = triton_client.get_inference_statistics().model_stats
    assert [m.name for m in everything] == ["moe-layer-0", "moe-layer-1"]


def test_overload_is_resource_exhausted_and_the_rest_are_answered(url):
    async def flood():
        client = triton_aio.InferenceServerClient(url)
        try:
            calls = [client.infer(MODEL, [infer_input(tokens(1, seed=i), "FP32")]) for i in range(32)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=120)
        finally:
            await client.close()

    results = asyncio.run(flood())
    failures = [r for r in results if isinstance(r, Exception)]
    assert failures and all(f.status() == "StatusCode.RESOURCE_EXHAUSTED" for f in failures)
    assert len(failures) < len(results)
    assert all(r.as_numpy("output").shape == (1, H) for r in results if not isinstance(r, Exception))


def test_requests_are_counted_in_the_shared_metrics(server, triton_client):
    before = scrape(server.metrics_port)
    triton_client.infer(MODEL, [infer_input(tokens(2), "FP32")])
    after = scrape(server.metrics_port)
    handled = dict(grpc_type="unary", grpc_service="inference.GRPCInferenceService", grpc_method="ModelInfer",
                   grpc_code="OK")
    assert sample(after, "grpc_server_handled_total", **handled) == \
        sample(before, "grpc_server_handled_total", **handled) + 1


def test_large_tensors_are_decoded_and_encoded_off_the_event_loop(stub, monkeypatch):
    """As expertd.v1 does: a body of OFFLOAD_ELEMENTS elements or more is decoded, and its answer
    encoded, on a worker thread; a small one on the server's event loop (thread ``expertd-grpc``)."""
    from expertd.server.batching import offload
    from expertd.server.frontends import kserve, kserve_decode

    threads = []
    decode, respond = kserve_decode.decode_model_infer, kserve._infer_response

    def recording(function, step):
        def wrapped(*args):
            threads.append((step, threading.current_thread().name))
            return function(*args)
        return wrapped

    monkeypatch.setattr(kserve_decode, "decode_model_infer", recording(decode, "decode"))
    monkeypatch.setattr(kserve, "_infer_response", recording(respond, "encode"))
    large = tokens(offload.OFFLOAD_ELEMENTS // H, seed=5)
    small = tokens(2, seed=6)
    for x in (small, large):
        reply = stub.ModelInfer(_raw_request(x), timeout=120)
        out = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(x.shape)
        assert np.isfinite(out).all()
    assert [step for step, _ in threads] == ["decode", "encode"] * 2
    assert {name for _, name in threads[:2]} == {"expertd-grpc"}
    assert "expertd-grpc" not in {name for _, name in threads[2:]}
