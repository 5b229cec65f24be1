"""The float64 oracle of the fixture families' MoE blocks (tests/hf_fixtures.py), restated from each
family's transformers modelling code, token by token, independently of expertd's kernels and of
kernels/moe_reference.py.

`moe_block(family, routing, c, p, x, layer, token_ids=None) -> out [T, H]` float64, where `c` is the
decoder's config.json keys (text_config for nested configs), `p` the layer's params in expertd's
layouts (as `write_checkpoint` returns them: router_weight [H, E], w_gate / w_up [E, H, I],
w_down [E, I, H], shared_w_* [H, Is] / [Is, H], and the family's extra tensors), `layer` the decoder
layer index and `token_ids [T]` the tokens' ids (hash-routed layers only).

Routing rules (`routing`, per family in hf_fixtures.SPECS):
  softmax               p = softmax(logits); top-k of p; / sum if norm_topk_prob (Mixtral and
                        friends; `softmax_renorm`: always)
  sigmoid_groups        DeepSeek-V3 / GLM: s = sigmoid; top-k of s + bias within the topk_group best
                        of n_group groups (group score = sum of its top 2; dropped groups masked to
                        0); w = s / (sum + 1e-20) if norm_topk_prob; x routed_scaling_factor
  sigmoid_renorm        MiniMax-M2: top-k of s + bias, w = s / sum
  sigmoid_scaled        Step-3.7: top-k of s + bias, w = s / (sum + 1e-20) x moe_router_scaling_factor
  softmax_groups        Mistral 4: groups (top-2 sum) on p = softmax; top-k of p; / (sum + 1e-20)
                        if norm_topk_prob (Large 4: always); x routed_scaling_factor
  softmax_probs_bias    ERNIE 4.5: top-k of p + bias; w = p / max(sum, moe_norm_min)
  logits_bias_topk      gpt-oss: logits + router bias; top-k logits; softmax over the k
  sqrtsoftplus          DeepSeek-V4: s = sqrt(softplus); top-k of s + bias, or ids = tid2eid[token
                        id] on hash layers; w = s / (sum + 1e-20) x routed_scaling_factor
  llama4                top-k logits; s = sigmoid of the k; out += expert(s * x), unweighted
  gemma4                logits of rms(x) * scale * H^-1/2; softmax, top-k, / sum, x per_expert_scale;
                        experts on rms(x) * pre_feedforward_layernorm_2; rms(sum) * post_..._2
Expert activations: SwiGLU silu(g) * u; gpt-oss (clip(u, -L, L) + 1) * g' * sigmoid(alpha g'),
g' = min(g, L); DeepSeek-V4 / GLM-5 Next silu(min(g, L)) * clip(u, -L, L) (shared too); Step-3.7
min(silu(g), L) * clip(u, -L, L) with per-layer L (0: none; shared: its own list); Gemma 4 GeGLU
(tanh gelu). Shared experts are added (Qwen: times sigmoid(x @ shared_gate)).
"""
from __future__ import annotations

import numpy as np


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def _silu(v):
    return v * _sigmoid(v)


def _gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def _rms(v, eps):
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


def _glu(family, c, layer, g, u, shared=False):
    """The expert's hidden activation act(g, u) by the family's modelling code."""
    if family == "gpt_oss":
        limit, alpha = c["swiglu_limit"], c.get("swiglu_alpha", 1.702)
        g = np.minimum(g, limit)
        return (np.clip(u, -limit, limit) + 1) * g * _sigmoid(alpha * g)
    if family in ("deepseek_v4", "glm5_next"):
        limit = c["swiglu_limit"]
        return _silu(np.minimum(g, limit)) * np.clip(u, -limit, limit)
    if family == "step3p7":
        limit = c["swiglu_limits_shared" if shared else "swiglu_limits"][layer]
        return np.minimum(_silu(g), limit) * np.clip(u, -limit, limit) if limit else _silu(g) * u
    if family == "gemma4":
        return _gelu_tanh(g) * u
    return _silu(g) * u


def _expert(family, c, layer, p, j, xin):
    g, u = xin @ p["w_gate"][j], xin @ p["w_up"][j]
    if "b_gate" in p:
        g, u = g + p["b_gate"][j], u + p["b_up"][j]
    y = _glu(family, c, layer, g, u) @ p["w_down"][j]
    return y + p["b_down"][j] if "b_down" in p else y


