"""The model registry's door: which family a config.json is (top level, text_config, architectures),
its MoE layers, layer descriptions in transformers 4.x and 5.x spellings, the families recognised
but refused (each naming what is missing), and `--dtype auto`'s choices."""
import importlib
import pkgutil
import re

import pytest

from expertd.kernels.config import MoEConfig
from expertd.server import models
from expertd.server.models import dtypes, families
from expertd.server.models.config import ConfigError, HFConfig

BASE = {"hidden_size": 64, "num_hidden_layers": 4}


def test_every_family_module_declares_one_family_and_model_types_are_unique():
    modules = [m.name for m in pkgutil.iter_modules(families.__path__)]
    assert sorted(f.name for f in models.FAMILIES) == sorted(modules)
    for name in modules:
        assert importlib.import_module(f"expertd.server.models.families.{name}").__doc__.strip()
    model_types = [t for f in models.FAMILIES for t in f.model_types]
    assert len(model_types) == len(set(model_types))
    served = {t for f in models.served_families() for t in f.model_types}
    assert {"mixtral", "granitemoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "deepseek_v3",
            "deepseek_v32", "kimi_k2", "kimi_k25", "glm4_moe", "glm_moe_dsa", "minimax_m2", "hunyuan_v1_moe", "dbrx",
            "mistral4", "mistral_large4", "gpt_oss", "deepseek_v4", "glm5_next", "step3p7", "ernie4_5_moe", "llama4",
            "gemma4"} <= served
    assert not served & {"longcat_flash", "phimoe"}


@pytest.mark.parametrize("config, family", [
    ({"model_type": "qwen3_moe"}, "qwen"),
    ({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}, "qwen"),
    ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}, "deepseek_v3"),
    ({"model_type": "mistral3", "text_config": {"model_type": "deepseek_v3"}}, "deepseek_v3"),  # Mistral Large 3
    ({"model_type": "mistral3", "text_config": {"model_type": "mistral_large4"}}, "mistral4"),
    ({"architectures": ["Glm4MoeForCausalLM"]}, "deepseek_v3"),
    ({"model_type": "granitemoe"}, "mixtral"),
    ({"model_type": "gpt_oss"}, "gpt_oss"),
])
def test_family_of(config, family):
    assert models.family_of(config).name == family


