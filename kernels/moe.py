"""The whole MoE layer forward on one device: router -> dispatch -> grouped experts -> combine
(+ shared experts).

Public API (T tokens, H hidden, I expert intermediate, Is shared intermediate, E experts, k top-k):

  MoEConfig                  frozen dataclass, see its docstring; MoEConfig.from_hf_config(dict)
                             for Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 config.json dicts.
  init_params(cfg, key, dtype) -> dict of arrays (keys in PARAM_SHAPES' docstring):
      router_weight [H, E] fp32, expert_bias [E] fp32 (if cfg.use_expert_bias),
      w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H] (dtype),
      shared_w_gate [H, Is], shared_w_up [H, Is], shared_w_down [Is, H] (dtype, if shared experts),
      shared_gate [H, 1] (dtype, if cfg.shared_expert_gate).
  moe_layer(params, x [T, H], cfg, *, backend="auto", valid_tokens=None, return_routing=False)
      -> out [T, H] in x.dtype, or (out, routing) with routing a dict:
         topk_ids int32 [T, k] (descending weight; -1 on padding rows),
         topk_weights fp32 [T, k] (0 on padding rows), tokens_per_expert int32 [E] (padding excluded).
      valid_tokens: None, an int n (rows >= n are padding) or a bool [T] mask. Padding rows are not
      routed, not counted and come back as zeros.
      backend: an expert backend of `expertd.kernels.experts` ("auto", "reference", "ragged_dot",
      "capacity", "expert_loop", "native_cpu", "pallas"). With "native_cpu" (auto's CPU choice)
      the dispatch runs in C++ too (native_cpu.layout / combine, the gate and up projections
      reading token rows by index); the other backends use dispatch.permute / unpermute.
      params' w_gate / w_up / w_down may be `panels.PanelWeights` (`panels.panel_params(params)`,
      how the engine serves them on CPU): native_cpu reads them in place, the other backends
      relay them back (`panels.dense`) per call; the output is the same.
  compiler_options(cfg, T, *, dtype, backend="auto") -> dict for `jax.jit(..., compiler_options=...)`
      of the program calling moe_layer on T tokens with expert weights of `dtype` (XLA:CPU options
      measured faster for few rows per expert; empty where the defaults are fastest; see
      experts.compiler_options).

Semantics (checked against the Hugging Face modelling code; router math in fp32):
  logits = x @ router_weight in fp32; the router is expertd.kernels.router (TE semantics).
  Mixtral: softmax over the top-k logits (= softmax over all E, top-k, renormalise).
  Qwen2/3-MoE: softmax over all E, top-k; renormalised only with norm_topk_prob (then equal to
  Mixtral's), so norm_topk_prob=False maps to use_pre_softmax=True.
  DeepSeek-V3: sigmoid scores, selection on score + e_score_correction_bias limited to the
  topk_group best of n_group groups (group score = sum of the top 2), weights = unbiased scores,
  divided by their sum (+1e-20) if norm_topk_prob, times routed_scaling_factor.
  out = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  (fp32 accumulation)
        + [sigmoid(x @ shared_gate)] * shared_mlp(x)  (Qwen2-MoE gate; DeepSeek-V3 ungated).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from expertd.kernels import dispatch, experts
from expertd.kernels.router import fused_topk_with_score_function, topk_ids_and_weights

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_EPS = 1e-20  # added to the weight sum before normalising, as TE and DeepSeek-V3


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
        if self.activation not in experts.ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {experts.ACTIVATIONS}, got {self.activation!r}")

    @property
    def has_shared(self) -> bool:
        return self.num_shared_experts > 0

    @classmethod
    def from_hf_config(cls, config: dict) -> MoEConfig:
        """From a Hugging Face config.json dict (model_type mixtral, qwen2_moe, qwen3_moe, deepseek_v3)."""
        if not isinstance(config, dict):
            raise ValueError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in _HF_FAMILIES:
            raise ValueError(f"config['model_type'] must be one of {sorted(_HF_FAMILIES)}, got {model_type!r}")
        return cls(**_HF_FAMILIES[model_type](_HFReader(config)))


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


def param_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every parameter key of `init_params(cfg, ...)`."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    shapes = {"router_weight": (h, e), "w_gate": (e, h, i), "w_up": (e, h, i), "w_down": (e, i, h)}
    if cfg.use_expert_bias:
        shapes["expert_bias"] = (e,)
    if cfg.has_shared:
        s = cfg.shared_intermediate_size
        shapes.update(shared_w_gate=(h, s), shared_w_up=(h, s), shared_w_down=(s, h))
        if cfg.shared_expert_gate:
            shapes["shared_gate"] = (h, 1)
    return shapes


def init_params(cfg: MoEConfig, key, dtype=jnp.float32) -> dict:
    """Seeded random parameters (keys and shapes in the module docstring).

    Fan-in scaled normals so activations stay O(1): router and input projections ~ N(0, 1/H),
    down projections ~ N(0, 1/I). router_weight and expert_bias (~ N(0, 0.1^2), so that the bias
    really steers selection) are fp32; the rest are `dtype`.
    """
    shapes = param_shapes(cfg)
    keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
    params = {}
    for name, shape in shapes.items():
        fan_in = shape[-2] if len(shape) >= 2 else 1
        std = 0.1 if name == "expert_bias" else fan_in ** -0.5
        keep_fp32 = name in ("router_weight", "expert_bias")
        value = std * jax.random.normal(keys[name], shape, jnp.float32)
        params[name] = value if keep_fp32 else value.astype(dtype)
    return params


def check_params(params: dict, cfg: MoEConfig) -> None:
    """ValueError naming the first missing or misshapen parameter."""
    for name, shape in param_shapes(cfg).items():
        if name not in params:
            raise ValueError(f"params is missing {name!r} (expected shape {shape})")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"params[{name!r}] must have shape {shape}, got {tuple(params[name].shape)}")


def valid_mask(valid_tokens, num_tokens: int):
    """Bool `[T]` mask from None / an int count / a bool `[T]` mask (None stays None)."""
    if valid_tokens is None:
        return None
    v = jnp.asarray(valid_tokens)
    if v.ndim == 0:
        if not jnp.issubdtype(v.dtype, jnp.integer):
            raise ValueError(f"valid_tokens must be an int count or a bool [T] mask, got dtype {v.dtype}")
        return jnp.arange(num_tokens) < v
    if v.shape != (num_tokens,):
        raise ValueError(f"valid_tokens mask must have shape [T]=({num_tokens},), got {v.shape}")
    return v.astype(bool)


def router_logits(params: dict, x):
    """`x [T, H]` -> fp32 logits `[T, E]`, computed in full fp32 (HIGHEST precision: left at
    DEFAULT, GPUs round the operands to TF32 / bf16 and near-equal logits swap experts)."""
    return jnp.matmul(x.astype(jnp.float32), params["router_weight"].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route(params: dict, x, cfg: MoEConfig, valid=None, *, router_backend: str = "auto"):
    """Router step: `x [T, H]` -> (ids int32 [T, k], weights fp32 [T, k]) in HF semantics."""
    logits = router_logits(params, x)
    probs, routing_map = fused_topk_with_score_function(
        logits, cfg.topk, use_pre_softmax=cfg.use_pre_softmax, num_groups=cfg.num_groups,
        group_topk=cfg.group_topk, scaling_factor=float(cfg.scaling_factor),
        score_function=cfg.score_function, expert_bias=params.get("expert_bias") if cfg.use_expert_bias else None,
        backend=router_backend)
    ids, weights = topk_ids_and_weights(probs, routing_map, cfg.topk)
    if _overrides_normalisation(cfg):
        # The router's weights are normalised differently; recompute from the raw scores.
        if cfg.score_function == "softmax":
            raw = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
        else:
            raw = jnp.take_along_axis(_elementwise_score(logits, cfg.score_function), ids, axis=-1)
        if cfg.norm_topk_prob:
            raw = raw / (raw.sum(axis=-1, keepdims=True) + _EPS)
        weights = raw * jnp.float32(cfg.scaling_factor)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return ids, weights


def _overrides_normalisation(cfg: MoEConfig) -> bool:
    if cfg.norm_topk_prob is None:
        return False
    if cfg.score_function == "softmax":
        return cfg.use_pre_softmax and cfg.norm_topk_prob
    return cfg.norm_topk_prob != (cfg.topk > 1)


def _elementwise_score(logits, score_function):
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def shared_experts(params: dict, x, cfg: MoEConfig):
    """Shared-expert output `[T, H]` fp32 (zeros-free: only called when cfg.has_shared)."""
    y = experts.gated_mlp(x, params["shared_w_gate"], params["shared_w_up"], params["shared_w_down"],
                          cfg.activation).astype(jnp.float32)
    if cfg.shared_expert_gate:
        gate = experts.matmul_f32(x, params["shared_gate"].astype(x.dtype))  # [T, 1]
        y = jax.nn.sigmoid(gate) * y
    return y


def compiler_options(cfg: MoEConfig, num_tokens: int, *, dtype, backend: str = "auto",
                     platform: str | None = None) -> dict:
    """XLA compiler options for the jit of a program running `moe_layer` on `num_tokens` tokens.

    `jax.jit(f, compiler_options=moe.compiler_options(cfg, T, dtype=params["w_gate"].dtype))`: the
    grouped FFN sees T * topk rows (see `experts.compiler_options`); empty where the defaults are
    fastest. The same options fit `ep.ep_moe_layer`, whose ranks see the same rows per expert on
    average."""
    return experts.compiler_options(num_tokens * cfg.topk, cfg.num_experts, cfg.hidden_size,
                                    cfg.intermediate_size, dtype=dtype, backend=backend, platform=platform)


def moe_layer(params: dict, x, cfg: MoEConfig, *, backend: str = "auto", valid_tokens=None,
              return_routing: bool = False):
    """MoE layer forward `x [T, H]` -> `[T, H]` (x.dtype); see the module docstring."""
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, H={cfg.hidden_size}], got shape {x.shape}")
    check_params(params, cfg)
    if backend != "auto" and backend not in experts.BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {experts.BACKENDS}, got {backend!r}")
    t = x.shape[0]
    valid = valid_mask(valid_tokens, t)
    ids, weights = route(params, x, cfg, valid)
    if backend == "auto":
        backend = experts.choose_backend(t * cfg.topk, cfg.num_experts, cfg.hidden_size,
                                         cfg.intermediate_size, params["w_gate"].dtype)
    if backend == "native_cpu":
        out, perm = _routed_experts_native_cpu(params, x, ids, weights, valid, cfg)
    else:
        rows, perm = dispatch.permute(x, jnp.maximum(ids, 0), cfg.num_experts, valid=valid)
        ys = experts.grouped_ffn(rows, perm.group_sizes, params["w_gate"], params["w_up"], params["w_down"],
                                 activation=cfg.activation, backend=backend, capacity=t)
        out = dispatch.unpermute(ys, perm, weights, out_dtype=jnp.float32)
    if cfg.has_shared:
        out = out + shared_experts(params, x, cfg)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0.0)
    out = out.astype(x.dtype)
    if not return_routing:
        return out
    return out, {"topk_ids": ids, "topk_weights": weights, "tokens_per_expert": perm.tokens_per_expert}


def _routed_experts_native_cpu(params: dict, x, ids, weights, valid, cfg: MoEConfig):
    """(the routed experts' fp32 `[T, H]` output, its Permutation) through the C++ CPU passes: the
    layout as a counting sort, gate / up reading token rows by index (no permuted copy of x), the
    combine reading each expert row once. Each pass equals its jnp twin in the generic path
    (tests/kernels/test_native_dispatch.py) and the layer matches the oracle (test_moe.py)."""
    from expertd.kernels import native_cpu

    perm = native_cpu.layout(jnp.maximum(ids, 0), cfg.num_experts, valid=valid)
    ys = experts.grouped_ffn_native_cpu(x, perm.group_sizes, params["w_gate"], params["w_up"], params["w_down"],
                                        activation=cfg.activation, source=perm.token_of_row)
    return native_cpu.combine(ys, perm, weights), perm
