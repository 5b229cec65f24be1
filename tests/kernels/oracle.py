"""Float64 numpy oracle of the MoE layer, written token by token from the Hugging Face models'
semantics (Mixtral, Qwen2/3-MoE, DeepSeek-V3), independent of the JAX code under test.

`moe_oracle(params, x, cfg, valid)` loops over tokens: router (scores, group-limited top-k with
selection bias, weights, normalisation, scaling), each chosen expert's gated MLP, the weighted sum
and the (optionally gated) shared expert. Near-ties at the top-k boundary are flagged, since fp32
and fp64 logits may legitimately pick different experts there; tests compare the other tokens.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import numpy as np

from expertd.kernels.moe import MoEConfig

# Selection scores whose boundary gap is below REL * magnitude + ABS count as a near-tie (fp32 vs
# fp64 logits differ by ~1e-7 relative).
TIE_REL, TIE_ABS = 1e-5, 1e-7
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")


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
    raise ValueError(f"unknown family {family!r}")


def _f64(a) -> np.ndarray:
    return np.asarray(np.asarray(a).astype(np.float32), dtype=np.float64)


def _act(v, name):
    if name == "silu":
        return v / (1.0 + np.exp(-v))
    if name == "gelu":
        return 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0)))
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def _mlp(x, wg, wu, wd, act):
    return (_act(x @ wg, act) * (x @ wu)) @ wd


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


def route_token(logits: np.ndarray, cfg: MoEConfig, bias) -> OracleRoute:
    """One token's routing from float64 logits `[E]`."""
    e, k = cfg.num_experts, cfg.topk
    ties = []
    if cfg.score_function == "softmax":
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        select = probs if cfg.use_pre_softmax else logits
    else:
        scores = 1.0 / (1.0 + np.exp(-logits)) if cfg.score_function == "sigmoid" \
            else np.sqrt(np.log1p(np.exp(logits)))
        select = scores + (bias if bias is not None else 0.0)
    if cfg.group_topk:
        size = e // cfg.num_groups
        group_score = [sum(sorted(select[g * size:(g + 1) * size], reverse=True)[:k // cfg.group_topk])
                       for g in range(cfg.num_groups)]
        kept, tie = _top(group_score, cfg.group_topk)
        ties.append(tie)
        select = np.array([select[i] if i // size in kept else -np.inf for i in range(e)])
    ids, tie = _top(list(select), k)
    ties.append(tie)
    if cfg.score_function == "softmax" and not cfg.use_pre_softmax:
        w = np.exp(logits[ids] - logits[ids].max())
        w /= w.sum()
    elif cfg.score_function == "softmax":
        w = probs[ids]
        if cfg.norm_topk_prob:
            w = w / w.sum()
    else:
        w = scores[ids]
        normalise = (k > 1) if cfg.norm_topk_prob is None else cfg.norm_topk_prob
        if normalise:
            w = w / (w.sum() + 1e-20)
    w = w * cfg.scaling_factor
    return OracleRoute(list(ids), list(w), any(ties))


@dataclass
class OracleResult:
    out: np.ndarray  # [T, H] float64
    ids: np.ndarray  # [T, k] int (descending weight; -1 on padding rows)
    weights: np.ndarray  # [T, k] float64
    tokens_per_expert: np.ndarray  # [E]
    near_tie: np.ndarray  # [T] bool


def moe_oracle(params: dict, x, cfg: MoEConfig, valid=None) -> OracleResult:
    """Token-by-token float64 MoE layer over `x [T, H]` (params/x may be bf16 jax or numpy arrays)."""
    p = {name: _f64(v) for name, v in params.items()}
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
        r = route_token(x[i] @ p["router_weight"], cfg, p.get("expert_bias"))
        order = sorted(range(k), key=lambda j: (-r.weights[j], r.ids[j]))
        ids[i] = [r.ids[j] for j in order]
        weights[i] = [r.weights[j] for j in order]
        near_tie[i] = r.near_tie
        for e, w in zip(r.ids, r.weights):
            tokens_per_expert[e] += 1
            out[i] += w * _mlp(x[i], p["w_gate"][e], p["w_up"][e], p["w_down"][e], cfg.activation)
        if cfg.has_shared:
            shared = _mlp(x[i], p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"], cfg.activation)
            if cfg.shared_expert_gate:
                shared = shared / (1.0 + np.exp(-(x[i] @ p["shared_gate"][:, 0])))
            out[i] += shared
    return OracleResult(out, ids, weights, tokens_per_expert, near_tie)


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


# Test programs are tiny, so XLA's backend optimisation is wasted time: compile at level 0.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_fast(fn, *args):
    """jit-compile fn for args with FAST_COMPILE; returns the compiled executable."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def compile_all(build, points):
    """{point: build(point)} built on two threads (XLA compiles outside the GIL)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(points, pool.map(build, points)))