def test_unknown_model_is_named_with_the_served_list():
    message = r"unsupported model: model_type 'llama', architectures \['LlamaForCausalLM'\]; expertd serves .*qwen3_moe"
    with pytest.raises(models.UnsupportedModel, match=message + ".*docs/models"):
        models.family_of({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_moe_layer_rules_follow_the_modelling_code():
    assert models.moe_layer_indices({"model_type": "mixtral", "num_hidden_layers": 3}) == [0, 1, 2]
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_local_experts": 8, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
    assert models.moe_layer_indices(qwen) == [1, 5]
    assert models.moe_layer_indices({**qwen, "num_local_experts": 0}) == []
    deepseek = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "first_k_dense_replace": 3, "moe_layer_freq": 2}
    assert models.moe_layer_indices(deepseek) == [4, 6]
    assert models.moe_layer_indices({"model_type": "deepseek_v3", "num_hidden_layers": 5}) == [3, 4]  # HF default 3
    glm5 = {"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "first_k_dense_replace": 3,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}
    assert models.moe_layer_indices(glm5) == [1, 3]  # mlp_layer_types wins over first_k_dense_replace
    assert models.moe_layer_indices({"model_type": "glm4_moe", "num_hidden_layers": 3}) == [1, 2]
    assert models.moe_layer_indices({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 3}}) \
        == [0, 1, 2]
    ernie = {"model_type": "ernie4_5_moe", "num_hidden_layers": 6, "moe_layer_start_index": 1,
             "moe_layer_end_index": -1, "moe_layer_interval": 2}
    assert models.moe_layer_indices(ernie) == [1, 3, 5]
    llama4 = {"model_type": "llama4", "text_config": {"num_hidden_layers": 6, "interleave_moe_layer_step": 2}}
    assert models.moe_layer_indices(llama4) == [1, 3, 5]
    with pytest.raises(ConfigError, match=r"config\['mlp_layer_types'\]\[1\] is 'moe_hash'"):
        models.moe_layer_indices({**glm5, "mlp_layer_types": ["dense", "moe_hash", "dense", "sparse"]})
    with pytest.raises(ConfigError, match=r"must list one string per decoder layer \(4\)"):
        models.moe_layer_indices({**glm5, "mlp_layer_types": ["dense"]})


def test_spellings_of_transformers_4_and_5():
    qwen3 = {**BASE, "model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert models.layer_config({**qwen3, "num_local_experts": 8}, 0).num_experts == 8  # 5.x
    assert models.layer_config({**qwen3, "num_experts": 8}, 0).num_experts == 8  # 4.x
    assert models.layer_config({**qwen3, "num_experts": 8, "num_local_experts": 8}, 0).num_experts == 8
    with pytest.raises(ConfigError, match="two spellings of one setting"):
        models.layer_config({**qwen3, "num_experts": 8, "num_local_experts": 16}, 0)
    mixtral = {**BASE, "model_type": "mixtral", "intermediate_size": 32}
    assert models.layer_config({**mixtral, "num_experts": 4}, 0).num_experts == 4
    assert HFConfig({"torch_dtype": "bfloat16"}).dtype() == "bfloat16"
    assert HFConfig({"dtype": "torch.float32"}).dtype() == "float32"
    assert HFConfig({"text_config": {"dtype": "float16"}, "dtype": "bfloat16"}).dtype() == "float16"


def test_nested_text_config_is_read_first():
    config = {"model_type": "qwen3_5_moe", "hidden_size": 7, "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 16,
        "norm_topk_prob": False}}
    cfg = models.layer_config(config, 0)
    assert (cfg.hidden_size, cfg.num_experts, cfg.shared_intermediate_size, cfg.shared_expert_gate) == (64, 8, 16, True)
    assert not cfg.use_pre_softmax  # Qwen3.5 always renormalises
    with pytest.raises(ConfigError, match=r"config\['text_config'\]\['num_experts'\] \('num_experts' or "
                                          r"'num_local_experts'\) is required for model_type 'qwen3_5_moe'"):
        models.layer_config({**config, "text_config": {**config["text_config"], "num_experts": None}}, 0)


def test_family_layer_descriptions():
    mistral4 = models.layer_config({**BASE, "model_type": "mistral4", "n_routed_experts": 16,
                                    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                    "routed_scaling_factor": 2.0, "norm_topk_prob": True}, 1)
    assert mistral4 == MoEConfig(num_experts=16, topk=4, hidden_size=64, intermediate_size=2048,
                                 score_function="softmax", use_pre_softmax=True, num_groups=4, group_topk=2,
                                 group_score_topk=2, scaling_factor=2.0, norm_topk_prob=True, num_shared_experts=1,
                                 shared_intermediate_size=2048)
    large4 = models.layer_config({"model_type": "mistral3", "text_config": {
        **BASE, "model_type": "mistral_large4", "norm_topk_prob": False, "num_experts_per_tok": 2}}, 1)
    assert large4.norm_topk_prob is True and large4.num_groups is None  # always renorm; n_group 1 = no groups
    hunyuan = {**BASE, "model_type": "hunyuan_v1_moe", "num_experts": [4, 8, 8, 8], "moe_topk": [1, 2, 2, 2],
               "intermediate_size": 32}
    assert (models.layer_config(hunyuan, 0).num_experts, models.layer_config(hunyuan, 1).topk) == (4, 2)
    dbrx = {"model_type": "dbrx", "d_model": 64, "n_layers": 2, "ffn_config": {
        "moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32, "moe_normalize_expert_weights": None}}
    assert models.layer_config(dbrx, 0).use_pre_softmax  # null: the probabilities as they are
    assert models.refusal(dbrx) is None


@pytest.mark.parametrize("config, message", [
    ({"model_type": "longcat_flash"}, "longcat_flash: zero-computation .identity. experts and the E "
                                      r"\+ zero_expert_num router rows"),
    ({"model_type": "phimoe"}, "phimoe: SparseMixer"),
    ({"model_type": "dbrx", "ffn_config": {"moe_normalize_expert_weights": 2}},
     r"dbrx: ffn_config.moe_normalize_expert_weights = 2 .an L_p norm"),
])
def test_recognised_families_refuse_naming_what_is_missing(config, message):
    assert not models.family_of(config).served or config["model_type"] == "dbrx"
    reason = models.refusal(config)
    assert reason is not None and re.search(message, reason), reason


def test_grouped_routers_score_a_group_by_its_top_2_as_transformers_does():
    deepseek = {**BASE, "model_type": "deepseek_v3", "num_experts_per_tok": 6, "n_group": 8, "topk_group": 2}
    cfg = models.layer_config(deepseek, 3)  # 6 // 2 = 3, but the group score is still transformers' top 2
    assert (cfg.num_groups, cfg.group_topk, cfg.group_score_topk) == (8, 2, 2)
    mistral = models.layer_config({**BASE, "model_type": "mistral4", "num_experts_per_tok": 3, "n_group": 4,
                                   "topk_group": 3}, 0)
    assert (mistral.num_groups, mistral.group_topk, mistral.group_score_topk) == (4, 3, 2)
    with pytest.raises(ConfigError, match=r"deepseek_v3: group-limited routing with n_group=8, topk_group=1, 16 "
                                          r"experts and num_experts_per_tok=4 is not servable"):
        models.layer_config({**deepseek, "n_routed_experts": 16, "num_experts_per_tok": 4, "topk_group": 1}, 3)
    with pytest.raises(ConfigError, match="mistral4: group-limited routing with n_group=3"):
        models.layer_config({**BASE, "model_type": "mistral4", "n_group": 3, "topk_group": 1}, 0)  # 128 % 3
    # grouping that keeps every group changes nothing and is dropped
    assert models.layer_config({**deepseek, "topk_group": 8}, 3).num_groups is None


def test_2026_family_layer_descriptions():
    """The families whose semantics came with docs/semantics.md: config.json -> the MoEConfig switches."""
    gpt = models.layer_config({**BASE, "model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4,
                               "intermediate_size": 2880, "swiglu_limit": 7.0}, 0)
    assert (gpt.router_bias, gpt.activation, gpt.swiglu_limit, gpt.swiglu_alpha, gpt.expert_proj_bias,
            gpt.use_pre_softmax) == (True, "swiglu_oai", 7.0, 1.702, True, False)
    v4 = {**BASE, "model_type": "deepseek_v4", "n_routed_experts": 16, "num_experts_per_tok": 2, "vocab_size": 100,
          "moe_intermediate_size": 32, "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]}
    hashed, routed = models.layer_config(v4, 1), models.layer_config(v4, 2)
    assert (hashed.hash_vocab_size, hashed.use_expert_bias, hashed.score_function) == (100, False, "sqrtsoftplus")
    assert (routed.hash_vocab_size, routed.use_expert_bias, routed.swiglu_limit, routed.shared_swiglu_limit,
            routed.scaling_factor) == (0, True, 10.0, 10.0, 1.5)
    legacy = {k: v for k, v in v4.items() if k != "mlp_layer_types"}
    assert [models.layer_config({**legacy, "num_hash_layers": 3}, i).hash_routed for i in range(4)] == \
        [True, True, True, False]
    assert models.moe_layer_indices(v4) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"config\['mlp_layer_types'\]\[0\] is 'dense'; expected 'hash_moe'"):
        models.layer_config({**v4, "mlp_layer_types": ["dense", "moe", "moe", "moe"]}, 0)
    glm = models.layer_config({"model_type": "glm5_next", "text_config": {
        **BASE, "model_type": "glm5_next_text", "n_routed_experts": 16, "num_experts_per_tok": 4,
        "swiglu_limit": 8.0}}, 3)
    assert (glm.swiglu_limit, glm.shared_swiglu_limit, glm.num_groups, glm.use_expert_bias) == (8.0, 8.0, None, True)
    step = {"model_type": "step3p7", "text_config": {
        **BASE, "model_type": "step3p5", "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "share_expert_dim": 16, "swiglu_limits": [0, 7.0, None, 5], "swiglu_limits_shared": [0, 0, 16.0, 4]}}
    assert [(models.layer_config(step, i).swiglu_limit, models.layer_config(step, i).shared_swiglu_limit)
            for i in range(4)] == [(None, None), (7.0, None), (None, 16.0), (5.0, 4.0)]
    assert models.layer_config(step, 1).swiglu_limit_mode == "after_activation"
    ernie = models.layer_config({**BASE, "model_type": "ernie4_5_moe", "moe_num_experts": 8, "moe_k": 2,
                                 "moe_intermediate_size": 32, "moe_norm_min": 1e-12}, 0)
    assert (ernie.use_pre_softmax, ernie.use_expert_bias, ernie.norm_topk_min) == (True, True, 1e-12)
    llama = models.layer_config({"model_type": "llama4", "text_config": {
        **BASE, "model_type": "llama4_text", "num_local_experts": 16, "intermediate_size": 32}}, 0)
    assert (llama.router_weight_on_input, llama.norm_topk_prob, llama.score_function, llama.topk) == \
        (True, False, "sigmoid", 1)
    gemma = models.layer_config({"model_type": "gemma4", "text_config": {
        **BASE, "model_type": "gemma4_text", "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-5}}, 0)
    assert (gemma.router_input_norm, gemma.per_expert_scale, gemma.expert_input_norm, gemma.expert_output_norm,
            gemma.norm_eps, gemma.activation) == (True, True, True, True, 1e-5, "gelu_tanh")


@pytest.mark.parametrize("kwargs, expected", [
    (dict(requested="float32", quantization="fp8"), ("float32", "--dtype float32")),
    (dict(requested="auto", preset=True), ("bfloat16", "presets are served in bfloat16")),
    (dict(requested="auto", quantization="fp8: ...", config_dtype="float32"), ("bfloat16", "quantised checkpoint")),
    (dict(requested="auto", config_dtype="float32", stored_dtype="BF16"), ("float32", "config.json's dtype is")),
    (dict(requested="auto", config_dtype="bfloat16"), ("bfloat16", "config.json's dtype is bfloat16")),
    (dict(requested="auto", config_dtype="float16"), ("bfloat16", "config.json's dtype is float16")),
    (dict(requested="auto", stored_dtype="F32"), ("float32", "expert weights are stored as F32")),
    (dict(requested="auto", stored_dtype="F8_E4M3"), ("bfloat16", "stored as F8_E4M3")),
    (dict(requested="auto"), ("bfloat16", "states no dtype")),
])
def test_dtype_auto_choices(kwargs, expected):
    dtype, why = dtypes.choose(**kwargs)
    assert dtype == expected[0] and expected[1] in why


def test_dtype_must_be_known():
    with pytest.raises(ValueError, match="--dtype must be 'auto' or one of"):
        dtypes.choose("float16")
