"""Every model family end to end: a synthetic Hugging Face checkpoint (tests/hf_fixtures.py) served
over gRPC; Forward and Route equal the in-process kernels on the checkpoint's own weights."""
import hf_fixtures
import ml_dtypes
import numpy as np
import pytest
from service_support import reference_forward, server_config

from expertd.client import ExpertClient
from expertd.client.pb.v1 import expert_pb2
from expertd.server.app import create_server
from expertd.server.config import ModelConfig
from expertd.server.models.hf_config import moe_config_from_hf

# (family, storage dtype, sharded, server dtype, --layers)
CASES = [
    ("mixtral", "float32", True, "float32", "1-2"),
    ("qwen2_moe", "bfloat16", False, "bfloat16", None),
    ("qwen3_moe", "float32", True, "float32", None),
    ("deepseek_v3", "bfloat16", False, "bfloat16", None),
]
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@pytest.fixture(scope="module", params=CASES, ids=[case[0] for case in CASES])
def served(request, tmp_path_factory):
    family, stored, sharded, dtype, layers = request.param
    path = tmp_path_factory.mktemp(family)
    expected = hf_fixtures.write_checkpoint(path, family, sharded=sharded, dtype=stored)
    config = server_config(tmp_path_factory, bucket_sizes=(8,),
                           model=ModelConfig(checkpoint=str(path), layers=layers, dtype=dtype, num_devices=1))
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    hf_config = hf_fixtures.hf_config(family, dtype=stored)
    wanted = [1, 2] if layers else hf_fixtures.moe_layer_indices(hf_config, family)
    yield handle, {i: expected[i] for i in wanted}, moe_config_from_hf(hf_config), NUMPY_DTYPES[dtype]
    handle.stop(grace=2)


def engine_params(params: dict, dtype) -> dict:
    """The weights as the server computes with them: router tensors fp32, experts in the server dtype."""
    return {k: v.astype(np.float32 if k in ("router_weight", "expert_bias") else dtype) for k, v in params.items()}


def test_model_info_names_the_model_layers_by_their_index(served):
    handle, expected, cfg, dtype = served
    with ExpertClient(f"127.0.0.1:{handle.port}") as client:
        info = client.model_info()
    assert [layer.index for layer in info.layers] == sorted(expected)
    assert info.model == handle.config.model.checkpoint
    assert info.dtype == (expert_pb2.DTYPE_FLOAT32 if dtype == np.float32 else expert_pb2.DTYPE_BFLOAT16)
    assert all((l.hidden_size, l.num_experts, l.topk) == (cfg.hidden_size, cfg.num_experts,
                                                          cfg.topk) for l in info.layers)


def test_forward_and_route_equal_the_kernels_on_the_checkpoint_weights(served):
    handle, expected, cfg, dtype = served
    layer = max(expected)  # DeepSeek-V3's first MoE layer is 2 here: its first layers are dense
    params = engine_params(expected[layer], dtype)
    x = np.random.default_rng(layer).standard_normal((11, cfg.hidden_size)).astype(dtype)  # 2 parts of bucket 8
    reference, routing = reference_forward(params, cfg, x, dtype)
    with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
        result = client.forward(x, layer=layer, return_routing=True)
        route = client.route(x, layer=layer)
    assert result.output.dtype == dtype
    tolerance = 2e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(result.output.astype(np.float32), reference.astype(np.float32),
                               rtol=tolerance, atol=tolerance)
    for got in (result.routing, route):
        np.testing.assert_array_equal(got.topk_ids, routing["topk_ids"])
        np.testing.assert_allclose(got.topk_weights, routing["topk_weights"], rtol=1e-5)
        np.testing.assert_array_equal(got.tokens_per_expert, routing["tokens_per_expert"])


def test_expert_parallel_server_equals_the_single_device_kernels(tmp_path_factory):
    """Four simulated CPU devices: the engine runs ep_moe_layer with E / 4 experts per rank."""
    config = server_config(tmp_path_factory, bucket_sizes=(8,),
                           model=ModelConfig(preset="tiny", dtype="float32", num_devices=4))
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
            info = client.model_info()
            assert (list(info.mesh.axis_names), list(info.mesh.axis_sizes), info.mesh.num_devices) == (["ep"], [4], 4)
            for layer in (0, 1):
                loaded = handle.engine.layers[layer]
                x = np.random.default_rng(layer).standard_normal((11, 64)).astype(np.float32)
                result = client.forward(x, layer=layer, return_routing=True)
                reference, routing = reference_forward(engine_params(dict(loaded.params.items()), np.float32),
                                                       loaded.cfg, x, np.float32)
                np.testing.assert_allclose(result.output, reference, rtol=2e-5, atol=2e-6)
                np.testing.assert_array_equal(result.routing.topk_ids, routing["topk_ids"])
    finally:
        handle.stop(grace=2)