def _softmax(v):
    e = np.exp(v - v.max())
    return e / e.sum()


def _top(values, k):
    return np.argsort(-values, kind="stable")[:k]


def _route(routing, c, p, logits, k, e, token_id):
    """(ids, weights) of one token by `routing` (see the module docstring)."""
    renorm = routing.endswith("renorm") or c.get("norm_topk_prob", True)
    if routing in ("logits_bias_topk", "llama4"):
        ids = _top(logits, k)
        return ids, (_softmax(logits[ids]) if routing == "logits_bias_topk" else _sigmoid(logits[ids]))
    if routing == "sqrtsoftplus":
        s = np.sqrt(np.log1p(np.exp(logits)))
        ids = p["tid2eid"][token_id] if "tid2eid" in p else _top(s + p["expert_bias"], k)
        return ids, s[ids] / (s[ids].sum() + 1e-20) * c.get("routed_scaling_factor", 1.5)
    if routing == "sigmoid_scaled":
        s = _sigmoid(logits)
        ids = _top(s + p["expert_bias"], k)
        return ids, s[ids] / (s[ids].sum() + 1e-20) * c.get("moe_router_scaling_factor", 1.0)
    if routing.startswith("softmax") or routing == "gemma4":
        scores = _softmax(logits)
        choice = scores + p["expert_bias"] if routing == "softmax_probs_bias" else scores.copy()
    else:
        scores = _sigmoid(logits)
        choice = scores + p["expert_bias"]
    if "groups" in routing and c.get("n_group", 1) > 1:
        per_group = choice.reshape(c["n_group"], -1)
        kept = np.argsort(-np.sort(per_group, axis=-1)[:, -2:].sum(-1), kind="stable")[:c["topk_group"]]
        mask = np.zeros(c["n_group"], bool)
        mask[kept] = True
        choice = np.where(np.repeat(mask, e // c["n_group"]), choice, 0.0)
    ids = _top(choice, k)
    w = scores[ids]
    if routing == "softmax_probs_bias":
        return ids, w / max(w.sum(), c.get("moe_norm_min", 1e-12))
    if routing == "gemma4":
        return ids, w / w.sum() * p["per_expert_scale"][ids]
    if renorm:
        w = w / (w.sum() + (1e-20 if routing in ("sigmoid_groups", "softmax_groups") else 0.0))
    if routing in ("sigmoid_groups", "softmax_groups", "softmax_groups_renorm"):
        w = w * c.get("routed_scaling_factor", 1.0)
    return ids, w


def moe_block(family, routing, c, params, x, layer, token_ids=None, *, k, e) -> np.ndarray:
    """The family's MoE block on x `[T, H]` in float64 (see the module docstring)."""
    p = {name: np.asarray(v, np.float64) if name != "tid2eid" else np.asarray(v) for name, v in params.items()}
    x = x.astype(np.float64)
    eps = c.get("rms_norm_eps", 1e-6)
    router_in = _rms(x, eps) * p["router_input_scale"] if routing == "gemma4" else x
    logits = router_in @ p["router_weight"] + (p["router_bias"] if "router_bias" in p else 0.0)
    expert_in = _rms(x, eps) * p["expert_input_norm_weight"] if routing == "gemma4" else x
    out = np.zeros_like(x)
    for t in range(len(x)):
        ids, w = _route(routing, c, p, logits[t], k, e, None if token_ids is None else int(token_ids[t]))
        for weight, j in zip(w, ids):
            if routing == "llama4":  # the weight scales the expert's input; the outputs add unweighted
                out[t] += _expert(family, c, layer, p, j, weight * expert_in[t])
            else:
                out[t] += weight * _expert(family, c, layer, p, j, expert_in[t])
    if routing == "gemma4":
        out = _rms(out, eps) * p["expert_output_norm_weight"]
    if "shared_w_gate" in p:
        act = _glu(family, c, layer, x @ p["shared_w_gate"], x @ p["shared_w_up"], shared=True)
        shared = act @ p["shared_w_down"]
        if "shared_gate" in p:
            shared = shared * _sigmoid(x @ p["shared_gate"])
        out += shared
    return out
