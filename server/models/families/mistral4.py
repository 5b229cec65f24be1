"""Mistral Small 4 (`mistral4`) and Mistral Large 4 (`mistral_large4`, decoder keys under `text_config`).

Mistral4MoE (transformers' route_tokens_to_experts): p = softmax(x @ Wr^T) over all E; groups are
scored on the probabilities (sum of each group's top 2), the `topk_group` best kept, the others
masked; top-k of p; weights = those p, divided by their sum (+1e-20) if `norm_topk_prob`
(Mistral Large 4: always), times `routed_scaling_factor`; out = sum_j w_j * SwiGLU_j(x) +
SwiGLU_shared(x), the shared MLP ungated of size n_shared_experts x moe_intermediate_size.
expertd: score_function softmax with use_pre_softmax (groups on the probabilities), norm_topk_prob,
scaling_factor, and group_score_topk=2 (transformers' top-2 group score) for a grouped config.

MoE layers: `mlp_layer_types[i] == "sparse"` where given, else i >= `first_k_dense_replace`.
config.json: `n_routed_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
`n_shared_experts`, `n_group`, `topk_group`, `routed_scaling_factor`, `norm_topk_prob`.
Tensors: mistral4 under `model.layers.N.`: `mlp.gate.weight`, fused
`mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first), `mlp.experts.down_proj [E, H, I]`,
`mlp.shared_experts.{gate,up,down}_proj.weight`; mistral_large4 in Mistral's own layout, no
model prefix: `layers.N.gate.weight`, `layers.N.experts.j.{w1,w3,w2}.weight`,
`layers.N.shared_experts.{w1,w3,w2}.weight`. Formats: BF16, FP8 (per-tensor / per-row
`.qscale_weight` scales, or 128x128 blocks).
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig, effective_groups, sparse_from
from expertd.server.models.family import Family, LayerTensors, PerExpert, fused_rows, per_expert, shared_mlp


def _large(c: HFConfig) -> bool:
    return "mistral_large4" in (c.model_type, c.text_model_type)


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    family = "mistral_large4" if _large(c) else "mistral4"
    k = c.integer("num_experts_per_tok", default=4)
    inter = c.integer("moe_intermediate_size", default=2048)
    n_shared = c.integer("n_shared_experts", default=1, minimum=0)
    renorm = True if _large(c) else c.flag("norm_topk_prob", default=True)
    e = c.integer("n_routed_experts", "num_local_experts", default=128)
    return MoEConfig(num_experts=e, topk=k,
                     hidden_size=c.integer("hidden_size"), intermediate_size=inter, score_function="softmax",
                     use_pre_softmax=True, norm_topk_prob=renorm,
                     scaling_factor=c.number("routed_scaling_factor", default=1.0),
                     num_shared_experts=n_shared, shared_intermediate_size=inter * n_shared,
                     activation=c.activation(),
                     **effective_groups(c, family, e, k, n_group_default=1, topk_group_default=1))


def moe_layers(c: HFConfig) -> list[int]:
    return sparse_from(c, first_dense_default=0, freq_key=None)


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    mistral = LayerTensors("gate.weight", PerExpert("experts.{j}.w1.weight", "experts.{j}.w3.weight",
                                                    "experts.{j}.w2.weight"),
                           shared=shared_mlp("shared_experts", ("w1", "w3", "w2")))
    shared = shared_mlp("mlp.shared_experts")
    transformers = (LayerTensors("mlp.gate.weight", fused_rows("mlp"), shared=shared),
                    LayerTensors("mlp.gate.weight", per_expert("mlp"), shared=shared))
    return (mistral, *transformers) if _large(c) else (*transformers, mistral)


FAMILY = Family(
    name="mistral4", model_types=("mistral4", "mistral_large4"),
    architectures=("Mistral4ForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="softmax over E; groups scored on probabilities (top 2); top-k; renormalised if norm_topk_prob "
           "(Large 4: always); x routed_scaling_factor",
    shared="n_shared_experts x moe_intermediate_size, ungated", formats="BF16, FP8 (.qscale_weight or 128x128)")
