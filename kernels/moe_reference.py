"""The float64 whole-layer reference of the MoE layer (numpy, no JAX): what every backend, the
expert-parallel layer and a GPU run are checked against.

Written token by token from the Hugging Face models' semantics, independent of the JAX code it
checks: Mixtral, Qwen2/3-MoE, DeepSeek-V3, and the families of docs/semantics.md (gpt-oss,
DeepSeek-V4 and its hash-routed layers, GLM-5 Next, Step-3.7, ERNIE 4.5, Llama 4, Mistral 4,
Gemma 4). It loops over tokens: router (input norm, logits and their bias, scores, group-limited
top-k with selection bias, or the hash table, weights, normalisation, scaling, per-expert scale),
each chosen expert's gated MLP (clamps, gpt-oss's activation, biases, the weight on the input), the
weighted sum, its norm and the (optionally gated) shared expert. Near-ties at the top-k boundary
are flagged, since fp32 and fp64 logits may legitimately pick different experts there; comparisons
keep to the other tokens.

  moe_oracle(params, x [T, H], cfg, valid=None, token_ids=None) -> OracleResult (out [T, H]
      float64, ids / weights [T, k] by descending weight, tokens_per_expert [E], near_tie [T]);
      params a dict of the layer's arrays (jax or numpy, any float dtype) by MoEParams field name.
  route_token(logits [E] float64, cfg, bias, table_row=None) -> OracleRoute: one token's routing.
  family_config(family, num_experts, topk, hidden, intermediate) -> MoEConfig with the router
      settings of one of FAMILIES or SEMANTIC_FAMILIES at a test shape (HASH_VOCAB: the vocabulary
      of the test hash tables).
  tolerance(dtype), max_error(out, ref), assert_close_to_oracle(out, ref, dtype): the comparison
      (error per unit of output scale, near-tie tokens left out).

Imports only numpy and `expertd.kernels.config` (`import expertd.kernels.moe_reference` loads no
JAX), so tests, benchmarks and tools can use it without the kernels' runtime.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from expertd.kernels.config import MoEConfig

# Selection scores whose boundary gap is below REL * magnitude + ABS count as a near-tie (fp32 vs
# fp64 logits differ by ~1e-7 relative).
TIE_REL, TIE_ABS = 1e-5, 1e-7
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
# The families of the semantics of issue 25 (docs/semantics.md), at test shapes.
SEMANTIC_FAMILIES = ("gpt_oss", "deepseek_v4", "deepseek_v4_hash", "glm5_next", "step3p7", "ernie4_5_moe",
                     "llama4", "mistral4", "gemma4")
HASH_VOCAB = 50  # vocabulary of the test hash tables


def family_config(family: str, num_experts: int, topk: int, hidden: int, intermediate: int,
                  activation: str = "silu") -> MoEConfig:
    """A MoEConfig with `family`'s router settings at a (possibly tiny) test shape."""
    base = dict(num_experts=num_experts, topk=topk, hidden_size=hidden, intermediate_size=intermediate,
                activation=activation)
    if family == "mixtral":
        return MoEConfig(**base)
    if family == "qwen2_moe":  # norm_topk_prob=False, sigmoid-gated shared expert
        return MoEConfig(**base, use_pre_softmax=True, num_shared_experts=1,
                         shared_intermediate_size=intermediate + 8, shared_expert_gate=True)
    if family == "deepseek_v3":
        groups = {}
        if num_experts >= 2:
            num_groups = min(8, num_experts // 2) if num_experts >= 4 else num_experts
            group_topk = max(1, topk // 2)
            if topk % group_topk == 0 and topk // group_topk <= num_experts // num_groups \
                    and group_topk <= num_groups:
                groups = dict(num_groups=num_groups, group_topk=group_topk)
        return MoEConfig(**base, score_function="sigmoid", use_expert_bias=True, norm_topk_prob=True,
                         scaling_factor=2.5, num_shared_experts=1, shared_intermediate_size=intermediate,
                         **groups)
    if family in SEMANTIC_FAMILIES:
        return semantic_family_config(family, num_experts, topk, hidden, intermediate)
    raise ValueError(f"unknown family {family!r}")


def semantic_family_config(family: str, num_experts: int, topk: int, hidden: int, intermediate: int) -> MoEConfig:
    """A MoEConfig with the semantics of `family` (SEMANTIC_FAMILIES) at a test shape; limits are
    scaled to the test weights (activations ~ 1) so that the clamps really cut."""
    base = dict(num_experts=num_experts, topk=topk, hidden_size=hidden, intermediate_size=intermediate)
    shared = dict(num_shared_experts=1, shared_intermediate_size=intermediate)
    if family == "gpt_oss":
        return MoEConfig(**base, router_bias=True, expert_proj_bias=True, activation="swiglu_oai",
                         swiglu_limit=1.0, swiglu_alpha=1.702)
    if family in ("deepseek_v4", "deepseek_v4_hash"):
        hashed = dict(hash_vocab_size=HASH_VOCAB) if family == "deepseek_v4_hash" else dict(use_expert_bias=True)
        return MoEConfig(**base, **shared, **hashed, score_function="sqrtsoftplus", norm_topk_prob=True,
                         scaling_factor=1.5, swiglu_limit=0.8, shared_swiglu_limit=0.8)
    if family == "glm5_next":
        groups = _hf_groups(num_experts, topk)
        return MoEConfig(**base, **shared, **groups, score_function="sigmoid", use_expert_bias=True,
                         norm_topk_prob=True, scaling_factor=2.5, swiglu_limit=0.8, shared_swiglu_limit=0.8)
    if family == "step3p7":
        return MoEConfig(**base, **shared, score_function="sigmoid", use_expert_bias=True, norm_topk_prob=True,
                         scaling_factor=3.0, swiglu_limit=0.3, shared_swiglu_limit=0.5,
                         swiglu_limit_mode="after_activation")
    if family == "ernie4_5_moe":
        return MoEConfig(**base, **shared, use_pre_softmax=True, use_expert_bias=True, norm_topk_prob=True,
                         norm_topk_min=0.5)
    if family == "llama4":
        return MoEConfig(**base, **shared, score_function="sigmoid", norm_topk_prob=False,
                         router_weight_on_input=True)
    if family == "mistral4":
        return MoEConfig(**base, **shared, **_hf_groups(num_experts, topk), use_pre_softmax=True,
                         norm_topk_prob=True, scaling_factor=1.5)
    if family == "gemma4":
        return MoEConfig(**base, activation="gelu_tanh", router_input_norm=True, per_expert_scale=True,
                         expert_input_norm=True, expert_output_norm=True)
    raise ValueError(f"unknown family {family!r}")


def _hf_groups(num_experts: int, topk: int) -> dict:
    """Hugging Face's group-limited routing (group score = its top 2) where the shape allows it."""
    for num_groups in (4, 2):
        size = num_experts // num_groups
        group_topk = num_groups // 2
        if num_experts % num_groups == 0 and size >= 2 and topk <= group_topk * size:
            return dict(num_groups=num_groups, group_topk=group_topk, group_score_topk=2)
    return {}


def _f64(a) -> np.ndarray:
    return np.asarray(np.asarray(a).astype(np.float32), dtype=np.float64)


def _act(v, name):
    if name == "silu":
        return v / (1.0 + np.exp(-v))
    if name == "gelu":
        return 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0)))
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def _glu(g, u, cfg: MoEConfig, limit):
    """The gated activation of modeling_gpt_oss.py / modeling_deepseek_v4.py / modeling_step3p7.py."""
    if cfg.activation == "swiglu_oai":
        if limit is not None:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-cfg.swiglu_alpha * g))
    if limit is None:
        return _act(g, cfg.activation) * u
    if cfg.swiglu_limit_mode == "before_activation":
        return _act(np.minimum(g, limit), cfg.activation) * np.clip(u, -limit, limit)
    return np.minimum(_act(g, cfg.activation), limit) * np.clip(u, -limit, limit)


