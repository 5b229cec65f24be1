"""Block-scaled FP8 checkpoints with their routed experts kept FP8 (what `--dtype auto` serves on
one GPU, `engine.build.keeps_fp8`): the loader keeps the stored codes and scales (per-expert,
fused gate_up and stacked layouts), they equal the dense load once dequantised, the layer on them
through the kernels that read FP8 matches the dense load's within bf16's tolerance, a checkpoint
that is not block-scaled FP8 loads dense, and the rule keeps FP8 only for auto on one GPU."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import write_checkpoint

from expertd.kernels import experts, moe
from expertd.kernels.moe_reference import assert_close_to_oracle, moe_oracle
from expertd.server.config import ModelConfig
from expertd.server.engine import build
from expertd.server.models.checkpoint import keeps_fp8, load_checkpoint, plan_checkpoint

BLOCK = (16, 16)  # the fixtures' H = 16, I = 32: one and two blocks
LAYOUTS = ("deepseek_v3", "qwen3_5_moe", "step3p7")  # per-expert Linears, fused gate_up, stacked [E, I, H]


@pytest.mark.parametrize("family", LAYOUTS)
def test_kept_fp8_experts_are_the_stored_codes_and_compute_the_dense_layer(tmp_path, family):
    write_checkpoint(tmp_path, family, num_layers=3, quantize="fp8", dtype="bfloat16", block=BLOCK)
    assert keeps_fp8(plan_checkpoint(tmp_path))
    kept = load_checkpoint(tmp_path, dtype="bfloat16", keep_fp8=True)
    dense = load_checkpoint(tmp_path, dtype="float32")
    layer_fp8, layer_dense = kept[-1], dense[-1]
    for name in moe.EXPERT_WEIGHTS:
        w = layer_fp8.params[name]
        assert isinstance(w, experts.Fp8BlockWeights) and w.block == 16 and w.codes.dtype == jnp.float8_e4m3fn
        assert w.logical_shape == layer_dense.params[name].shape
        # exact: the codes times their block's fp32 scale is what the dense loader computes
        np.testing.assert_array_equal(np.asarray(experts.dequantize(w, jnp.float32)), layer_dense.params[name])
    for name, value in layer_dense.params.items():  # everything else as the bf16 load holds it
        if name not in moe.EXPERT_WEIGHTS:
            assert layer_fp8.params[name].shape == value.shape, name
    cfg = layer_fp8.cfg
    params = moe.MoEParams.from_dict({k: jax.tree.map(jnp.asarray, v) for k, v in layer_fp8.params.items()}, cfg)
    x = jax.random.normal(jax.random.key(0), (6, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    run = jax.jit(lambda p, v: [moe.moe_layer(p, v, cfg, backend=b) for b in ("pallas", "tokamax", "auto")])
    ref = moe_oracle({k: (experts.dequantize(v, jnp.float32) if experts.is_fp8(v) else v)
                      for k, v in params.items()}, x, cfg)
    for backend, out in zip(("pallas", "tokamax", "auto"), run(params, x)):
        assert_close_to_oracle(out, ref, jnp.bfloat16, what=f"{family} {backend} on kept FP8")


def test_checkpoints_not_block_scaled_fp8_load_dense(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp4", dtype="bfloat16")
    assert not keeps_fp8(plan_checkpoint(tmp_path))
    for layer in load_checkpoint(tmp_path, dtype="bfloat16", keep_fp8=True):  # falls back per layer
        assert not any(experts.is_fp8(v) for v in layer.params.values())


def test_auto_keeps_fp8_on_one_gpu_only(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16", block=BLOCK)
    gpu, cpu = types.SimpleNamespace(platform="gpu"), types.SimpleNamespace(platform="cpu")
    model = ModelConfig(checkpoint=str(tmp_path))
    assert build.keeps_fp8(model, [gpu])
    assert not build.keeps_fp8(model, [cpu])  # the CPU dequantises at load
    assert not build.keeps_fp8(model, [gpu, gpu])  # the expert-parallel layer reads dense weights
    assert not build.keeps_fp8(dataclasses.replace(model, dtype="bfloat16"), [gpu])
    assert not build.keeps_fp8(dataclasses.replace(model, backend="ragged_dot"), [gpu])
    assert experts.choose_backend(8, 8, 16, 32, jnp.bfloat16, "gpu", fp8_weights=True) == "pallas"


def test_the_engine_places_and_serves_kept_fp8_experts(tmp_path):
    """On one device the engine places the codes and scales as they are and its forward step reads
    them (pallas here, interpreted; on a GPU auto picks it), matching the engine over the dense load."""
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16", block=BLOCK)
    layers = load_checkpoint(tmp_path, dtype="bfloat16", num_layers=1, keep_fp8=True)
    served = build.build_engine(layers, buckets=(8,), dtype="bfloat16", devices=1, backend="pallas",
                                huge_pages=False)
    dense = build.build_engine(load_checkpoint(tmp_path, dtype="bfloat16", num_layers=1), buckets=(8,),
                               dtype="bfloat16", devices=1, backend="pallas", huge_pages=False)
    index = layers[0].index
    assert served.info()["layers"][0]["params"]["w_gate"]["dtype"].startswith("float8_e4m3fn (16x16 block scales")
    w = served.engine.layers[index].params.w_gate
    assert experts.is_fp8(w) and isinstance(w.codes, jax.Array) and w.codes.dtype == jnp.float8_e4m3fn
    x = np.asarray(jax.random.normal(jax.random.key(1), (8, layers[0].cfg.hidden_size)), jnp.bfloat16)
    got, want = served.engine.forward(index, x, 5), dense.engine.forward(index, x, 5)
    np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
    scale = max(1.0, float(np.abs(np.asarray(want.output, np.float32)).max()))
    assert np.abs(np.asarray(got.output, np.float32) - np.asarray(want.output, np.float32)).max() <= 3e-2 * scale
