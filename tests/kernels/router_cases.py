"""Router test helpers: an independent float64 NumPy oracle and tie-free input generators.

The oracle restates moe-semantics.md sections 1.2, 1.6, 2.1 and 2.2 with NumPy in float64, without
using expertd code, so the jnp reference is itself checked against the math.
"""
from __future__ import annotations

import numpy as np

EPS = 1e-20


def np_activation(x, score_function):
    if score_function == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return np.sqrt(softplus)


def np_softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def np_topk_mask(scores, k):
    """Bool mask of the k largest per row; ties to the lowest index (stable sort)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    mask = np.zeros(scores.shape, bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def np_group_mask(scores, topk, num_groups, group_topk, group_score_topk=None):
    """Kept-group mask; a group's score is the sum of its top topk // group_topk (TE), or of its
    top group_score_topk (Hugging Face's 2)."""
    t, e = scores.shape
    per_group = scores.reshape(t, num_groups, e // num_groups)
    group_scores = np.sort(per_group, axis=-1)[..., -(group_score_topk or topk // group_topk):].sum(-1)
    kept = np_topk_mask(group_scores, group_topk)
    return np.repeat(kept, e // num_groups, axis=-1), group_scores


def np_selection_scores(x, score_function, use_pre_softmax, bias):
    if score_function == "softmax":
        if not use_pre_softmax:
            return x.copy()
        return np_softmax(x) if bias is None else np_softmax(x) + bias  # ERNIE 4.5: probs + bias
    s = np_activation(x, score_function)
    return s if bias is None else s + bias


def np_router(logits, topk, *, score_function="softmax", use_pre_softmax=False, num_groups=0,
              group_topk=0, scaling_factor=1.0, expert_bias=None, group_score_topk=None):
    """float64 (probs [T, E], routing_map [T, E]) for `[T, E]` logits."""
    x = np.asarray(logits, np.float64)
    bias = None if expert_bias is None else np.asarray(expert_bias, np.float64)
    sel = np_selection_scores(x, score_function, use_pre_softmax, bias)
    if group_topk and group_topk > 0:
        sel = np.where(np_group_mask(sel, topk, num_groups, group_topk, group_score_topk)[0], sel, -np.inf)
    rmap = np_topk_mask(sel, topk)
    if score_function == "softmax":
        if use_pre_softmax:
            w = np.where(rmap, np_softmax(x), 0.0)
        else:
            w = np.where(rmap, np_softmax(np.where(rmap, x, -np.inf)), 0.0)
    else:
        w = np.where(rmap, np_activation(x, score_function), 0.0)
        if topk > 1:
            w = w / (w.sum(-1, keepdims=True) + EPS)
    return w * scaling_factor, rmap


def np_router_grad(logits, rmap, grad_probs, topk, *, score_function="softmax",
                   use_pre_softmax=False, scaling_factor=1.0):
    """float64 d loss / d logits given d loss / d probs, by the formulas of section 1.6."""
    x = np.asarray(logits, np.float64)
    g = np.asarray(grad_probs, np.float64) * scaling_factor
    if score_function == "softmax":
        if use_pre_softmax:
            p = np_softmax(x)
            g = np.where(rmap, g, 0.0)
        else:
            p = np.where(rmap, np_softmax(np.where(rmap, x, -np.inf)), 0.0)
            g = np.where(rmap, g, 0.0)
        return p * (g - (g * p).sum(-1, keepdims=True))
    a = np_activation(x, score_function)
    g = np.where(rmap, g, 0.0)
    if topk > 1:
        s = np.where(rmap, a, 0.0).sum(-1, keepdims=True) + EPS
        d = (g * np.where(rmap, a, 0.0)).sum(-1, keepdims=True)
        g = np.where(rmap, g / s - d / s**2, 0.0)
    if score_function == "sigmoid":
        return g * a * (1.0 - a)
    slope = np.where(x > 20.0, 1.0, 1.0 / (1.0 + np.exp(-x)))
    return g * slope / (2.0 * a + EPS)


def np_aux_scores(logits, topk, score_function):
    x = np.asarray(logits, np.float64)
    if score_function == "softmax":
        s = np_softmax(x)
    else:
        a = np_activation(x, score_function)
        s = a / (a.sum(-1, keepdims=True) + EPS)
    return s, np_topk_mask(s, topk)


def np_aux_loss(probs, tokens_per_expert, topk, coeff, num_experts=None, total_num_tokens=None):
    probs = np.asarray(probs, np.float64)
    t = probs.shape[0] if total_num_tokens is None else total_num_tokens
    e = probs.shape[1] if num_experts is None else num_experts
    return float((probs.sum(0) * np.asarray(tokens_per_expert, np.float64)).sum() * e * coeff / (topk * t * t))


def _margins(x, topk, score_function, use_pre_softmax, num_groups, group_topk, bias, group_score_topk=None):
    """Per-row smallest gap (relative) at the expert and group selection boundaries."""
    sel = np_selection_scores(x, score_function, use_pre_softmax, bias)
    margin = np.full(x.shape[0], np.inf)
    if group_topk:
        gmask, gscores = np_group_mask(sel, topk, num_groups, group_topk, group_score_topk)
        srt = -np.sort(-gscores, axis=-1)
        if group_topk < num_groups:
            margin = np.minimum(margin, (srt[:, group_topk - 1] - srt[:, group_topk]) / (np.abs(srt[:, 0]) + 1e-30))
        sel = np.where(gmask, sel, -np.inf)
        # inside groups: the top-(topk/group_topk) boundary of every group decides the group score
        per_group = -np.sort(-np_selection_scores(x, score_function, use_pre_softmax, bias).reshape(
            x.shape[0], num_groups, -1), axis=-1)
        kpg = group_score_topk or topk // group_topk
        if kpg < per_group.shape[-1]:
            gap = (per_group[..., kpg - 1] - per_group[..., kpg]).min(-1)
            margin = np.minimum(margin, gap / (np.abs(per_group[..., 0]).max(-1) + 1e-30))
    srt = -np.sort(-sel, axis=-1)
    if topk < x.shape[1]:
        margin = np.minimum(margin, (srt[:, topk - 1] - srt[:, topk]) / (np.abs(srt[:, 0]) + 1e-30))
    return margin


def tie_free_logits(seed, t, e, topk, *, dtype=np.float32, score_function="softmax",
                    use_pre_softmax=False, num_groups=0, group_topk=0, expert_bias=None,
                    scale=2.0, min_margin=1e-4, group_score_topk=None):
    """Random `[T, E]` logits (as `dtype`, returned as float32 NumPy or ml_dtypes) whose selection
    boundaries (k-th vs (k+1)-th score, kept vs dropped group) are separated by min_margin
    (relative), so no backend may legitimately choose differently. Rows are redrawn until so."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, e)) * scale).astype(dtype)
    bias = None if expert_bias is None else np.asarray(expert_bias, np.float64)
    for _ in range(200):
        m = _margins(x.astype(np.float64), topk, score_function, use_pre_softmax, num_groups, group_topk, bias,
                     group_score_topk)
        bad = ~(m > min_margin)
        if not bad.any():
            return x
        x[bad] = (rng.standard_normal((int(bad.sum()), e)) * scale).astype(dtype)
    raise RuntimeError("could not draw tie-free logits")


def te_logits(t, e, score_function):
    """TransformerEngine's deterministic tie-free test logits (moe-semantics.md 5.3), float32."""
    if score_function == "softmax":
        return ((np.arange(t * e) - t * e // 2) * 1e-4).reshape(t, e).astype(np.float32)
    ee, tt = np.meshgrid(np.arange(e), np.arange(t))
    return ((ee - e // 2) * 1e-2 + (tt - t // 2) * 1e-4).astype(np.float32)


def te_bias(e):
    return ((e - 1 - np.arange(e)) * 0.1).astype(np.float32)
