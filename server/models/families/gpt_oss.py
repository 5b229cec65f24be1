"""gpt-oss (`gpt_oss`, GptOssForCausalLM).

GptOssTopKRouter and GptOssExperts (modeling_gpt_oss.py): logits = x @ Wr^T + br (the router bias
is part of the logits: it moves the weights as well as the selection); the k largest logits are
softmaxed over the k (= softmax post-top-k); per expert j: gate_up = x @ W_gu[j] + b_gu[j] with gate
and up interleaved on the columns (gate even, up odd), g' = min(gate, L), u' = clip(up, -L, L),
h = (u' + 1) * g' * sigmoid(alpha * g'), out_j = h @ W_d[j] + b_d[j]; out = sum_j w_j * out_j.
L = `swiglu_limit` (7.0), alpha = 1.702 (fixed in the modelling code; a `swiglu_alpha` key is read
where present). No shared expert. Every decoder layer is MoE.
expertd: score_function softmax (post-top-k), router_bias, activation "swiglu_oai" with
swiglu_limit / swiglu_alpha, expert_proj_bias (b_gate / b_up de-interleaved from gate_up_proj_bias).

config.json: `num_local_experts`, `num_experts_per_tok`, `intermediate_size`, `swiglu_limit`.
Tensors (under `model.layers.N.`): `mlp.router.weight [E, H]`, `mlp.router.bias [E]`,
`mlp.experts.gate_up_proj [E, H, 2I]` (interleaved), `mlp.experts.gate_up_proj_bias [E, 2I]`,
`mlp.experts.down_proj [E, I, H]`, `mlp.experts.down_proj_bias [E, H]`; official MXFP4:
`*_blocks`, `*_scales` (dequantised `[E, 2I, H]`, transposed at load), the rest BF16.
"""
from __future__ import annotations

from expertd.kernels.config import DEFAULT_SWIGLU_ALPHA, MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, FusedColumns, LayerTensors, ProjBiases


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_local_experts", "num_experts", default=128),
                     topk=c.integer("num_experts_per_tok", default=4), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("intermediate_size"), score_function="softmax",
                     router_bias=True, activation="swiglu_oai", swiglu_limit=c.number("swiglu_limit", default=7.0),
                     swiglu_alpha=c.number("swiglu_alpha", default=DEFAULT_SWIGLU_ALPHA), expert_proj_bias=True)


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("mlp.router.weight",
                         FusedColumns("mlp.experts.gate_up_proj", "mlp.experts.down_proj", interleaved=True),
                         router_bias="mlp.router.bias",
                         proj_bias=ProjBiases("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias",
                                              interleaved=True)),)


FAMILY = Family(
    name="gpt_oss", model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="logits + router bias, top-k, softmax over the k", activation="gpt-oss SwiGLU (alpha, limit), biases",
    formats="MXFP4 experts, BF16")
