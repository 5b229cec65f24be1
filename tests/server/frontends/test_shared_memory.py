"""System shared memory: tensors read from and written to registered POSIX shared-memory regions.

The registry on its own (every bad-region case, a shrunk object, unregistering while in use), then
a real server on loopback driven by tritonclient's own shared-memory utilities
(``tritonclient.utils.shared_memory``) and by expertd's client (``SharedMemoryRegion``): results
equal the copy path exactly; bad regions are INVALID_ARGUMENT naming the field; a region
unregistered while a request uses it still serves that request. The server's step runner can hold
a step (``Gate``) so that "while in use" is a fact, not a race.
"""
from __future__ import annotations

import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.utils.shared_memory as tshm
from service_support import Gate, server_with_runner
from tritonclient.utils import InferenceServerException

from expertd.client import ExpertClient, InvalidArgumentError, codec
from expertd.client.kserve_protos import service_grpc, service_pb2
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.client.shared_memory import SharedMemoryRegion
from expertd.server.errors import InvalidRequest
from expertd.server.frontends.shared_memory import SharedMemoryRegistry

H = 64
PID = os.getpid()


def key(name: str) -> str:
    return f"/expertd-test-{PID}-{name}"


def tokens(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(dtype)


# ---------------------------------------------------------------------- the registry alone

@pytest.fixture
def region_file():
    """A 4096-byte POSIX shared-memory object (and its cleanup)."""
    handle = tshm.create_shared_memory_region("unit", key("unit"), 4096)
    yield handle
    tshm.destroy_shared_memory_region(handle)


# "@name" stands for key(name), resolved in the test: parameter ids must not hold this process's
# pid, or the test workers (pytest-xdist) would collect different tests
@pytest.mark.parametrize("name, shm_key, offset, byte_size, field", [
    ("", "@unit", 0, 16, "name"),
    ("x" * 129, "@unit", 0, 16, "name"),
    ("r", "/a/b", 0, 16, "key"),
    ("r", "/..", 0, 16, "key"),
    ("r", "", 0, 16, "key"),
    ("r", "@absent", 0, 16, "key"),
    ("r", "@unit", 0, 0, "byte_size"),
    ("r", "@unit", 4000, 200, "byte_size"),   # past the object's end
    ("r", "@unit", 0, 4097, "byte_size"),
])
def test_bad_registrations_name_the_field(region_file, name, shm_key, offset, byte_size, field):
    registry = SharedMemoryRegistry()
    shm_key = key(shm_key[1:]) if shm_key.startswith("@") else shm_key
    with pytest.raises(InvalidRequest) as excinfo:
        registry.register(name, shm_key, offset, byte_size)
    assert excinfo.value.field == field
    assert registry.status() == []


def test_registrations_are_bounded_and_names_unique(region_file):
    registry = SharedMemoryRegistry(max_regions=2, max_total_bytes=3000)
    registry.register("a", key("unit"), 0, 1000)
    with pytest.raises(InvalidRequest, match="registered already"):
        registry.register("a", key("unit"), 0, 10)
    with pytest.raises(InvalidRequest, match="would exceed the 3000 bytes") as excinfo:
        registry.register("b", key("unit"), 1000, 2500)
    assert excinfo.value.field == "byte_size"
    registry.register("b", key("unit"), 1000, 2000)
    with pytest.raises(InvalidRequest, match="the most allowed"):
        registry.register("c", key("unit"), 0, 1)
    assert [(r.name, r.offset, r.byte_size) for r in registry.status()] == [("a", 0, 1000), ("b", 1000, 2000)]
    with pytest.raises(LookupError):
        registry.status("c")
    registry.unregister("a")
    registry.unregister("a")  # unknown names are ignored, as in Triton
    registry.register("c", key("unit"), 0, 1)
    registry.unregister()
    assert registry.status() == []


def test_tensors_must_lie_inside_their_region(region_file):
    registry = SharedMemoryRegistry()
    registry.register("r", key("unit"), 1024, 2048)  # a region from the object's offset 1024
    tshm.set_shared_memory_region(region_file, [np.arange(4, dtype=np.float32)], offset=1024 + 8)
    array = registry.input_array("r", 8, 16, np.dtype(np.float32), (2, 2), "x")
    np.testing.assert_array_equal(array, np.arange(4, dtype=np.float32).reshape(2, 2))  # offsets add up
    assert not array.flags.writeable
    cases = [(("nope", 0, 16), "x.region"), (("r", 2040, 16), "x.offset"), (("r", 0, 12), "x.byte_size")]
    for (name, offset, size), field in cases:
        with pytest.raises(InvalidRequest) as excinfo:
            registry.input_array(name, offset, size, np.dtype(np.float32), (2, 2), "x")
        assert excinfo.value.field == field
    with pytest.raises(InvalidRequest) as excinfo:
        registry.output_slot("r", 0, 8, 16, "y")
    assert excinfo.value.field == "y.byte_size"
    with pytest.raises(InvalidRequest) as excinfo:
        registry.output_slot("r", 2044, 16, 16, "y")
    assert excinfo.value.field == "y.offset"


def test_a_shrunk_object_is_refused_not_read(region_file):
    registry = SharedMemoryRegistry()
    registry.register("r", key("unit"), 0, 4096)
    slot = registry.output_slot("r", 2048, 1024, 1024, "y")
    fd = os.open(f"/dev/shm/{key('unit').lstrip('/')}", os.O_RDWR)
    try:
        os.ftruncate(fd, 1024)  # reading past the object's end would fault the server (SIGBUS)
        with pytest.raises(InvalidRequest, match="shrank") as excinfo:
            registry.input_array("r", 2048, 64, np.dtype(np.float32), (16,), "x")
        assert excinfo.value.field == "x.offset"
        with pytest.raises(InvalidRequest, match="shrank"):
            slot.write(np.zeros(16, np.float32))
    finally:
        os.ftruncate(fd, 4096)
        os.close(fd)


def test_unregistering_keeps_the_mapping_of_requests_in_flight(region_file):
    registry = SharedMemoryRegistry()
    registry.register("r", key("unit"), 0, 4096)
    tshm.set_shared_memory_region(region_file, [np.full(4, 3.0, np.float32)])
    array = registry.input_array("r", 0, 16, np.dtype(np.float32), (4,), "x")
    slot = registry.output_slot("r", 16, 16, 16, "y")
    registry.unregister("r")
    with pytest.raises(InvalidRequest, match="no shared-memory region 'r'"):
        registry.input_array("r", 0, 16, np.dtype(np.float32), (4,), "x")
    np.testing.assert_array_equal(array, np.full(4, 3.0, np.float32))  # still mapped
    slot.write(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(tshm.get_contents_as_numpy(region_file, np.float32, [4], offset=16),
                                  np.arange(4, dtype=np.float32))
    del slot, registry  # the region object goes; the array's view keeps the pages mapped
    gc.collect()
    np.testing.assert_array_equal(array, np.full(4, 3.0, np.float32))


# ---------------------------------------------------------------------- a real server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # fp32 tiny, buckets 1, 8; the Gate holds steps, so they must run on the device thread, never
    # inline on the event loop (the idle fast path), or a held step would stop every other call
    with server_with_runner(tmp_path_factory, Gate, max_queue_delay_ms=0.0, inline_step_max_ms=0.0) as handle:
        handle.gate = handle.runner
        yield handle


@pytest.fixture
def triton_client(server):
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture
def client(server):
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c
        c.unregister_shared_memory()


@pytest.fixture
def io_region():
    """tritonclient's region: room for an input and an output of up to 8 x H fp32 tokens."""
    handle = tshm.create_shared_memory_region("io", key("io"), 2 * 8 * H * 4 + 2 * 8 * 2 * 4)
    yield handle
    tshm.destroy_shared_memory_region(handle)


def _raw_infer(client, x, model="moe-layer-0"):
    tensor = triton.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor])


