"""Llama 4 (`llama4`, decoder keys under `text_config`, model_type `llama4_text`).

Llama4TextMoe / Llama4Router (modeling_llama4.py): logits = x @ Wr^T; top-k logits, s = sigmoid of
those k (no renormalisation); the weight multiplies the expert input: out = sum_j SwiGLU_j(s_j * x)
(combined unweighted) + SwiGLU_shared(x) (one shared expert of intermediate_size, ungated). MoE
layers: `moe_layers` (default range(step - 1, L, step), step = `interleave_moe_layer_step`).
expertd: sigmoid, norm_topk_prob=False (top-k of sigmoid = top-k of the logits),
router_weight_on_input.

Tensors (under `language_model.model.layers.N.`): `feed_forward.router.weight [E, H]`, fused
`feed_forward.experts.gate_up_proj [E, H, 2I]` (gate columns first), `experts.down_proj [E, I, H]`,
`feed_forward.shared_expert.{gate,up,down}_proj.weight`. Formats: BF16; Maverick FP8 = fbgemm
per-channel (`gate_up_proj_scale [E, 1, 2I]`, `down_proj_scale [E, H, 1]`).
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig
from expertd.server.models.family import Family, FusedColumns, LayerTensors, shared_mlp


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    inter = c.integer("intermediate_size")
    return MoEConfig(num_experts=c.integer("num_local_experts"), topk=c.integer("num_experts_per_tok", default=1),
                     hidden_size=c.integer("hidden_size"), intermediate_size=inter, score_function="sigmoid",
                     norm_topk_prob=False, router_weight_on_input=True, num_shared_experts=1,
                     shared_intermediate_size=inter)


def moe_layers(c: HFConfig) -> list[int]:
    layers = c.get("moe_layers")
    if layers is not None:
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise ConfigError(f"{c.where('moe_layers')} must list layer indices, got {layers!r}")
        return sorted(layers)
    step = c.integer("interleave_moe_layer_step", default=1)
    return list(range(step - 1, c.num_layers(), step))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("feed_forward.router.weight",
                         FusedColumns("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
                         shared=shared_mlp("feed_forward.shared_expert")),)


FAMILY = Family(
    name="llama4", model_types=("llama4", "llama4_text"), architectures=("Llama4ForConditionalGeneration",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="top-k logits, sigmoid of the k, weight on the expert input", shared="1 x intermediate_size, ungated",
    formats="BF16, fbgemm FP8 per-channel")
