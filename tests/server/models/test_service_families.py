"""The families whose semantics came in 2026 (docs/semantics.md), end to end: a tiny checkpoint with
the family's real config keys and tensor names (tests/hf_fixtures.py) served by the real server
(`expertd serve --checkpoint`'s start-up, in process) and read with the real client. On every MoE
layer and for two token counts, Forward equals the family's transformers block restated in float64
(tests/hf_oracle.py) within fp32 tolerance, and Route agrees with Forward's routing.

DeepSeek-V4's hash-routed layer (`hash_moe`, expert ids = tid2eid[token id]) needs each token's id,
which the wire does not carry yet: over gRPC it answers INVALID_ARGUMENT naming `token_ids`, and it
is checked at the engine (`Engine.forward(..., token_ids=)`) of the same running server.
"""
import hf_fixtures
import numpy as np
import pytest
from service_support import server_config

from expertd.client import ExpertClient
from expertd.client.errors import InvalidArgumentError
from expertd.server.app import create_server
from expertd.server.config import ModelConfig
from expertd.server.engine import api
from expertd.server.errors import InvalidRequest

# (family, quantize, storage dtype, sharded): what each case adds
CASES = [
    ("gpt_oss", "mxfp4", "float32", False),      # router bias, interleaved biases, swiglu_oai; MXFP4 experts
    ("deepseek_v4", None, "float32", True),      # bare layers.N., sqrtsoftplus, clamped SwiGLU, hash layer 0
    ("glm5_next", None, "float32", False),       # text_config, model.language_model., clamped routed + shared
    ("step3p7", None, "float32", False),         # stacked [E, I, H], clamp after the activation, per-layer limits
    ("ernie4_5_moe", None, "float32", False),    # selection bias on softmax probabilities [1, E], floored renorm
    ("llama4", None, "float32", True),           # language_model.model., [E, H, 2I] halves, weight on the input
    ("gemma4", None, "float32", False),          # router input norm and scale, per-expert scale, branch norms
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def served(request, tmp_path_factory):
    family, quantize, stored, sharded = request.param
    path = tmp_path_factory.mktemp(family)
    expected = hf_fixtures.write_checkpoint(path, family, sharded=sharded, dtype=stored, quantize=quantize)
    config = server_config(tmp_path_factory, bucket_sizes=(8,),
                           model=ModelConfig(checkpoint=str(path), dtype="float32", num_devices=1))
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        yield handle, path, expected
    finally:
        handle.stop(grace=2)


def test_every_layer_of_the_checkpoint_is_served(served):
    handle, path, expected = served
    with ExpertClient(f"127.0.0.1:{handle.port}") as client:
        info = client.model_info()
    assert [layer.index for layer in info.layers] == sorted(expected) and info.model == str(path)


def test_forward_equals_the_transformers_block_on_every_layer(served):
    handle, path, expected = served
    rng = np.random.default_rng(11)
    with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
        for index, params in expected.items():
            cfg = handle.engine.layers[index].cfg
            for tokens in (5, 11):  # 11: two parts of bucket 8
                x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
                if cfg.hash_routed:  # the wire has no token ids yet: refused, then checked at the engine
                    with pytest.raises(InvalidArgumentError, match=f"token_ids: required: layer {index} is "
                                                                   "hash-routed") as error:
                        client.forward(x, layer=index)
                    assert [field for field, _ in error.value.field_violations] == ["token_ids"]
                    ids = rng.integers(0, cfg.hash_vocab_size, tokens)
                    want = hf_fixtures.hf_reference(path, index, x, params, token_ids=ids)
                    got = np.concatenate([handle.engine.forward(index, api.pad_rows([part], 8), len(part),
                                                                token_ids=part_ids).output
                                          for part, part_ids in ((x[:8], ids[:8]), (x[8:], ids[8:])) if len(part)])
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"layer {index} (hash)")
                    with pytest.raises(InvalidRequest, match=r"token_ids\[1\] = 32 is out of the vocabulary \[0, 32\)"):
                        handle.engine.forward(index, api.pad_rows([x[:3]], 8), 3, token_ids=np.array([0, 32, 1]))
                    continue
                result = client.forward(x, layer=index, return_routing=True)
                want = hf_fixtures.hf_reference(path, index, x, params)
                np.testing.assert_allclose(result.output, want, rtol=1e-4, atol=1e-5,
                                           err_msg=f"layer {index}, {tokens} tokens")
                route = client.route(x, layer=index)
                np.testing.assert_array_equal(route.topk_ids, result.routing.topk_ids)
                np.testing.assert_allclose(route.topk_weights, result.routing.topk_weights, rtol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v4", "gpt_oss", "gemma4"])
def test_expert_parallel_server_computes_the_same_block(tmp_path_factory, family):
    """Four simulated CPU devices: the experts (and their biases) split over the ranks; the hash layer's
    token ids travel with their tokens (engine level)."""
    path = tmp_path_factory.mktemp(f"{family}-ep")
    expected = hf_fixtures.write_checkpoint(path, family)
    config = server_config(tmp_path_factory, bucket_sizes=(8,),
                           model=ModelConfig(checkpoint=str(path), dtype="float32", num_devices=4))
    handle = create_server(config)
    rng = np.random.default_rng(3)
    try:
        handle.wait_ready(timeout=300)
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
            assert client.model_info().mesh.num_devices == 4
            for index, params in expected.items():
                cfg = handle.engine.layers[index].cfg
                x = rng.standard_normal((7, cfg.hidden_size)).astype(np.float32)
                ids = rng.integers(0, cfg.hash_vocab_size, 7) if cfg.hash_routed else None
                want = hf_fixtures.hf_reference(path, index, x, params, token_ids=ids)
                if cfg.hash_routed:
                    got = handle.engine.forward(index, api.pad_rows([x], 8), 7, token_ids=ids).output
                else:
                    got = client.forward(x, layer=index)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{family} layer {index}")
    finally:
        handle.stop(grace=2)
