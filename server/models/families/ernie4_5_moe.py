"""ERNIE 4.5 MoE (`ernie4_5_moe`, Ernie4_5_MoeForCausalLM).

Ernie4_5_MoeSparseMoeBlock (modeling_ernie4_5_moe.py): p = softmax(x @ Wr^T) in fp32; top-k of
p + e_score_correction_bias (selection only); weights = p of the k chosen / max(sum,
`moe_norm_min` (1e-12)); out = sum_j w_j * SwiGLU_j(x) + SwiGLU_shared(x)
(`moe_num_shared_experts` x moe_intermediate_size, ungated). MoE layers: (i + 1) %
`moe_layer_interval` == 0 and `moe_layer_start_index` <= i <= `moe_layer_end_index` (-1: the last).
expertd: softmax with use_pre_softmax, use_expert_bias (selection on probabilities + bias),
norm_topk_prob, norm_topk_min = moe_norm_min.

Tensors (under `model.layers.N.`): `mlp.gate.weight`, `mlp.moe_statics.e_score_correction_bias
[1, E]`, `mlp.experts.j.{gate,up,down}_proj.weight`, `mlp.shared_experts.*_proj.weight`. BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, LayerTensors, per_expert, shared_mlp


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    inter = c.integer("moe_intermediate_size")
    shared = c.integer("moe_num_shared_experts", default=0, minimum=0)
    return MoEConfig(num_experts=c.integer("moe_num_experts"), topk=c.integer("moe_k"),
                     hidden_size=c.integer("hidden_size"), intermediate_size=inter, score_function="softmax",
                     use_pre_softmax=True, use_expert_bias=True, norm_topk_prob=True,
                     norm_topk_min=c.number("moe_norm_min", default=1e-12), num_shared_experts=shared,
                     shared_intermediate_size=inter * shared, activation=c.activation())


def moe_layers(c: HFConfig) -> list[int]:
    n = c.num_layers()
    start = c.integer("moe_layer_start_index", default=0, minimum=0)
    end = c.integer("moe_layer_end_index", default=-1, minimum=-1)
    end = n - 1 if end == -1 else end
    interval = c.integer("moe_layer_interval", default=1)
    return [i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end]


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("mlp.gate.weight", per_expert("mlp"), bias="mlp.moe_statics.e_score_correction_bias",
                         shared=shared_mlp("mlp.shared_experts")),)


FAMILY = Family(
    name="ernie4_5_moe", model_types=("ernie4_5_moe",), architectures=("Ernie4_5_MoeForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="softmax; top-k of probability + bias; / max(sum, moe_norm_min)",
    shared="moe_num_shared_experts x moe_intermediate_size, ungated")