def test_tritonclient_shared_memory_equals_the_copy_path(server, triton_client, io_region):
    assert "system_shared_memory" in triton_client.get_server_metadata().extensions
    x = tokens(5, seed=1)
    nbytes = x.nbytes
    triton_client.register_system_shared_memory("io", key("io"), 2 * 8 * H * 4 + 2 * 8 * 2 * 4)
    status = triton_client.get_system_shared_memory_status(as_json=True)["regions"]["io"]
    assert status["key"] == key("io") and int(status["byte_size"]) == 2 * 8 * H * 4 + 2 * 8 * 2 * 4
    tshm.set_shared_memory_region(io_region, [x])
    tensor = triton.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_shared_memory("io", nbytes)
    output = triton.InferRequestedOutput("output")
    output.set_shared_memory("io", nbytes, offset=8 * H * 4)
    ids = triton.InferRequestedOutput("router_topk_ids")  # in the response, next to one in shared memory
    result = triton_client.infer("moe-layer-0", [tensor], outputs=[output, ids])
    expected = _raw_infer(triton_client, x)
    assert result.get_output("output").parameters["shared_memory_region"].string_param == "io"
    in_shm = tshm.get_contents_as_numpy(io_region, np.float32, [5, H], offset=8 * H * 4)
    np.testing.assert_array_equal(in_shm, expected.as_numpy("output"))
    np.testing.assert_array_equal(result.as_numpy("router_topk_ids"), expected.as_numpy("router_topk_ids"))


