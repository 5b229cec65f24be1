"""The DeepSeek-V3 router group: DeepSeek-V3 / R1 (`deepseek_v3`), DeepSeek-V3.2 (`deepseek_v32`),
Kimi-K2 (`kimi_k2`) and K2.5 / K2.6 (`kimi_k25`, decoder keys under `text_config`), GLM-4.5 /
4.6 / 4.7 (`glm4_moe`), GLM-5 (`glm_moe_dsa`), and Mistral Large 3 (a `text_config` of model_type
`deepseek_v3`).

DeepseekV3MoE (and Glm4MoeMoE, GlmMoeDsaMoE, which copy it): s = sigmoid(x @ Wr^T) in fp32;
selection on s + e_score_correction_bias, limited to the `topk_group` best of `n_group` groups
(group score = the sum of its top 2 biased scores; experts of dropped groups are masked); the
weights are the unbiased s of the k chosen, divided by their sum (+1e-20) if `norm_topk_prob`,
times `routed_scaling_factor`; out = sum_j w_j * SwiGLU_j(x) + SwiGLU_shared(x), the shared MLP
ungated of size n_shared_experts x moe_intermediate_size.
expertd: group_score_topk=2 (transformers' top-2 group score); GLM and Kimi use one group (no
grouping, the group fields left out). transformers masks dropped groups with 0, expertd with -inf:
the same choice unless a kept expert's biased score is negative.

MoE layers: `mlp_layer_types[i] == "sparse"` where config.json has it (V3.2, GLM-5), else
i >= `first_k_dense_replace` (and, DeepSeek, i % `moe_layer_freq` == 0).
config.json: `n_routed_experts` (5.x also reads `num_local_experts`), `num_experts_per_tok`,
`moe_intermediate_size`, `n_shared_experts`, `n_group`, `topk_group`, `routed_scaling_factor`,
`norm_topk_prob`, `scoring_func` (sigmoid only); missing keys take the transformers defaults.
Tensors (under `model.layers.N.`; Kimi-K2.5 `language_model.model.layers.N.`): `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias [E]` (fp32), `mlp.experts.j.{gate,up,down}_proj.weight` (or
fused `mlp.experts.gate_up_proj`), `mlp.shared_experts.{gate,up,down}_proj.weight`.
Official formats: FP8 e4m3 with 128x128 `weight_scale_inv` blocks (DeepSeek, Kimi-K2, GLM FP8),
INT4 compressed-tensors experts (Kimi-K2-Thinking / K2.5 / K2.6), BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig, effective_groups, sparse_from
from expertd.server.models.family import Family, LayerTensors, fused_rows, per_expert, shared_mlp

# transformers defaults: experts, top-k, expert I, shared experts, n_group, topk_group, scaling, first dense
_DEEPSEEK = dict(e=256, k=8, i=2048, shared=1, n_group=8, topk_group=4, scaling=2.5, first=3)
_GLM = dict(e=128, k=8, i=1408, shared=1, n_group=1, topk_group=1, scaling=1.0, first=1)
_DEFAULTS = {"glm4_moe": _GLM, "glm_moe_dsa": {**_GLM, "first": 3}, "glm5_next": {**_GLM, "first": 3},
             "glm5_next_text": {**_GLM, "first": 3}}
_GLM_TYPES = ("glm4_moe", "glm_moe_dsa", "glm5_next", "glm5_next_text")


def _defaults(c: HFConfig) -> tuple[str, dict]:
    for model_type in (c.text_model_type, c.model_type):
        if model_type in _DEFAULTS:
            return model_type, _DEFAULTS[model_type]
    return c.text_model_type or c.model_type or "deepseek_v3", _DEEPSEEK


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    family, d = _defaults(c)
    scoring = c.get("scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{c.where('scoring_func')} must be 'sigmoid' for {family}, got {scoring!r}")
    k = c.integer("num_experts_per_tok", default=d["k"])
    inter = c.integer("moe_intermediate_size", default=d["i"])
    n_shared = c.integer("n_shared_experts", default=d["shared"], minimum=0)
    e = c.integer("n_routed_experts", "num_local_experts", default=d["e"])
    groups = effective_groups(c, family, e, k, n_group_default=d["n_group"], topk_group_default=d["topk_group"])
    return MoEConfig(num_experts=e, topk=k,
                     hidden_size=c.integer("hidden_size"), intermediate_size=inter, score_function="sigmoid",
                     use_expert_bias=True, norm_topk_prob=c.flag("norm_topk_prob", default=True),
                     scaling_factor=c.number("routed_scaling_factor", default=d["scaling"]),
                     num_shared_experts=n_shared, shared_intermediate_size=inter * n_shared,
                     activation=c.activation(), **groups)


def moe_layers(c: HFConfig) -> list[int]:
    family, d = _defaults(c)
    return sparse_from(c, first_dense_default=d["first"], freq_key=None if family in _GLM_TYPES else "moe_layer_freq")


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    shared = shared_mlp("mlp.shared_experts")
    bias = "mlp.gate.e_score_correction_bias"
    return (LayerTensors("mlp.gate.weight", per_expert("mlp"), bias=bias, shared=shared),
            LayerTensors("mlp.gate.weight", fused_rows("mlp"), bias=bias, shared=shared))


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm4_moe", "glm_moe_dsa"),
    architectures=("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM",
                   "KimiK25ForConditionalGeneration"),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="sigmoid; top-k of score + bias within the topk_group best of n_group groups; unbiased weights, "
           "renormalised if norm_topk_prob, x routed_scaling_factor",
    shared="n_shared_experts x moe_intermediate_size, ungated",
    formats="BF16, FP8 128x128 block (float or ue8m0 scales), INT4 compressed-tensors (Kimi)")
