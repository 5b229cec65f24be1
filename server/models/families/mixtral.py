"""Mixtral (`mixtral`, MixtralForCausalLM) and GraniteMoE (`granitemoe`), which computes the same.

MixtralSparseMoeBlock / GraniteMoeMoE: logits = x @ Wr^T; the k largest logits are softmaxed
(= softmax over all E, top-k, renormalised); out = sum_j w_j * SwiGLU_j(x), SwiGLU(x) =
(act(x Wg^T) * (x Wu^T)) Wd^T. No shared expert. Every decoder layer is MoE.

config.json: `num_local_experts` (4.x `num_experts` accepted too), `num_experts_per_tok`,
`intermediate_size` (the expert's I), `hidden_act`.
Tensors (under `model.layers.N.`):
- mixtral: `block_sparse_moe.gate.weight [E, H]`, `block_sparse_moe.experts.j.{w1,w3,w2}.weight`
  (w1 gate, w3 up, w2 down); transformers 5's in-memory names `mlp.gate.weight`,
  `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]` are read too.
- granitemoe: `block_sparse_moe.router.layer.weight [E, H]`, fused
  `block_sparse_moe.input_linear.weight [E, 2I, H]` (gate rows first: the first chunk is activated),
  `block_sparse_moe.output_linear.weight [E, H, I]`.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, FusedRows, LayerTensors, fused_rows, per_expert


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_local_experts", "num_experts", default=8),
                     topk=c.integer("num_experts_per_tok", default=2), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("intermediate_size"), score_function="softmax",
                     use_pre_softmax=False, activation=c.activation())


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    if c.model_type == "granitemoe" or c.text_model_type == "granitemoe":
        block = "block_sparse_moe"
        return (LayerTensors(f"{block}.router.layer.weight",
                             FusedRows(f"{block}.input_linear.weight", f"{block}.output_linear.weight")),)
    return (LayerTensors("block_sparse_moe.gate.weight", per_expert("block_sparse_moe", ("w1", "w3", "w2"))),
            LayerTensors("mlp.gate.weight", fused_rows("mlp")))


FAMILY = Family(
    name="mixtral", model_types=("mixtral", "granitemoe"),
    architectures=("MixtralForCausalLM", "GraniteMoeForCausalLM"),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="softmax over the top-k logits (= softmax, top-k, renormalise)", formats="BF16, FP32")
