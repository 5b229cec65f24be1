"""MiniMax-M2 (`minimax_m2`).

MiniMaxM2SparseMoeBlock: s = sigmoid(x @ Wr^T) in fp32; top-k of s + e_score_correction_bias
(the bias only selects); weights = the unbiased s of the k chosen divided by their sum; no scaling,
no groups; out = sum_j w_j * SwiGLU_j(x). No shared expert. Every decoder layer is MoE.
expertd: sigmoid, use_expert_bias, norm_topk_prob=True (it adds 1e-20 to the sum).

config.json: `num_local_experts` (`num_experts`), `num_experts_per_tok`, `intermediate_size`
(the expert's I), `scoring_func` (sigmoid only, where present).
Tensors (under `model.layers.N.`): `block_sparse_moe.gate.weight [E, H]`,
`block_sparse_moe.e_score_correction_bias [E]` (in the block, not the gate),
`block_sparse_moe.experts.j.{w1,w3,w2}.weight`; transformers 5's in-memory `mlp.*` names with
fused `mlp.experts.gate_up_proj` are read too. Official format: FP8 e4m3 with 128x128 block scales
(`weight_scale_inv`), the router and norms left in BF16 (`ignored_layers` / `modules_to_not_convert`).
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig
from expertd.server.models.family import Family, LayerTensors, fused_rows, per_expert


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    scoring = c.get("scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{c.where('scoring_func')} must be 'sigmoid' for minimax_m2, got {scoring!r}")
    return MoEConfig(num_experts=c.integer("num_local_experts", "num_experts", default=256),
                     topk=c.integer("num_experts_per_tok", default=8), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("intermediate_size"), score_function="sigmoid",
                     use_expert_bias=True, norm_topk_prob=True, activation=c.activation())


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("block_sparse_moe.gate.weight", per_expert("block_sparse_moe", ("w1", "w3", "w2")),
                         bias="block_sparse_moe.e_score_correction_bias"),
            LayerTensors("mlp.gate.weight", fused_rows("mlp"), bias="mlp.e_score_correction_bias"))


FAMILY = Family(
    name="minimax_m2", model_types=("minimax_m2",), architectures=("MiniMaxM2ForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="sigmoid; top-k of score + bias; unbiased weights renormalised; no scaling",
    formats="FP8 128x128 block, BF16")
