"""Every kind of layer answers over the same-host channel exactly what it answers over gRPC: tiny
checkpoints of families with different layer kinds (a hash-routed layer with token ids, router bias
and interleaved biases, a router input norm and per-expert scales, shared experts), served in fp32
and bf16 by one in-process server each, Forward (fp32 and bf16 inputs, routing too) and Route."""
import dataclasses

import hf_fixtures
import ml_dtypes
import numpy as np
import pytest
from service_support import server_config

from expertd.client import ExpertClient
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

CASES = [("deepseek_v4", "float32"), ("gpt_oss", "float32"), ("gemma4", "bfloat16"), ("glm5_next", "bfloat16")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def served(request, tmp_path_factory):
    family, dtype = request.param
    path = tmp_path_factory.mktemp(family)
    hf_fixtures.write_checkpoint(path, family, dtype="float32")
    config = dataclasses.replace(
        server_config(tmp_path_factory, bucket_sizes=(8,), model=ModelConfig(checkpoint=str(path), dtype=dtype,
                                                                               num_devices=1)),
        shm_channel=str(path / "channel.sock"))
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as over_grpc, \
                ExpertClient(f"shm://{config.shm_channel}", timeout=60) as over_shm:
            yield handle, over_grpc, over_shm
    finally:
        handle.stop(grace=2)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_every_layer_answers_over_the_channel_what_it_answers_over_grpc(served, dtype):
    handle, over_grpc, over_shm = served
    assert over_shm.model_info() == over_grpc.model_info()
    rng = np.random.default_rng(5)
    for index, layer in handle.engine.layers.items():
        cfg = layer.cfg
        for tokens in (3, 11):
            x = rng.standard_normal((tokens, cfg.hidden_size)).astype(dtype)
            ids = rng.integers(0, cfg.hash_vocab_size, tokens).astype(np.int32) if cfg.hash_routed else None
            a, b = (c.forward(x, layer=index, return_routing=True, token_ids=ids) for c in (over_grpc, over_shm))
            assert b.output.dtype == x.dtype
            np.testing.assert_array_equal(b.output, a.output, err_msg=f"layer {index}, {tokens} tokens")
            np.testing.assert_array_equal(b.routing.topk_ids, a.routing.topk_ids)
            np.testing.assert_array_equal(b.routing.topk_weights, a.routing.topk_weights)
            a, b = (c.route(x, layer=index, token_ids=ids) for c in (over_grpc, over_shm))
            np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
            np.testing.assert_array_equal(b.topk_weights, a.topk_weights)