@pytest.mark.parametrize("region, offset, byte_size, text", [
    ("nope", 0, 5 * H * 4, "inputs['hidden_states'].parameters.region: no shared-memory region 'nope'"),
    ("io", 4096, 5 * H * 4, "inputs['hidden_states'].parameters.offset: bytes [4096,"),
    ("io", 0, 5 * H * 4 - 4, "inputs['hidden_states'].parameters.byte_size: expected 1280 bytes"),
])
def test_tritonclient_bad_input_regions_are_invalid_argument(triton_client, io_region, region, offset, byte_size,
                                                             text):
    triton_client.register_system_shared_memory("io", key("io"), 4096)
    tensor = triton.InferInput("hidden_states", [5, H], "FP32")
    tensor.set_shared_memory(region, byte_size, offset=offset)
    with pytest.raises(InferenceServerException) as excinfo:
        triton_client.infer("moe-layer-0", [tensor])
    assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert excinfo.value.message().startswith(text), excinfo.value.message()


def test_tritonclient_bad_output_regions_and_registrations_are_invalid_argument(triton_client, io_region):
    triton_client.register_system_shared_memory("io", key("io"), 4096)
    x = tokens(2)
    tensor = triton.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    small = triton.InferRequestedOutput("output")
    small.set_shared_memory("io", x.nbytes - 1)
    outside = triton.InferRequestedOutput("output")
    outside.set_shared_memory("io", x.nbytes, offset=4096 - 8)
    for output, text in ((small, "outputs['output'].parameters.byte_size"),
                         (outside, "outputs['output'].parameters.offset")):
        with pytest.raises(InferenceServerException) as excinfo:
            triton_client.infer("moe-layer-0", [tensor], outputs=[output])
        assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert excinfo.value.message().startswith(text), excinfo.value.message()
    for args, field in ((("io", key("io"), 16), "name"), (("other", "/no/such", 16), "key"),
                        (("other", key("absent"), 16), "key"), (("other", key("io"), 1 << 20), "byte_size")):
        with pytest.raises(InferenceServerException) as excinfo:
            triton_client.register_system_shared_memory(*args)
        assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert excinfo.value.message().startswith(field + ":"), excinfo.value.message()
    assert _raw_infer(triton_client, x).as_numpy("output").shape == (2, H)  # still serving


def test_expertd_client_shared_memory_equals_the_copy_path(client):
    for dtype in (np.float32, np.dtype(ml_dtypes.bfloat16)):
        x = tokens(6, seed=2, dtype=dtype)
        with SharedMemoryRegion("mine", 2 * x.nbytes, key=key("mine")) as region:
            client.register_shared_memory(region)
            assert [(r.name, r.key, r.byte_size) for r in client.shared_memory_status()] == \
                [("mine", key("mine"), 2 * x.nbytes)]
            inp, out = region.tensor(0, x.dtype, x.shape), region.tensor(x.nbytes, x.dtype, x.shape)
            inp.array[...] = x
            y = client.forward(inp, layer=1, out=out)
            assert y is out.array
            np.testing.assert_array_equal(y, client.forward(x, layer=1))
            routed = client.route(inp, layer=1)
            np.testing.assert_array_equal(routed.topk_ids, client.route(x, layer=1).topk_ids)
            client.unregister_shared_memory("mine")
            assert client.shared_memory_status() == []
            del inp, out, y


def test_expertd_bad_regions_are_invalid_argument_naming_them(server, client):
    x = tokens(2)
    with SharedMemoryRegion("mine", 4096, key=key("mine2")) as region:
        client.register_shared_memory(region)
        inp = region.tensor(0, x.dtype, x.shape)
        out = region.tensor(x.nbytes, x.dtype, x.shape)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            hidden = expert_pb2.Tensor(dtype=codec.dtype_enum(x.dtype), shape=x.shape,
                                       shared_memory=expert_pb2.SharedMemoryRef(region="gone", byte_size=x.nbytes))
            outside = expert_pb2.SharedMemoryRef(region="mine", offset=4000, byte_size=x.nbytes)
            with_data = expert_pb2.Tensor(dtype=codec.dtype_enum(x.dtype), shape=x.shape, data=x.tobytes(),
                                          shared_memory=inp.ref())
            cases = [(expert_pb2.ForwardRequest(layer=0, hidden_states=hidden), "hidden_states.shared_memory.region"),
                     (expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x), output_shared_memory=outside),
                      "output_shared_memory.offset"),
                     (expert_pb2.ForwardRequest(layer=0, hidden_states=with_data), "hidden_states.data")]
            for message, field in cases:
                with pytest.raises(grpc.RpcError) as excinfo:
                    stub.Forward(message, timeout=60)
                assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert excinfo.value.details().startswith(field + ":"), excinfo.value.details()
        with pytest.raises(InvalidArgumentError, match="name"):
            client.register_shared_memory(region)  # twice
        client.unregister_shared_memory()
        with pytest.raises(InvalidArgumentError, match="hidden_states.shared_memory.region"):
            client.forward(inp, layer=0, out=out)
        del inp, out


