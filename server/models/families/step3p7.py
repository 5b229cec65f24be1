"""Step-3.5 / 3.7 (`step3p7`, decoder keys under `text_config`, model_type `step3p5`).

The MoE block (modeling_step3p7.py): s = sigmoid(x @ Wr^T); top-k of s + router_bias (selection
only); weights = the unbiased s renormalised, times `moe_router_scaling_factor`; experts
(Step3p7Experts) use min(silu(g), L) * clip(u, -L, L) with a per-layer L (`swiglu_limits[i]`;
0 or null = no clamp), the one ungated shared expert (`share_expert_dim`, Step3p7MLP) its own
per-layer L (`swiglu_limits_shared[i]`). MoE layers: `mlp_layer_types` (legacy `moe_layers_enum`).
expertd: sigmoid, use_expert_bias, norm_topk_prob, scaling_factor, swiglu_limit_mode
"after_activation", swiglu_limit = swiglu_limits[i] or None, shared_swiglu_limit =
swiglu_limits_shared[i] or None.

Tensors (under `model.layers.N.`): `moe.gate.weight`, `moe.router_bias [E]`, stacked
`moe.gate_proj.weight`, `moe.up_proj.weight` `[E, I, H]`, `moe.down_proj.weight [E, H, I]`,
`share_expert.{gate,up,down}_proj.weight`. Formats: BF16, FP8 (`weight_scale_inv`).
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig, layer_types, sparse_by_types
from expertd.server.models.family import Family, LayerTensors, Stacked, shared_mlp


def _limit(c: HFConfig, key: str, index: int) -> float | None:
    """Layer `index`'s entry of the per-layer list `key`; 0, null or no list: no clamp (None)."""
    limits = c.get(key)
    if limits is None:
        return None
    if not isinstance(limits, list) or len(limits) <= index:
        raise ConfigError(f"{c.where(key)} must list one limit per decoder layer (layer {index} has none), "
                          f"got {limits!r}")
    value = limits[index]
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"{c.where(key)}[{index}] must be a number >= 0 (0: no clamp), got {value!r}")
    return float(value) if value else None


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    shared = c.integer("share_expert_dim", default=0, minimum=0)
    return MoEConfig(num_experts=c.integer("n_routed_experts", "moe_num_experts"),
                     topk=c.integer("num_experts_per_tok", "moe_top_k"), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("moe_intermediate_size"), score_function="sigmoid",
                     use_expert_bias=True, norm_topk_prob=True,
                     scaling_factor=c.number("moe_router_scaling_factor", default=1.0),
                     num_shared_experts=1 if shared else 0, shared_intermediate_size=shared,
                     swiglu_limit_mode="after_activation", swiglu_limit=_limit(c, "swiglu_limits", index),
                     shared_swiglu_limit=_limit(c, "swiglu_limits_shared", index) if shared else None)


def moe_layers(c: HFConfig) -> list[int]:
    types = layer_types(c)
    if types is not None:
        return sparse_by_types(c, types)
    legacy = c.get("moe_layers_enum")
    if legacy is None:
        return list(range(c.num_layers()))
    if isinstance(legacy, str):
        legacy = [int(part) for part in legacy.split(",") if part.strip()]
    if not isinstance(legacy, list):
        raise ConfigError(f"{c.where('moe_layers_enum')} must list layer indices, got {legacy!r}")
    return sorted(int(i) for i in legacy)


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("moe.gate.weight", Stacked("moe.gate_proj.weight", "moe.up_proj.weight",
                                                    "moe.down_proj.weight"),
                         bias="moe.router_bias", shared=shared_mlp("share_expert")),)


FAMILY = Family(
    name="step3p7", model_types=("step3p7", "step3p5"), architectures=(),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="sigmoid; top-k of score + bias; renormalised; x moe_router_scaling_factor",
    activation="SwiGLU clamped after the activation, per-layer limits", shared="1 x share_expert_dim, ungated",
    formats="BF16, FP8 128x128 block")
