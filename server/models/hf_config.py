"""Hugging Face config.json -> `MoEConfig`: the MoE families expertd serves.

  moe_config_from_hf(config: dict) -> MoEConfig
      For Mixtral (`mixtral`), Qwen2-MoE (`qwen2_moe`), Qwen3-MoE (`qwen3_moe`) and DeepSeek-V3
      (`deepseek_v3`) config.json dicts. Missing keys take the Hugging Face config classes'
      defaults; a missing required key, an unknown model_type or activation, or a router setting
      the kernels do not implement raises ValueError naming the key.

Semantics per family (checked against the Hugging Face modelling code):
  Mixtral: softmax over the top-k logits (= softmax over all E, top-k, renormalise).
  Qwen2/3-MoE: softmax over all E, top-k; renormalised only with norm_topk_prob (then equal to
  Mixtral's), so norm_topk_prob=False maps to use_pre_softmax=True. Qwen2-MoE's shared expert is
  gated by sigmoid(x @ shared_expert_gate).
  DeepSeek-V3: sigmoid scores, selection on score + e_score_correction_bias limited to the
  topk_group best of n_group groups (group score = sum of the top 2), weights = unbiased scores,
  divided by their sum (+1e-20) if norm_topk_prob, times routed_scaling_factor; ungated shared
  experts of n_shared_experts x moe_intermediate_size.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig


def moe_config_from_hf(config: dict) -> MoEConfig:
    """From a Hugging Face config.json dict (model_type mixtral, qwen2_moe, qwen3_moe, deepseek_v3)."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in _HF_FAMILIES:
        raise ValueError(f"config['model_type'] must be one of {sorted(_HF_FAMILIES)}, got {model_type!r}")
    return MoEConfig(**_HF_FAMILIES[model_type](_HFReader(config)))


class _HFReader:
    """config.json access with the Hugging Face class defaults and errors that name the key."""

    def __init__(self, config: dict):
        self.config = config

    def __call__(self, key: str, default=None):
        value = self.config.get(key, default)
        if value is None:
            raise ValueError(f"config[{key!r}] is required for model_type {self.config.get('model_type')!r}")
        return value

    def activation(self) -> str:
        name = self("hidden_act", "silu")
        if name not in _HF_ACTIVATIONS:
            raise ValueError(f"config['hidden_act'] must be one of {sorted(_HF_ACTIVATIONS)}, got {name!r}")
        return _HF_ACTIVATIONS[name]


_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _mixtral(c: _HFReader) -> dict:
    # MixtralSparseMoeBlock: softmax over all E, top-k, renormalise == softmax over the top-k logits.
    return dict(num_experts=c("num_local_experts", 8), topk=c("num_experts_per_tok", 2),
                hidden_size=c("hidden_size"), intermediate_size=c("intermediate_size"),
                score_function="softmax", use_pre_softmax=False, activation=c.activation())


def _qwen_moe(c: _HFReader, *, with_shared: bool) -> dict:
    # Defaults are Qwen2MoeConfig's / Qwen3MoeConfig's.
    d = dict(num_experts=60, topk=4, inter=1408) if with_shared else dict(num_experts=128, topk=8, inter=768)
    # Qwen2/3-MoE: softmax over all E, top-k, renormalised only if norm_topk_prob (HF default False).
    kwargs = dict(num_experts=c("num_experts", d["num_experts"]), topk=c("num_experts_per_tok", d["topk"]),
                  hidden_size=c("hidden_size"), intermediate_size=c("moe_intermediate_size", d["inter"]),
                  score_function="softmax", use_pre_softmax=not c("norm_topk_prob", False),
                  activation=c.activation())
    shared = c("shared_expert_intermediate_size", 5632) if with_shared else 0
    if shared:  # Qwen2MoeSparseMoeBlock: sigmoid(x @ shared_expert_gate) * shared_expert(x)
        kwargs.update(num_shared_experts=1, shared_intermediate_size=shared, shared_expert_gate=True)
    return kwargs


def _deepseek_v3(c: _HFReader) -> dict:
    # Defaults are DeepseekV3Config's.
    scoring = c("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"config['scoring_func'] must be 'sigmoid' for deepseek_v3, got {scoring!r}")
    e, k = c("n_routed_experts", 256), c("num_experts_per_tok", 8)
    inter = c("moe_intermediate_size", 2048)
    n_group, topk_group = c("n_group", 8), c("topk_group", 4)
    grouped = n_group > 1
    # HF scores a group by the sum of its top 2; the router by the sum of its top k // topk_group.
    if grouped and k // topk_group != 2:
        raise ValueError(f"deepseek_v3 group scoring (sum of the top 2 per group) needs "
                         f"num_experts_per_tok // topk_group == 2, got {k} // {topk_group}")
    n_shared = c("n_shared_experts", 1) or 0
    return dict(num_experts=e, topk=k, hidden_size=c("hidden_size"), intermediate_size=inter,
                score_function="sigmoid", use_expert_bias=True,
                num_groups=n_group if grouped else None, group_topk=topk_group if grouped else None,
                norm_topk_prob=bool(c("norm_topk_prob", True)),
                scaling_factor=float(c("routed_scaling_factor", 2.5)),
                num_shared_experts=n_shared, shared_intermediate_size=inter * n_shared,
                activation=c.activation())


_HF_FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": lambda c: _qwen_moe(c, with_shared=True),
    "qwen3_moe": lambda c: _qwen_moe(c, with_shared=False),
    "deepseek_v3": _deepseek_v3,
}