def test_a_region_unregistered_while_a_request_uses_it_still_serves_that_request(server, client):
    x = tokens(3, seed=4)
    expected = client.forward(x, layer=0)
    gate = server.gate
    with SharedMemoryRegion("busy", 2 * x.nbytes, key=key("busy")) as region:
        client.register_shared_memory(region)
        inp, out = region.tensor(0, x.dtype, x.shape), region.tensor(x.nbytes, x.dtype, x.shape)
        inp.array[...] = x
        gate.hold, gate.entered = threading.Event(), threading.Event()
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.forward, inp, layer=0, out=out)
                assert gate.entered.wait(60)       # the step is running: decoded, slot validated
                client.unregister_shared_memory("busy")
                assert client.shared_memory_status() == []
                gate.hold.set()
                y = pending.result(timeout=60)
                del pending  # it holds the result: a view of the region
        finally:
            gate.hold.set()
            gate.hold = None
        np.testing.assert_array_equal(y, expected)  # written into the unregistered region's pages
        with pytest.raises(InvalidArgumentError, match="no shared-memory region 'busy'"):
            client.forward(inp, layer=0, out=out)
        del inp, out, y


def test_kserve_bf16_and_token_ids_from_shared_memory_and_streams(server, client, triton_client):
    x = tokens(4, seed=5, dtype=ml_dtypes.bfloat16)
    expected = client.forward(x, layer=0)
    with SharedMemoryRegion("mixed", 4096 + x.nbytes, key=key("mixed")) as region:
        triton_client.register_system_shared_memory("mixed", region.key, region.byte_size)
        inp, ids = region.tensor(0, x.dtype, x.shape), region.tensor(x.nbytes, np.int32, (4,))
        inp.array[...], ids.array[...] = x, [1, 2, 3, 4]
        request = service_pb2.ModelInferRequest(model_name="moe-layer-0")
        for name, datatype, tensor in (("hidden_states", "BF16", inp), ("token_ids", "INT32", ids)):
            entry = request.inputs.add(name=name, datatype=datatype, shape=tensor.array.shape)
            entry.parameters["shared_memory_region"].string_param = "mixed"
            entry.parameters["shared_memory_offset"].int64_param = tensor.offset
            entry.parameters["shared_memory_byte_size"].int64_param = tensor.array.nbytes
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            response = service_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        assert not request.raw_input_contents and response.outputs[0].datatype == "BF16"
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], ml_dtypes.bfloat16).reshape(4, H),
                                      expected)
        # the region registered over KServe is expertd.v1's too: a stream reads it in place
        results = list(client.forward_stream([("shm", inp), ("copy", x)], layer=0))
        assert [r.error for r in results] == [None, None]
        np.testing.assert_array_equal(results[0].output, expected)
        np.testing.assert_array_equal(results[1].output, expected)
        del inp, ids, tensor, results


def test_expertd_token_ids_may_lie_in_shared_memory_and_are_checked_there(server, client):
    """expertd.v1 reads ``token_ids`` from a region as it reads hidden states (issue 53: it ignored them)."""
    x = tokens(3)
    ids = np.array([5, 0, 7], np.int32)
    with SharedMemoryRegion("ids", 64, key=key("ids")) as region:
        client.register_shared_memory(region)
        region.tensor(0, ids.dtype, ids.shape).array[...] = ids
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)

            def forward(byte_size, offset=0):
                ref = expert_pb2.SharedMemoryRef(region="ids", offset=offset, byte_size=byte_size)
                shared_ids = expert_pb2.Tensor(dtype=expert_pb2.DTYPE_INT32, shape=[3], shared_memory=ref)
                message = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x), token_ids=shared_ids)
                return stub.Forward(message, timeout=60)

            inline = stub.Forward(expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(x),
                                                            token_ids=codec.encode(ids)), timeout=60)
            assert forward(12).output == inline.output
            for byte_size, offset, field in ((8, 0, "token_ids.shared_memory.byte_size"),
                                             (12, 60, "token_ids.shared_memory.offset")):
                with pytest.raises(grpc.RpcError) as excinfo:
                    forward(byte_size, offset)
                assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert excinfo.value.details().startswith(field + ":"), excinfo.value.details()
        client.unregister_shared_memory()
