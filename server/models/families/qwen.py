"""The Qwen MoE group: Qwen2-MoE (`qwen2_moe`), Qwen3-MoE (`qwen3_moe`), Qwen3-Next
(`qwen3_next`), Qwen3.5 / 3.6 (`qwen3_5_moe`, decoder keys under `text_config`) and OLMoE
(`olmoe`), whose MoE blocks compute the same thing.

Qwen2MoeSparseMoeBlock and its descendants: p = softmax(x @ Wr^T) over all E; the k largest p are
kept; divided by their sum only if `norm_topk_prob` (Qwen3.5 / 3.6 always divide); out =
sum_j p_j * SwiGLU_j(x) + [sigmoid(x @ Wsg^T) * SwiGLU_shared(x)] where the model has a shared
expert (qwen2_moe, qwen3_next, qwen3_5_moe). Without renormalisation the weights are the softmax
probabilities as they are (expertd: use_pre_softmax=True); with it, softmax over the top-k logits
(use_pre_softmax=False).

MoE layers: qwen2_moe / qwen3_moe / qwen3_next: i not in `mlp_only_layers` and
(i + 1) % `decoder_sparse_step` == 0; qwen3_5_moe and olmoe: every layer.
config.json: `num_experts` (transformers 5 writes Qwen3-MoE's as `num_local_experts`; both are
read), `num_experts_per_tok`, `moe_intermediate_size` (olmoe: `intermediate_size`),
`shared_expert_intermediate_size`, `norm_topk_prob`; missing keys take the transformers config
classes' defaults (qwen3_5_moe has none: its keys are required).
Tensors (under `model.layers.N.`, Qwen3.5 / 3.6 under `model.language_model.layers.N.`):
`mlp.gate.weight [E, H]`, `mlp.experts.j.{gate,up,down}_proj.weight` (or transformers 5's fused
`mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`), `mlp.shared_expert.*_proj.weight`,
`mlp.shared_expert_gate.weight [1, H]`. Official formats: BF16; Qwen3 / Qwen3-Next / Qwen3.5 FP8
variants with 128x128 block scales.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig, sparse_by_step
from expertd.server.models.family import Family, LayerTensors, fused_rows, per_expert, shared_mlp

# transformers' config class defaults: experts, top-k, expert I, shared Is, norm_topk_prob
_DEFAULTS = {
    "qwen2_moe": dict(e=60, k=4, i=1408, shared=5632, norm=False),
    "qwen3_moe": dict(e=128, k=8, i=768, shared=0, norm=False),
    "qwen3_next": dict(e=512, k=10, i=512, shared=512, norm=True),
    "olmoe": dict(e=64, k=8, i=2048, shared=0, norm=False),
}
_ALWAYS_RENORM = ("qwen3_5_moe", "qwen3_5_moe_text")
_EVERY_LAYER = ("qwen3_5_moe", "qwen3_5_moe_text", "olmoe")


def _kind(c: HFConfig) -> str:
    for model_type in (c.model_type, c.text_model_type):
        if model_type in _DEFAULTS or model_type in _ALWAYS_RENORM:
            return model_type
    return "qwen3_moe"


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    kind = _kind(c)
    d = _DEFAULTS.get(kind)
    if d is None:  # qwen3_5_moe: no defaults, its keys are required
        e = k = i = shared = norm = None
    else:
        e, k, i, shared, norm = d["e"], d["k"], d["i"], d["shared"], d["norm"]
    inter_key = "intermediate_size" if kind == "olmoe" else "moe_intermediate_size"
    renorm = True if kind in _ALWAYS_RENORM else c.flag("norm_topk_prob", default=norm)
    kwargs = dict(num_experts=c.integer("num_experts", "num_local_experts", **_default(e)),
                  topk=c.integer("num_experts_per_tok", **_default(k)), hidden_size=c.integer("hidden_size"),
                  intermediate_size=c.integer(inter_key, **_default(i)), score_function="softmax",
                  use_pre_softmax=not renorm, activation=c.activation())
    shared_size = c.integer("shared_expert_intermediate_size", minimum=0, **_default(shared))
    if shared_size:
        kwargs.update(num_shared_experts=1, shared_intermediate_size=shared_size, shared_expert_gate=True)
    return MoEConfig(**kwargs)


def _default(value) -> dict:
    return {} if value is None else {"default": value}


def moe_layers(c: HFConfig) -> list[int]:
    if c.get("num_experts", "num_local_experts") == 0:
        return []
    if _kind(c) in _EVERY_LAYER:
        return list(range(c.num_layers()))
    return sparse_by_step(c)


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    shared = shared_mlp("mlp.shared_expert", gate_weight="mlp.shared_expert_gate.weight")
    return (LayerTensors("mlp.gate.weight", per_expert("mlp"), shared=shared),
            LayerTensors("mlp.gate.weight", fused_rows("mlp"), shared=shared))


FAMILY = Family(
    name="qwen", model_types=("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "olmoe"),
    architectures=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "OlmoeForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="softmax over E, top-k, renormalised if norm_topk_prob (qwen3_5_moe: always)",
    shared="1, sigmoid-gated (qwen2_moe, qwen3_next, qwen3_5_moe)", formats="BF16, FP32, FP8 128x128 block")
