"""Model presets (configs of the real shapes, seeded lazy weights) and layer selection."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels.moe import MoEConfig, param_shapes
from expertd.server.models import UnsupportedModel, moe_layer_indices
from expertd.server.models.presets import (
    PRESETS,
    LoadedLayer,
    SeededParams,
    describe_indices,
    load_preset,
    parse_layers,
    preset_hf_config,
)


@pytest.mark.parametrize("spec, expected", [
    ("3", [3]), ("1,3-5", [1, 3, 4, 5]), (" 0 - 2 , 7 ", [0, 1, 2, 7]), ("5,1,1-2", [1, 2, 5]), ("4-4", [4]),
])
def test_parse_layers(spec, expected):
    assert parse_layers(spec) == expected
    assert parse_layers(describe_indices(expected)) == expected


@pytest.mark.parametrize("spec, message", [
    ("", "expected a list"), ("1,,2", "'' in"), ("a", "'a' in"), ("-1", "'-1' in"), ("1-2-3", "'1-2-3'"),
    ("5-3", "ends before it starts"), ("1.5", "'1.5'"),
])
def test_parse_layers_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_layers(spec)


def test_tiny_preset_mixes_router_settings():
    layers = load_preset("tiny")
    assert [layer.index for layer in layers] == [0, 1]
    softmax, sigmoid = (layer.cfg for layer in layers)
    for cfg in (softmax, sigmoid):
        assert (cfg.hidden_size, cfg.num_experts, cfg.topk, cfg.intermediate_size) == (64, 8, 2, 128)
    assert softmax.score_function == "softmax" and not softmax.use_expert_bias and not softmax.has_shared
    assert sigmoid.score_function == "sigmoid" and sigmoid.use_expert_bias
    assert (sigmoid.num_groups, sigmoid.group_topk, sigmoid.scaling_factor) == (2, 1, 2.5)
    assert sigmoid.shared_intermediate_size == 128
    assert [layer.index for layer in load_preset("tiny", num_layers=3)] == [0, 1, 2]
    assert [layer.index for layer in load_preset("tiny", layers="4-5")] == [4, 5]


def test_real_presets_have_the_real_shapes():
    mixtral = load_preset("mixtral-8x7b")
    assert [layer.index for layer in mixtral] == list(range(32))
    assert mixtral[0].cfg == MoEConfig(num_experts=8, topk=2, hidden_size=4096, intermediate_size=14336)

    qwen = load_preset("qwen3-30b-a3b", num_layers=2)
    assert [layer.index for layer in qwen] == [0, 1]
    assert (qwen[0].cfg.num_experts, qwen[0].cfg.topk, qwen[0].cfg.hidden_size, qwen[0].cfg.intermediate_size) \
        == (128, 8, 2048, 768)
    assert qwen[0].cfg.score_function == "softmax" and not qwen[0].cfg.use_pre_softmax  # norm_topk_prob

    deepseek = load_preset("deepseek-v3", num_layers=2, dtype="bfloat16")
    assert [layer.index for layer in deepseek] == [3, 4]  # layers 0-2 are dense in the real model
    assert len(load_preset("deepseek-v3")) == 58
    cfg = deepseek[0].cfg
    assert (cfg.num_experts, cfg.topk, cfg.hidden_size, cfg.intermediate_size) == (256, 8, 7168, 2048)
    assert (cfg.score_function, cfg.num_groups, cfg.group_topk, cfg.scaling_factor) == ("sigmoid", 8, 4, 2.5)
    assert cfg.use_expert_bias and cfg.norm_topk_prob and cfg.shared_intermediate_size == 2048
    # Lazy: nothing was generated, yet shapes and dtypes are known.
    params = deepseek[0].params
    assert isinstance(params, SeededParams) and set(params) == set(param_shapes(cfg))
    assert params.shape_dtype("w_gate").shape == (256, 7168, 2048)
    assert params.shape_dtype("w_gate").dtype == jnp.bfloat16
    assert params.shape_dtype("router_weight").dtype == jnp.float32


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="gpt-5"), "unknown preset 'gpt-5'"),
    (dict(name="deepseek-v3", layers=[1]), r"layers \[1\] of preset deepseek-v3 are not MoE layers.*3-60"),
    (dict(name="deepseek-v3", num_layers=59), "num_layers must be between 1 and 58"),
    (dict(name="mixtral-8x7b", num_layers=0), "num_layers must be between 1 and 32"),
    (dict(name="tiny", num_layers=2, layers=[0]), "either layers or num_layers"),
])
def test_load_preset_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_preset(**kwargs)


def test_seeded_params_are_deterministic_and_seed_dependent():
    layer = load_preset("tiny", dtype="bfloat16")[1]
    params = layer.params
    assert set(params) == set(param_shapes(layer.cfg))
    for name, shape in param_shapes(layer.cfg).items():
        value = params[name]
        assert value.shape == shape and np.all(np.isfinite(value.astype(np.float32)))
        assert value.dtype == (np.float32 if name in ("router_weight", "expert_bias") else jnp.bfloat16)
    again = load_preset("tiny", dtype="bfloat16")[1].params
    np.testing.assert_array_equal(params["w_up"], again["w_up"])
    other_seed = load_preset("tiny", dtype="bfloat16", seed=1)[1].params
    assert not np.array_equal(params["w_up"], other_seed["w_up"])
    # Different tensors and layers get different values; scales are 1/sqrt(fan_in).
    assert not np.array_equal(params["w_gate"], params["w_up"])
    layer3 = load_preset("tiny", layers=[3], dtype="bfloat16")[0].params
    assert not np.array_equal(params["w_up"], layer3["w_up"])
    assert abs(float(np.std(params["w_up"].astype(np.float32))) - 64 ** -0.5) < 0.01


def test_seeded_generation_into_a_sharding_matches_host_values():
    params = load_preset("tiny", dtype="float32")[0].params
    mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    on_mesh = params.generate("w_down", sharding)
    assert on_mesh.sharding == sharding and len(on_mesh.addressable_shards) == 4
    np.testing.assert_array_equal(np.asarray(on_mesh), params["w_down"])
    as_bf16 = params.generate("w_down", dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(as_bf16), params["w_down"].astype(jnp.bfloat16))


def test_moe_layer_rules_follow_the_modelling_code():
    assert moe_layer_indices({"model_type": "mixtral", "num_hidden_layers": 3}) == [0, 1, 2]
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 8,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layer_indices(qwen) == [1, 5]
    assert moe_layer_indices({**qwen, "num_experts": 0}) == []
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    assert moe_layer_indices({**{k: v for k, v in qwen.items() if k != "num_experts"}, "num_local_experts": 8}) \
        == [1, 5]
    deepseek = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "n_routed_experts": 8,
                "first_k_dense_replace": 3, "moe_layer_freq": 2}
    assert moe_layer_indices(deepseek) == [4, 6]
    with pytest.raises(UnsupportedModel, match="unsupported model: model_type 'llama'"):
        moe_layer_indices({"model_type": "llama", "num_hidden_layers": 2})


def test_presets_are_listed_and_layers_are_frozen():
    assert PRESETS == ("tiny", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
    assert preset_hf_config("deepseek-v3")["first_k_dense_replace"] == 3
    layer = load_preset("tiny")[0]
    assert isinstance(layer, LoadedLayer) and layer.source == "preset tiny (seed 0)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.index = 5
