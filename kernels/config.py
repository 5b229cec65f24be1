"""`MoEConfig`: the shape and routing settings of one MoE layer (a plain, hashable dataclass).

Built by hand or by a model loader (the server's registry maps Hugging Face config.json files to
it); static under `jax.jit`. Shape letters as everywhere: H hidden, I expert intermediate, Is
shared intermediate, E experts, k top-k, V the vocabulary of a hash-routed layer.

Every field past `activation` switches on one family's semantics (docs/semantics.md has the table:
semantic, fields, params, formula, families); all default to off, which is the plain layer of
Mixtral / Qwen / DeepSeek-V3 bit for bit. A switch that is off costs nothing: the kernels branch on
these static values, so a layer that does not use a feature traces no extra work.
"""
from __future__ import annotations

import dataclasses
import math

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
# silu: SwiGLU; gelu: exact erf (GeGLU); gelu_tanh: tanh approximation (Gemma's GeGLU);
# swiglu_oai: gpt-oss's (clip(u, -L, L) + 1) * g' * sigmoid(alpha * g'), g' = min(g, L)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")
SWIGLU_LIMIT_MODES = ("before_activation", "after_activation")
DEFAULT_SWIGLU_ALPHA = 1.702  # gpt-oss's alpha


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
    sigmoid gate. activation: "silu" (SwiGLU), "gelu", "gelu_tanh" or "swiglu_oai".

    Family semantics (each off by default; the params each needs are named, see params.py):

    Router
      group_score_topk: int or None. A group's score is the sum of its best `group_score_topk`
        selection scores; None keeps TransformerEngine's topk // group_topk. Hugging Face scores
        by the top 2 in every grouped family (DeepSeek-V3/V3.2, GLM-4.5+, Kimi K2, Mistral 4 /
        Large 4: modeling_deepseek_v3.py, modeling_mistral4.py): loaders set 2. With it set,
        topk need not be a multiple of group_topk.
      use_expert_bias with score_function "softmax" and use_pre_softmax=True: ERNIE 4.5's
        selection on probs + bias (the bias moves selection only; weights are the unbiased probs).
      norm_topk_min: float or None. With norm_topk_prob=True, the k weights are divided by
        max(sum, norm_topk_min) instead of sum + 1e-20 (ERNIE 4.5's moe_norm_min,
        modeling_ernie4_5_moe.py).
      router_bias: logits = x @ router_weight + router_bias (param router_bias [E]); the bias is
        part of the logits, so it moves the weights as well as the selection (gpt-oss's
        router.bias, modeling_gpt_oss.py).
      router_input_norm: logits = (rmsnorm(x) * router_input_scale) @ router_weight, the RMSNorm
        without weight, eps norm_eps, in fp32 (param router_input_scale [H]: Gemma 4's
        router.scale * hidden_size**-0.5, modeling_gemma4.py).
      per_expert_scale: every routing weight is multiplied by per_expert_scale[expert] after the
        normalisation and scaling_factor (param per_expert_scale [E]; Gemma 4).
      hash_vocab_size: int, 0 = off. > 0 makes the layer hash-routed (DeepSeek-V4's "hash_moe"
        layers, modeling_deepseek_v4.py DeepseekV4HashRouter): expert ids = tid2eid[token_id]
        (param tid2eid int32 [V, k], V = hash_vocab_size), weights = the router's scores at those
        ids (score_function sigmoid or sqrtsoftplus), normalised as norm_topk_prob says (None:
        when topk > 1), times scaling_factor. Forward and Route then need per-token ids
        (`token_ids` int32 [T], each in [0, V); `routing.check_token_ids`). No expert bias and no
        groups on such a layer (the table replaces selection).

    Experts
      swiglu_limit: float or None (None = no clamp). The routed experts' clamp L: with
        swiglu_limit_mode "before_activation", act(min(g, L)) * clip(u, -L, L) (GLM-5 Next
        glm5_next, DeepSeek-V4: modeling_deepseek_v4.py DeepseekV4Experts); with
        "after_activation", min(act(g), L) * clip(u, -L, L) (Step-3.5 / 3.7 swiglu_limits,
        modeling_step3p7.py Step3p7Experts). With activation "swiglu_oai" it is gpt-oss's limit.
      shared_swiglu_limit: float or None. The same clamp (same mode) for the shared experts:
        DeepSeek-V4 and GLM-5 Next clamp them with swiglu_limit, Step-3.x with its own per-layer
        swiglu_limits_shared (a limit of 0 there means no clamp: loaders pass None).
      swiglu_alpha: gpt-oss's alpha (activation "swiglu_oai" only; default 1.702).
      expert_proj_bias: per-expert biases on the gate, up and down projections (params b_gate
        [E, I], b_up [E, I], b_down [E, H]; gpt-oss's gate_up_proj_bias de-interleaved by the
        loader, and down_proj_bias). A bias never reaches an expert's rows it did not get.
      router_weight_on_input: Llama 4. The routing weight multiplies the expert's input,
        experts(w * x) (rounded to x's dtype), and the k outputs are summed unweighted
        (modeling_llama4.py Llama4TextMoe); with score_function "sigmoid" and
        norm_topk_prob=False this is Llama 4's router (sigmoid of the top-k logits, no renorm).
      expert_input_norm / expert_output_norm: Gemma 4's MoE branch norms (modeling_gemma4.py,
        pre_feedforward_layernorm_2 / post_feedforward_layernorm_2). The routed experts read
        rmsnorm(x) * expert_input_norm_weight (x's dtype); their weighted sum becomes
        rmsnorm(sum) * expert_output_norm_weight (params [H], eps norm_eps, computed in fp32). The
        router and the shared experts read x itself.
      norm_eps: the epsilon of those RMSNorms (x / sqrt(mean(x^2) + eps)).
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
    # family semantics (class docstring; docs/semantics.md)
    group_score_topk: int | None = None
    norm_topk_min: float | None = None
    router_bias: bool = False
    router_input_norm: bool = False
    per_expert_scale: bool = False
    hash_vocab_size: int = 0
    swiglu_limit: float | None = None
    shared_swiglu_limit: float | None = None
    swiglu_limit_mode: str = "before_activation"
    swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA
    expert_proj_bias: bool = False
    router_weight_on_input: bool = False
    expert_input_norm: bool = False
    expert_output_norm: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be an int >= 1, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"MoEConfig.topk must be <= num_experts={self.num_experts}, got {self.topk}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}")
        if self.use_expert_bias and self.score_function == "softmax" and not self.use_pre_softmax:
            raise ValueError("MoEConfig.use_expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus', or "
                             "'softmax' with use_pre_softmax=True (selection on probs + bias, as ERNIE 4.5)")
        if self.score_function == "softmax" and not self.use_pre_softmax and self.norm_topk_prob is False:
            raise ValueError("MoEConfig.norm_topk_prob=False contradicts softmax post-top-k (it always "
                             "sums to 1); use use_pre_softmax=True for un-renormalised softmax weights")
        self._check_groups()
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0:
            raise ValueError("MoEConfig.num_shared_experts and shared_intermediate_size must be >= 0")
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise ValueError("MoEConfig.num_shared_experts > 0 requires shared_intermediate_size > 0 "
                             f"and vice versa, got {self.num_shared_experts} and {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("MoEConfig.shared_expert_gate needs shared experts (num_shared_experts > 0)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        self._check_router_semantics()
        self._check_expert_semantics()

    def _check_groups(self):
        if (self.group_topk is None) != (self.num_groups is None):
            raise ValueError("MoEConfig.num_groups and group_topk must be given together (or both None)")
        if self.group_topk is None:
            if self.group_score_topk is not None:
                raise ValueError("MoEConfig.group_score_topk needs group-limited routing (num_groups and group_topk)")
            return
        g, gk, e, k = self.num_groups, self.group_topk, self.num_experts, self.topk
        if not (_is_int(g) and _is_int(gk)) or g < 1 or e % g or gk < 1 or gk > g:
            raise ValueError(f"MoEConfig.num_groups={g}, group_topk={gk} invalid for num_experts={e}: need "
                             "E % num_groups == 0 and 1 <= group_topk <= num_groups")
        size = e // g
        if self.group_score_topk is None:
            if k % gk or k // gk > size:
                raise ValueError(
                    f"MoEConfig.num_groups={g}, group_topk={gk} invalid for num_experts={e}, topk={k}: need "
                    "topk % group_topk == 0 and topk // group_topk <= E // num_groups (or set "
                    "group_score_topk, Hugging Face's 2)")
            return
        if not _is_int(self.group_score_topk) or not 1 <= self.group_score_topk <= size:
            raise ValueError(f"MoEConfig.group_score_topk must be an int in [1, E // num_groups = {size}], "
                             f"got {self.group_score_topk!r}")
        if k > gk * size:
            raise ValueError(f"MoEConfig.topk={k} exceeds the {gk * size} experts of the group_topk={gk} kept groups")

    def _check_router_semantics(self):
        if self.norm_topk_min is not None:
            if self.norm_topk_prob is not True:
                raise ValueError("MoEConfig.norm_topk_min needs norm_topk_prob=True (it floors the renormalisation)")
            if not _is_positive(self.norm_topk_min):
                raise ValueError(f"MoEConfig.norm_topk_min must be a finite float > 0, got {self.norm_topk_min!r}")
        if not _is_int(self.hash_vocab_size) or self.hash_vocab_size < 0:
            raise ValueError(f"MoEConfig.hash_vocab_size must be an int >= 0 (0: not hash-routed), "
                             f"got {self.hash_vocab_size!r}")
        if self.hash_vocab_size:
            if self.score_function not in ("sigmoid", "sqrtsoftplus"):
                raise ValueError("MoEConfig.hash_vocab_size > 0 (hash routing) needs score_function 'sigmoid' or "
                                 f"'sqrtsoftplus' for its weights, got {self.score_function!r}")
            if self.use_expert_bias or self.num_groups is not None:
                raise ValueError("MoEConfig.hash_vocab_size > 0 (hash routing: ids from tid2eid) takes no "
                                 "use_expert_bias and no num_groups / group_topk")
        if not _is_positive(self.norm_eps):
            raise ValueError(f"MoEConfig.norm_eps must be a finite float > 0, got {self.norm_eps!r}")

    def _check_expert_semantics(self):
        for name in ("swiglu_limit", "shared_swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not _is_positive(value):
                raise ValueError(f"MoEConfig.{name} must be None (no clamp) or a finite float > 0, got {value!r}")
        if self.shared_swiglu_limit is not None and not self.num_shared_experts:
            raise ValueError("MoEConfig.shared_swiglu_limit needs shared experts (num_shared_experts > 0)")
        if self.swiglu_limit_mode not in SWIGLU_LIMIT_MODES:
            raise ValueError(f"MoEConfig.swiglu_limit_mode must be one of {SWIGLU_LIMIT_MODES}, "
                             f"got {self.swiglu_limit_mode!r}")
        if self.activation == "swiglu_oai" and self.swiglu_limit_mode != "before_activation":
            raise ValueError("MoEConfig.activation 'swiglu_oai' clamps before its activation: "
                             "swiglu_limit_mode must be 'before_activation'")
        if not _is_positive(self.swiglu_alpha):
            raise ValueError(f"MoEConfig.swiglu_alpha must be a finite float > 0, got {self.swiglu_alpha!r}")
        if self.swiglu_alpha != DEFAULT_SWIGLU_ALPHA and self.activation != "swiglu_oai":
            raise ValueError(f"MoEConfig.swiglu_alpha applies to activation 'swiglu_oai' only, got "
                             f"swiglu_alpha={self.swiglu_alpha} with activation {self.activation!r}")

    @property
    def has_shared(self) -> bool:
        return self.num_shared_experts > 0

    @property
    def hash_routed(self) -> bool:
        """Whether expert ids come from tid2eid[token_id] (the layer needs token ids)."""
        return self.hash_vocab_size > 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
