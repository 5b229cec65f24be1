"""Checkpoints end to end through the real server and client: a representative subset of the
families (tests/hf_fixtures.py), one per tensor layout, layer prefix and weight format, served over
gRPC. On every MoE layer and for two token counts, Forward equals the family's transformers block
(the float64 oracle `hf_fixtures.hf_reference`) within fp32 tolerance, and Route equals the
in-process kernels on the same weights. The other families are checked at the loader
(tests/server/models/test_checkpoint.py, test_models_quant_checkpoints.py): same loader, same kernels."""
import hf_fixtures
import ml_dtypes
import numpy as np
import pytest
from service_support import host_params, reference_forward, server_config

from expertd.client import ExpertClient
from expertd.client.pb.v1 import expert_pb2
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

# (family, quantize, storage dtype, sharded, --dtype, --layers): what each case adds
CASES = [
    ("mixtral", None, "float32", True, "auto", "1-2"),            # per-expert Linears, shards, fp32 kept
    ("qwen3_moe", None, "bfloat16", False, "auto", None),         # transformers 5 num_local_experts, bf16 kept
    ("qwen3_5_moe", "fp8", "bfloat16", False, "float32", None),   # text_config, model.language_model., FP8 block
    ("mistral4", "mxfp4", "bfloat16", False, "float32", None),    # fused [E, 2I, H], groups on probabilities, MXFP4
    ("dbrx", None, "float32", False, "auto", None),               # transformer.blocks., flat [E*I, H], ffn_config
    ("kimi_k25", "int4", "bfloat16", True, "float32", None),      # language_model.model., INT4 compressed-tensors
    ("deepseek_v3", "fp4", "bfloat16", False, "float32", None),   # FP4 e2m1 experts, ue8m0 (e8m0) scales
    ("mistral_large4", "fp8_qscale", "bfloat16", False, "float32", None),  # bare layers.N., qscale_weight
]
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@pytest.fixture(scope="module", params=CASES, ids=[f"{c[0]}-{c[1] or c[2]}" for c in CASES])
def served(request, tmp_path_factory):
    family, quantize, stored, sharded, dtype, layers = request.param
    path = tmp_path_factory.mktemp(family)
    expected = hf_fixtures.write_checkpoint(path, family, sharded=sharded, dtype=stored, quantize=quantize)
    config = server_config(tmp_path_factory, bucket_sizes=(8,),
                           model=ModelConfig(checkpoint=str(path), layers=layers, dtype=dtype, num_devices=1))
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        served_dtype = stored if dtype == "auto" and quantize is None else ("bfloat16" if dtype == "auto" else dtype)
        wanted = [1, 2] if layers else sorted(expected)
        yield handle, path, {i: expected[i] for i in wanted}, NUMPY_DTYPES[served_dtype]
    finally:
        handle.stop(grace=2)


def test_model_info_names_the_model_layers_and_dtype(served):
    handle, path, expected, dtype = served
    with ExpertClient(f"127.0.0.1:{handle.port}") as client:
        info = client.model_info()
    assert [layer.index for layer in info.layers] == sorted(expected)
    assert info.model == str(path)
    assert info.dtype == (expert_pb2.DTYPE_FLOAT32 if dtype == np.float32 else expert_pb2.DTYPE_BFLOAT16)
    for layer in info.layers:
        cfg = handle.engine.layers[layer.index].cfg
        assert (layer.hidden_size, layer.num_experts, layer.topk) == (cfg.hidden_size, cfg.num_experts, cfg.topk)


def test_forward_equals_the_transformers_block_on_every_layer(served):
    handle, path, expected, dtype = served
    rng = np.random.default_rng(5)
    with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
        for index, params in expected.items():
            cfg = handle.engine.layers[index].cfg
            for tokens in (5, 11):  # 11: two parts of bucket 8
                x = rng.standard_normal((tokens, cfg.hidden_size)).astype(dtype)
                result = client.forward(x, layer=index, return_routing=True)
                route = client.route(x, layer=index)
                assert result.output.dtype == dtype
                served_params = {k: v.astype(np.float32 if k in ("router_weight", "expert_bias") else dtype)
                                 for k, v in params.items()}
                kernels, routing = reference_forward(served_params, cfg, x, dtype)
                if dtype == np.float32:
                    want = hf_fixtures.hf_reference(path, index, x, params)
                    np.testing.assert_allclose(result.output, want, rtol=1e-4, atol=1e-5,
                                               err_msg=f"layer {index}, {tokens} tokens")
                else:  # bfloat16 serving: the in-process kernels on the same bf16 weights
                    np.testing.assert_allclose(result.output.astype(np.float32), kernels.astype(np.float32),
                                               rtol=2e-2, atol=2e-2)
                for got in (result.routing, route):
                    np.testing.assert_array_equal(got.topk_ids, routing["topk_ids"])
                    np.testing.assert_allclose(got.topk_weights, routing["topk_weights"], rtol=1e-5)


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
                reference, routing = reference_forward(host_params(loaded, np.float32), loaded.cfg, x, np.float32)
                np.testing.assert_allclose(result.output, reference, rtol=2e-5, atol=2e-6)
                np.testing.assert_array_equal(result.routing.topk_ids, routing["topk_ids"])
    finally:
        handle.stop(grace=2)