def _mlp(x, wg, wu, wd, cfg: MoEConfig, limit=None, bias=None):
    g, u = x @ wg, x @ wu
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    y = _glu(g, u, cfg, limit) @ wd
    return y if bias is None else y + bias[2]


def _rms(v, weight, eps):
    return v / np.sqrt(np.mean(v * v) + eps) * (1.0 if weight is None else weight)


def _score(logits, name):
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if name == "sqrtsoftplus":
        return np.sqrt(np.log1p(np.exp(logits)))
    probs = np.exp(logits - logits.max())
    return probs / probs.sum()


def _top(values, k):
    """Indices of the k largest values (ties to the lower index) and whether the boundary is a near-tie."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    if k == len(values) or values[order[k]] == -math.inf:
        return order[:k], False
    a, b = values[order[k - 1]], values[order[k]]
    return order[:k], a - b < TIE_REL * max(abs(a), abs(b)) + TIE_ABS


@dataclass
class OracleRoute:
    ids: list[int]
    weights: list[float]
    near_tie: bool


def route_token(logits: np.ndarray, cfg: MoEConfig, bias, table_row=None) -> OracleRoute:
    """One token's routing from float64 logits `[E]` (table_row: its tid2eid row, hash routing)."""
    e, k = cfg.num_experts, cfg.topk
    if table_row is not None:  # DeepseekV4HashRouter: ids from the table, weights from the scores
        scores = _score(logits, cfg.score_function)
        ids = [int(i) for i in table_row]
        return OracleRoute(ids, list(_weights(scores[ids], cfg)), False)
    ties = []
    if cfg.score_function == "softmax":
        probs = _score(logits, "softmax")
        select = (probs + (bias if bias is not None else 0.0)) if cfg.use_pre_softmax else logits
    else:
        scores = _score(logits, cfg.score_function)
        select = scores + (bias if bias is not None else 0.0)
    if cfg.group_topk:
        size = e // cfg.num_groups
        per_group = cfg.group_score_topk or k // cfg.group_topk
        group_score = [sum(sorted(select[g * size:(g + 1) * size], reverse=True)[:per_group])
                       for g in range(cfg.num_groups)]
        kept, tie = _top(group_score, cfg.group_topk)
        ties.append(tie)
        select = np.array([select[i] if i // size in kept else -np.inf for i in range(e)])
    ids, tie = _top(list(select), k)
    ties.append(tie)
    if cfg.score_function == "softmax" and not cfg.use_pre_softmax:
        w = np.exp(logits[ids] - logits[ids].max())
        w = w / w.sum() * cfg.scaling_factor
    elif cfg.score_function == "softmax":
        w = probs[ids]
        w = (_normalised(w, cfg) if cfg.norm_topk_prob else w) * cfg.scaling_factor
    else:
        w = _weights(scores[ids], cfg)
    return OracleRoute(list(ids), list(w), any(ties))


def _normalised(w, cfg: MoEConfig):
    if cfg.norm_topk_min is not None:  # ERNIE: w / clamp(sum, min=norm_min)
        return w / max(w.sum(), cfg.norm_topk_min)
    return w / (w.sum() + 1e-20)


def _weights(w, cfg: MoEConfig):
    """Sigmoid-type weights: normalised as norm_topk_prob says (None: when k > 1), times scaling."""
    normalise = (cfg.topk > 1) if cfg.norm_topk_prob is None else cfg.norm_topk_prob
    return (_normalised(w, cfg) if normalise else w) * cfg.scaling_factor


@dataclass
class OracleResult:
    out: np.ndarray  # [T, H] float64
    ids: np.ndarray  # [T, k] int (descending weight; -1 on padding rows)
    weights: np.ndarray  # [T, k] float64
    tokens_per_expert: np.ndarray  # [E]
    near_tie: np.ndarray  # [T] bool


def moe_oracle(params: dict, x, cfg: MoEConfig, valid=None, token_ids=None) -> OracleResult:
    """Token-by-token float64 MoE layer over `x [T, H]` (params/x may be bf16 jax or numpy arrays;
    token_ids [T] for a hash-routed layer)."""
    p = {name: (np.asarray(v) if name == "tid2eid" else _f64(v)) for name, v in params.items()}
    x = _f64(x)
    t, k = x.shape[0], cfg.topk
    valid = np.ones(t, bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros_like(x)
    ids = -np.ones((t, k), np.int64)
    weights = np.zeros((t, k))
    near_tie = np.zeros(t, bool)
    tokens_per_expert = np.zeros(cfg.num_experts, np.int64)
    for i in range(t):
        if not valid[i]:
            continue
        r = _route_row(p, x[i], cfg, None if token_ids is None else int(np.asarray(token_ids)[i]))
        order = sorted(range(k), key=lambda j: (-r.weights[j], r.ids[j]))
        ids[i] = [r.ids[j] for j in order]
        weights[i] = [r.weights[j] for j in order]
        near_tie[i] = r.near_tie
        xe = _rms(x[i], p["expert_input_norm_weight"], cfg.norm_eps) if cfg.expert_input_norm else x[i]
        routed = np.zeros_like(x[i])
        for e, w in zip(r.ids, r.weights):
            tokens_per_expert[e] += 1
            bias = (p["b_gate"][e], p["b_up"][e], p["b_down"][e]) if cfg.expert_proj_bias else None
            mlp = functools.partial(_mlp, wg=p["w_gate"][e], wu=p["w_up"][e], wd=p["w_down"][e], cfg=cfg,
                                    limit=cfg.swiglu_limit, bias=bias)
            routed += mlp(w * xe) if cfg.router_weight_on_input else w * mlp(xe)  # Llama 4: experts(w * x)
        out[i] = _rms(routed, p["expert_output_norm_weight"], cfg.norm_eps) if cfg.expert_output_norm else routed
        if cfg.has_shared:
            shared = _mlp(x[i], p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"], cfg, cfg.shared_swiglu_limit)
            if cfg.shared_expert_gate:
                shared = shared / (1.0 + np.exp(-(x[i] @ p["shared_gate"][:, 0])))
            out[i] += shared
    return OracleResult(out, ids, weights, tokens_per_expert, near_tie)


def _route_row(p: dict, x, cfg: MoEConfig, token_id):
    """One token's OracleRoute: the router's input norm, logits (+ bias), routing, per-expert scale."""
    h = _rms(x, p["router_input_scale"], cfg.norm_eps) if cfg.router_input_norm else x
    logits = h @ p["router_weight"] + (p["router_bias"] if cfg.router_bias else 0.0)
    row = p["tid2eid"][token_id] if cfg.hash_routed else None
    r = route_token(logits, cfg, p.get("expert_bias") if cfg.use_expert_bias else None, row)
    if cfg.per_expert_scale:  # Gemma 4: after renormalisation
        r.weights = [w * p["per_expert_scale"][e] for e, w in zip(r.ids, r.weights)]
    return r


def tolerance(dtype) -> float:
    """Max abs error allowed per unit of output scale: fp32 is exact math up to rounding; bf16
    rounds the inputs of every matmul (the activation product and the output too)."""
    return 3e-2 if np.dtype(dtype) != np.float32 else 2e-5


def max_error(out, ref: OracleResult) -> tuple[float, float]:
    """(largest abs error of `out [T, H]` on the tokens without a near-tie, the output's scale: the
    oracle's largest magnitude, at least 1); errors are judged as err <= tolerance(dtype) * scale."""
    keep = ~ref.near_tie
    err = float(np.abs(_f64(out)[keep] - ref.out[keep]).max()) if keep.any() else 0.0
    return err, max(1.0, float(np.abs(ref.out).max()))


def assert_close_to_oracle(out, ref: OracleResult, dtype, *, what: str = "output"):
    """Compare `out [T, H]` with the oracle on the tokens without a near-tie."""
    out = _f64(out)
    keep = ~ref.near_tie
    if ref.near_tie.sum() > max(1, 0.05 * len(keep)):
        raise AssertionError(f"too many near-ties ({ref.near_tie.sum()} of {len(keep)}): test inputs are degenerate")
    assert np.isfinite(out).all(), f"{what}: non-finite values"
    err, scale = max_error(out, ref)
    assert err <= tolerance(dtype) * scale, f"{what}: max abs error {err:.3g} > {tolerance(dtype) * scale:.3g}"
