"""`MoEConfig`: the shape and routing settings of one MoE layer (a plain, hashable dataclass).

Built by hand or by a model loader (the server's registry maps Hugging Face config.json files to
it); static under `jax.jit`. Shape letters as everywhere: H hidden, I expert intermediate, Is
shared intermediate, E experts, k top-k.
"""
from __future__ import annotations

import dataclasses

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # silu: SwiGLU; gelu: exact erf; gelu_tanh: tanh approximation


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing settings of one MoE layer (hashable: static under jit).

    Router fields follow `fused_topk_with_score_function`: score_function, use_pre_softmax,
    num_groups / group_topk (group-limited top-k, None = off), scaling_factor, use_expert_bias.
    norm_topk_prob: None keeps the router's own normalisation (softmax post: sums to 1; softmax
    pre: not renormalised; sigmoid: divided by the sum when topk > 1). True / False force
    dividing the k weights by their sum (before scaling) or not, whatever topk (DeepSeek-V3's
    norm_topk_prob). Softmax post-top-k always sums to 1, so False is rejected there.
    Shared experts: shared_intermediate_size is the total Is of the shared MLP (num_shared_experts
    experts of one size merge into one MLP of the summed size); shared_expert_gate adds Qwen2-MoE's
    sigmoid gate. activation: "silu" (SwiGLU), "gelu" or "gelu_tanh".
    """

    num_experts: int
    topk: int
    hidden_size: int
    intermediate_size: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    use_expert_bias: bool = False
    norm_topk_prob: bool | None = None
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    activation: str = "silu"

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be an int >= 1, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"MoEConfig.topk must be <= num_experts={self.num_experts}, got {self.topk}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}")
        if self.use_expert_bias and self.score_function == "softmax":
            raise ValueError("MoEConfig.use_expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus'")
        if self.score_function == "softmax" and not self.use_pre_softmax and self.norm_topk_prob is False:
            raise ValueError("MoEConfig.norm_topk_prob=False contradicts softmax post-top-k (it always "
                             "sums to 1); use use_pre_softmax=True for un-renormalised softmax weights")
        if (self.group_topk is None) != (self.num_groups is None):
            raise ValueError("MoEConfig.num_groups and group_topk must be given together (or both None)")
        if self.group_topk is not None:
            g, gk = self.num_groups, self.group_topk
            if g < 1 or self.num_experts % g or gk < 1 or gk > g or self.topk % gk \
                    or self.topk // gk > self.num_experts // g:
                raise ValueError(
                    f"MoEConfig.num_groups={g}, group_topk={gk} invalid for num_experts="
                    f"{self.num_experts}, topk={self.topk}: need E % num_groups == 0, "
                    "1 <= group_topk <= num_groups, topk % group_topk == 0 and "
                    "topk // group_topk <= E // num_groups")
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0:
            raise ValueError("MoEConfig.num_shared_experts and shared_intermediate_size must be >= 0")
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ValueError("MoEConfig.num_shared_experts > 0 requires shared_intermediate_size > 0 "
                             f"and vice versa, got {self.num_shared_experts} and {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("MoEConfig.shared_expert_gate needs shared experts (num_shared_experts > 0)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def has_shared(self) -> bool:
        return self.num_shared_experts > 0
