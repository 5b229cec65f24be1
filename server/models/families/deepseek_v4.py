"""DeepSeek-V4 Flash / Pro (`deepseek_v4`): recognised, refused at start.

The MoE block: s = sqrt(softplus(x @ Wr^T)); top-k of s + bias (selection only), no groups;
weights = the unbiased s renormalised, times `routed_scaling_factor` (1.5); experts and the one
ungated shared expert (moe_intermediate_size) use the clamped SwiGLU silu(min(g, L)) *
clip(u, -L, L), L = `swiglu_limit` (10). The first layers (`mlp_layer_types` "hash_moe", legacy
`num_hash_layers`) route by token id: ids = tid2eid[input_ids]. Every layer is MoE.
Missing: the clamped SwiGLU (all layers) and hash routing by token id (needs input ids).

Tensors (DeepSeek's layout, no model prefix): `layers.N.ffn.gate.weight`, `layers.N.ffn.gate.bias`
(selection bias), `ffn.gate.tid2eid` (I64 [vocab, k]), `layers.N.ffn.experts.j.{w1,w3,w2}.weight`,
`ffn.shared_experts.{w1,w3,w2}.weight`. Official format: experts FP4 e2m1 with ue8m0 scales per
32 inputs (`.scale`), the rest FP8 128x128 with ue8m0 scales; `expert_dtype: fp4`.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, LayerTensors, PerExpert, shared_mlp


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    inter = c.integer("moe_intermediate_size")
    return MoEConfig(num_experts=c.integer("n_routed_experts", "num_local_experts"),
                     topk=c.integer("num_experts_per_tok"), hidden_size=c.integer("hidden_size"),
                     intermediate_size=inter, score_function="sqrtsoftplus", use_expert_bias=True,
                     norm_topk_prob=True, scaling_factor=c.number("routed_scaling_factor", default=1.5),
                     num_shared_experts=1, shared_intermediate_size=inter)


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    experts = PerExpert("ffn.experts.{j}.w1.weight", "ffn.experts.{j}.w3.weight", "ffn.experts.{j}.w2.weight")
    return (LayerTensors("ffn.gate.weight", experts, bias="ffn.gate.bias",
                         shared=shared_mlp("ffn.shared_experts", ("w1", "w3", "w2"))),)


def missing(c: HFConfig) -> str:
    return ("deepseek_v4: the clamped SwiGLU silu(min(g, L)) * clip(u, -L, L) (swiglu_limit) on routed and shared "
            "experts, and hash routing by token id on its hash_moe layers, are not supported yet")


FAMILY = Family(
    name="deepseek_v4", model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing, served=False,
    router="sqrtsoftplus; top-k of score + bias; renormalised; x routed_scaling_factor; hash layers by token id",
    activation="clamped SwiGLU", shared="1 x moe_intermediate_size, ungated, clamped",
    formats="FP4 e2m1 experts + FP8 128x128 (ue8m0 scales)")
