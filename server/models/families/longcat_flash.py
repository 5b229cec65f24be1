"""LongCat-Flash (`longcat_flash`): recognised, refused at start.

LongcatFlashMoE: p = softmax(x @ Wr^T) over E + Z rows (Z = `zero_expert_num` identity experts);
top-k of p + e_score_correction_bias (selection only); weights = p of the k, not renormalised,
times `routed_scaling_factor`; a chosen expert j < E gives w * SwiGLU_j(x), j >= E gives w * x.
One MoE block per decoder layer. Missing: zero-computation (identity) experts and the E + Z router
rows (the selection bias on softmax probabilities is expertd's, as ERNIE 4.5's).

config.json: `n_routed_experts`, `zero_expert_num`, `moe_topk`, `expert_ffn_hidden_size`.
Tensors (under `model.layers.N.`): `mlp.router.classifier.weight [E + Z, H]`,
`mlp.router.e_score_correction_bias [E + Z]`, `mlp.experts.j.{gate,up,down}_proj.weight`. BF16, FP8.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, LayerTensors, per_expert


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("n_routed_experts"), topk=c.integer("moe_topk"),
                     hidden_size=c.integer("hidden_size"), intermediate_size=c.integer("expert_ffn_hidden_size"),
                     score_function="softmax", use_pre_softmax=True, use_expert_bias=True,
                     scaling_factor=c.number("routed_scaling_factor", default=1.0))


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("mlp.router.classifier.weight", per_expert("mlp"),
                         bias="mlp.router.e_score_correction_bias"),)


def missing(c: HFConfig) -> str:
    return ("longcat_flash: zero-computation (identity) experts and the E + zero_expert_num router rows they add "
            "are not supported yet")


FAMILY = Family(
    name="longcat_flash", model_types=("longcat_flash",), architectures=("LongcatFlashForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing, served=False,
    router="softmax over E + Z; top-k of probability + bias; x routed_scaling_factor; identity experts",
    formats="BF16, FP8")
