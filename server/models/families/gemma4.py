"""Gemma 4 (`gemma4`, decoder keys under `text_config`, model_type `gemma4_text`): recognised, refused.

The MoE branch sits in the decoder layer beside a dense MLP (`enable_moe_block`): router input
RMSNorm(x) (no weight) * scale * H^-1/2; p = softmax(logits) over E, top-k, renormalised, times
`per_expert_scale`; experts GeGLU (`hidden_activation`, gelu_pytorch_tanh) on
pre_feedforward_layernorm_2(x), their sum through post_feedforward_layernorm_2. Every layer.
Missing: the branch's own RMSNorms (unweighted router-input norm, output norm) and per-expert scale.

Tensors (under `model.language_model.layers.N.`): `router.proj.weight [E, H]`, `router.scale`,
`router.per_expert_scale`, fused `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`,
`pre_feedforward_layernorm_2.weight`, `post_feedforward_layernorm_{1,2}.weight`. BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, FusedRows, LayerTensors


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_experts"), topk=c.integer("top_k_experts", "num_experts_per_tok"),
                     hidden_size=c.integer("hidden_size"), intermediate_size=c.integer("moe_intermediate_size"),
                     score_function="softmax", activation=c.activation("hidden_activation", "hidden_act",
                                                                       default="gelu_pytorch_tanh"))


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers())) if c.get("enable_moe_block", default=True) else []


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("router.proj.weight", FusedRows("experts.gate_up_proj", "experts.down_proj")),)


def missing(c: HFConfig) -> str:
    return ("gemma4: the MoE branch's own RMSNorms (the unweighted router-input norm, pre_feedforward_layernorm_2, "
            "post_feedforward_layernorm_2), the router scale and per_expert_scale are not supported yet")


FAMILY = Family(
    name="gemma4", model_types=("gemma4", "gemma4_text"), architectures=("Gemma4ForConditionalGeneration",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing, served=False,
    router="normed input; softmax, top-k, renormalise, x per_expert_scale", activation="GeGLU (tanh)",
    shared="dense MLP in parallel (not served)")
