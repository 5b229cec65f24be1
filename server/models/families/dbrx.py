"""DBRX (`dbrx`; MoE keys under `ffn_config`).

DbrxFFN: p = softmax(x @ Wr^T) over all E; top-k of p; divided by their L_p norm with p =
`moe_normalize_expert_weights` (1: their sum, Mixtral's rule; null: not normalised, the
probabilities as they are); out = sum_j w_j * (act(x w1_j^T) * (x v1_j^T)) w2_j, where w1, v1,
w2 are `[E*I, H]` parameters viewed `[E, I, H]` (w2 is used untransposed). No shared expert.
Every block is MoE. Another p (an L_p norm other than 1) is recognised but refused.

config.json: `d_model` (H), `n_layers`, `ffn_config`: `moe_num_experts`, `moe_top_k`,
`ffn_hidden_size` (I), `moe_normalize_expert_weights`, `ffn_act_fn.name`.
Tensors: `transformer.blocks.N.ffn.router.layer.weight [E, H]`,
`transformer.blocks.N.ffn.experts.mlp.{w1,v1,w2}` (each `[E*I, H]`). Format: BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig
from expertd.server.models.family import Family, FlatRows, LayerTensors


def _ffn(c: HFConfig) -> HFConfig:
    ffn = c.require("ffn_config")
    if not isinstance(ffn, dict):
        raise ConfigError(f"{c.where('ffn_config')} must be an object, got {ffn!r}")
    return HFConfig(ffn)


def _norm(c: HFConfig):
    """`moe_normalize_expert_weights` (DbrxFFNConfig's default 1; null is kept: no normalisation)."""
    return _ffn(c).raw.get("moe_normalize_expert_weights", 1.0)


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    ffn = _ffn(c)
    act = ffn.get("ffn_act_fn", default={})
    act = HFConfig({"hidden_act": act.get("name", "silu") if isinstance(act, dict) else act})
    return MoEConfig(num_experts=ffn.integer("moe_num_experts", default=4), topk=ffn.integer("moe_top_k", default=1),
                     hidden_size=c.integer("d_model", "hidden_size"),
                     intermediate_size=ffn.integer("ffn_hidden_size", default=3584), score_function="softmax",
                     use_pre_softmax=_norm(c) is None, activation=act.activation())


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers("n_layers", "num_hidden_layers")))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("ffn.router.layer.weight",
                         FlatRows("ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2")),)


def missing(c: HFConfig) -> str | None:
    norm = _norm(c)
    if norm is None or norm == 1:
        return None
    return (f"dbrx: ffn_config.moe_normalize_expert_weights = {norm!r} (an L_p norm of the top-k weights with "
            "p != 1) is not supported yet; expertd normalises by the sum (p = 1) or not at all (null)")


FAMILY = Family(
    name="dbrx", model_types=("dbrx",), architectures=("DbrxForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing,
    router="softmax, top-k, divided by the L1 norm (moe_normalize_expert_weights = 1) or not (null)")
