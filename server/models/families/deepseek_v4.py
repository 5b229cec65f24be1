"""DeepSeek-V4 Flash / Pro (`deepseek_v4`, DeepseekV4ForCausalLM).

DeepseekV4MoE (modeling_deepseek_v4.py): s = sqrt(softplus(x @ Wr^T)) in fp32 (`scoring_func`
sqrtsoftplus); top-k of s + bias (the bias selects only), no groups; weights = the unbiased s of
the k renormalised (+1e-20), times `routed_scaling_factor` (1.5); experts and the one ungated shared
expert (moe_intermediate_size) use the clamped SwiGLU silu(min(g, L)) * clip(u, -L, L) with
L = `swiglu_limit` (10; DeepseekV4Experts._apply_gate, DeepseekV4MLP). The first layers
(`mlp_layer_types` "hash_moe"; legacy `num_hash_layers`) route by token id (DeepseekV4HashRouter):
ids = tid2eid[input_ids], weights = s at those ids, renormalised, times the scale; they have no
bias. Every decoder layer is MoE.
expertd: score_function "sqrtsoftplus", use_expert_bias (moe layers), norm_topk_prob,
scaling_factor, swiglu_limit = shared_swiglu_limit = swiglu_limit; hash_moe layers:
hash_vocab_size = `vocab_size` and the tid2eid table instead of the bias. A hash-routed layer
needs each token's id with its hidden state (Forward / Route `token_ids`).

Tensors (DeepSeek's layout, no model prefix): `layers.N.ffn.gate.weight [E, H]`,
`layers.N.ffn.gate.bias [E]` (selection bias; moe layers), `layers.N.ffn.gate.tid2eid [V, k]`
(I64 or I32; hash_moe layers), `layers.N.ffn.experts.j.{w1,w3,w2}.weight`,
`layers.N.ffn.shared_experts.{w1,w3,w2}.weight`. Official format: experts FP4 e2m1 with ue8m0
scales per 32 inputs (`.scale`), the rest FP8 128x128 with ue8m0 scales; `expert_dtype: fp4`.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig, layer_types
from expertd.server.models.family import Family, LayerTensors, PerExpert, shared_mlp

HASH, ROUTED = "hash_moe", "moe"


def layer_kind(c: HFConfig, index: int) -> str:
    """"hash_moe" or "moe": `mlp_layer_types[index]`, else the first `num_hash_layers` are hashed."""
    types = layer_types(c)
    if types is not None:
        if types[index] not in (HASH, ROUTED):
            raise ConfigError(f"{c.where('mlp_layer_types')}[{index}] is {types[index]!r}; expected "
                              f"{HASH!r} or {ROUTED!r}")
        return types[index]
    return HASH if index < c.integer("num_hash_layers", default=0, minimum=0) else ROUTED


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    scoring = c.get("scoring_func", default="sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"{c.where('scoring_func')} must be 'sqrtsoftplus' for deepseek_v4, got {scoring!r}")
    inter = c.integer("moe_intermediate_size")
    limit = c.number("swiglu_limit", default=10.0)
    hashed = layer_kind(c, index) == HASH
    return MoEConfig(num_experts=c.integer("n_routed_experts", "num_local_experts"),
                     topk=c.integer("num_experts_per_tok"), hidden_size=c.integer("hidden_size"),
                     intermediate_size=inter, score_function="sqrtsoftplus", use_expert_bias=not hashed,
                     norm_topk_prob=True, scaling_factor=c.number("routed_scaling_factor", default=1.5),
                     num_shared_experts=1, shared_intermediate_size=inter, swiglu_limit=limit,
                     shared_swiglu_limit=limit, hash_vocab_size=c.integer("vocab_size") if hashed else 0)


def moe_layers(c: HFConfig) -> list[int]:
    return [i for i in range(c.num_layers()) if layer_kind(c, i) in (HASH, ROUTED)]


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    experts = PerExpert("ffn.experts.{j}.w1.weight", "ffn.experts.{j}.w3.weight", "ffn.experts.{j}.w2.weight")
    shared = shared_mlp("ffn.shared_experts", ("w1", "w3", "w2"))
    if layer_kind(c, index) == HASH:
        return (LayerTensors("ffn.gate.weight", experts, shared=shared, tid2eid="ffn.gate.tid2eid"),)
    return (LayerTensors("ffn.gate.weight", experts, bias="ffn.gate.bias", shared=shared),)


FAMILY = Family(
    name="deepseek_v4", model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="sqrtsoftplus; top-k of score + bias; renormalised; x routed_scaling_factor; hash_moe layers: "
           "ids = tid2eid[token id] (Forward needs token ids)",
    activation="clamped SwiGLU", shared="1 x moe_intermediate_size, ungated, clamped",
    formats="FP4 e2m1 experts + FP8 128x128 (ue8m0 scales)")
