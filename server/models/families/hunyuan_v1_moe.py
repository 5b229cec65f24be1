"""Hunyuan-A13B (`hunyuan_v1_moe`).

HunYuanMoEV1Moe: p = softmax(x @ Wg^T) in fp32 (the gate is an fp32 Linear `gate.wg`); top-k of p,
divided by their sum (= softmax over the top-k logits, Mixtral's rule); out = sum_j p_j *
SwiGLU_j(x) + SwiGLU_shared(x), one ungated shared MLP. Experts and the shared MLP are both of
size `intermediate_size` (transformers builds both from it). `num_experts` and `moe_topk` may be
per-layer lists. Every decoder layer is MoE.

Tensors (under `model.layers.N.`): `mlp.gate.wg.weight [E, H]`,
`mlp.experts.j.{gate,up,down}_proj.weight`, `mlp.shared_mlp.{gate,up,down}_proj.weight`.
Formats: BF16 (FP8 variants).
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig
from expertd.server.models.family import Family, LayerTensors, per_expert, shared_mlp


def _per_layer(c: HFConfig, key: str, index: int, default: int) -> int:
    value = c.get(key, default=default)
    if isinstance(value, list):
        if not 0 <= index < len(value):
            raise ConfigError(f"{c.where(key)} lists {len(value)} values; layer {index} has none")
        value = value[index]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{c.where(key)} must be an integer >= 1 or a list of them, got {value!r}")
    return value


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    inter = c.integer("intermediate_size")
    return MoEConfig(num_experts=_per_layer(c, "num_experts", index, 1), topk=_per_layer(c, "moe_topk", index, 1),
                     hidden_size=c.integer("hidden_size"), intermediate_size=inter, score_function="softmax",
                     use_pre_softmax=False, num_shared_experts=1, shared_intermediate_size=inter,
                     activation=c.activation())


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("mlp.gate.wg.weight", per_expert("mlp"), shared=shared_mlp("mlp.shared_mlp")),)


FAMILY = Family(
    name="hunyuan_v1_moe", model_types=("hunyuan_v1_moe",), architectures=("HunYuanMoEV1ForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="softmax, top-k, renormalise (per-layer num_experts / moe_topk lists accepted)",
    shared="1 x intermediate_size, ungated")
