"""moe_config_from_hf (the registry's layer_config): each family's config.json (Hugging Face keys
and defaults) -> MoEConfig, and errors that name the key."""
import pytest

from expertd.server.models.hf_config import moe_config_from_hf


def test_families():
    mixtral = moe_config_from_hf(dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                      num_local_experts=8, num_experts_per_tok=2, hidden_act="silu"))
    assert (mixtral.num_experts, mixtral.topk, mixtral.intermediate_size) == (8, 2, 14336)
    assert mixtral.score_function == "softmax" and not mixtral.use_pre_softmax and not mixtral.has_shared

    qwen2 = moe_config_from_hf(dict(model_type="qwen2_moe", hidden_size=2048, num_experts=60,
                                    num_experts_per_tok=4, moe_intermediate_size=1408,
                                    shared_expert_intermediate_size=5632, norm_topk_prob=False))
    assert qwen2.use_pre_softmax and qwen2.shared_expert_gate and qwen2.shared_intermediate_size == 5632
    assert qwen2.intermediate_size == 1408 and qwen2.num_shared_experts == 1

    qwen3 = moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=2048, num_experts=128,
                                    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True))
    assert not qwen3.use_pre_softmax and not qwen3.has_shared and qwen3.num_experts == 128
    assert moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=64)).use_pre_softmax  # HF default
    # transformers 5 writes Qwen3MoeConfig's expert count as num_local_experts
    assert moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=64, num_local_experts=16)).num_experts == 16

    ds = moe_config_from_hf(dict(model_type="deepseek_v3", hidden_size=7168, n_routed_experts=256,
                                 num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8,
                                 topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                                 n_shared_experts=1, scoring_func="sigmoid", topk_method="noaux_tc"))
    assert (ds.score_function, ds.use_expert_bias, ds.num_groups, ds.group_topk) == ("sigmoid", True, 8, 4)
    assert ds.norm_topk_prob is True and ds.scaling_factor == 2.5
    assert (ds.num_shared_experts, ds.shared_intermediate_size, ds.shared_expert_gate) == (1, 2048, False)
    assert moe_config_from_hf(dict(model_type="deepseek_v3", hidden_size=7168)) == ds  # HF defaults


@pytest.mark.parametrize("config,match", [
    (dict(model_type="llama", hidden_size=8), "model_type"),
    (dict(model_type="mixtral", intermediate_size=8), "hidden_size"),
    (dict(model_type="mixtral", hidden_size=8, intermediate_size=8, hidden_act="relu"), "hidden_act"),
    (dict(model_type="deepseek_v3", hidden_size=8, n_routed_experts=16, num_experts_per_tok=8, topk_group=1),
     "topk_group"),
    (dict(model_type="deepseek_v3", hidden_size=8, scoring_func="softmax"), "scoring_func"),
])
def test_errors_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        moe_config_from_hf(config)


def test_config_must_be_a_dict():
    with pytest.raises(ValueError, match="config must be a dict"):
        moe_config_from_hf([("model_type", "mixtral")])
