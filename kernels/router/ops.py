"""The router's public ops (the door, `expertd.kernels.router`, re-exports them): argument
checks, the static RouterConfig they make, the backend choice ("auto" per platform) and the custom
VJP the fast backends share (the reference's weights differentiated for the chosen map).
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels.router import xla as router_xla
from expertd.kernels.router.reference import SCORE_FUNCTIONS, RouterConfig, router_reference, routing_weights

BACKENDS = ("auto", "reference", "xla", "pallas")
# Chosen from benchmarks/router.py (BENCHMARKS.md, "Router"). GPU: "xla" until the Pallas router's
# gain at large T (BENCHMARKS.md, H100) is confirmed for grouped routers and small T, where it is not.
AUTO_BACKEND = {"cpu": "xla", "gpu": "xla", "cuda": "xla", "rocm": "xla", "tpu": "xla"}
LOGITS_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a Python bool, got {value!r}")
    return bool(value)


def _grouping(num_groups, group_topk, topk: int, num_experts: int, group_score_topk=None) -> tuple[int, int, int]:
    """Validated (num_groups, group_topk, group_score_topk); zeros when grouping is off (None or
    <= 0) and group_score_topk 0 for TE's rule (topk // group_topk)."""
    for name, value in (("num_groups", num_groups), ("group_topk", group_topk), ("group_score_topk", group_score_topk)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be an int or None, got {value!r}")
    if group_topk is None or group_topk <= 0:
        return 0, 0, 0
    if num_groups is None or num_groups <= 0:
        raise ValueError(f"group_topk={group_topk} needs num_groups > 0, got num_groups={num_groups!r}")
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups must divide the number of experts E={num_experts}, got num_groups={num_groups}")
    if group_topk > num_groups:
        raise ValueError(f"group_topk must be <= num_groups={num_groups}, got group_topk={group_topk}")
    group_size = num_experts // num_groups
    if group_score_topk is not None:  # Hugging Face's rule: a fixed number of scores per group
        if not 1 <= group_score_topk <= group_size:
            raise ValueError(f"group_score_topk must be in [1, E // num_groups = {group_size}], got {group_score_topk}")
        if topk > group_topk * group_size:
            raise ValueError(f"topk must be <= the {group_topk * group_size} experts of the kept groups, got {topk}")
        return int(num_groups), int(group_topk), int(group_score_topk)
    if topk % group_topk:
        raise ValueError(f"topk must be a multiple of group_topk={group_topk}, got topk={topk}")
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(
            f"topk // group_topk must be <= experts per group ({num_experts // num_groups}), "
            f"got topk={topk}, group_topk={group_topk}")
    return int(num_groups), int(group_topk), 0


def _check_logits(logits, name: str = "logits"):
    if not hasattr(logits, "shape") or not hasattr(logits, "dtype"):
        raise ValueError(f"{name} must be a JAX or NumPy array [..., E], got {type(logits).__name__}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., E] with E >= 1, got shape {tuple(logits.shape)}")
    if jnp.dtype(logits.dtype) not in [jnp.dtype(d) for d in LOGITS_DTYPES]:
        raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {logits.dtype}")


def make_router_config(logits, topk, *, use_pre_softmax, num_groups, group_topk, scaling_factor,
                       score_function, expert_bias, compute_aux_scores, group_score_topk=None) -> RouterConfig:
    """Validate the router arguments (ValueError naming the argument) into a RouterConfig."""
    _check_logits(logits)
    num_experts = logits.shape[-1]
    if not _is_int(topk) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in [1, E={num_experts}], got {topk!r}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    use_pre_softmax = _check_bool("use_pre_softmax", use_pre_softmax)
    compute_aux_scores = _check_bool("compute_aux_scores", compute_aux_scores)
    if use_pre_softmax and score_function != "softmax":
        raise ValueError(
            f"use_pre_softmax=True applies to score_function='softmax' only, got {score_function!r}")
    if isinstance(scaling_factor, jax.Array) or not isinstance(scaling_factor, numbers.Real) \
            or isinstance(scaling_factor, bool):
        raise ValueError(f"scaling_factor must be a Python float or int, got {type(scaling_factor).__name__}")
    if not math.isfinite(scaling_factor):
        raise ValueError(f"scaling_factor must be finite, got {scaling_factor}")
    num_groups, group_topk, group_score_topk = _grouping(num_groups, group_topk, topk, num_experts, group_score_topk)
    if expert_bias is not None:
        if score_function == "softmax" and not use_pre_softmax:
            raise ValueError("expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus', or 'softmax' with "
                             "use_pre_softmax=True; got softmax post-top-k")
        if not hasattr(expert_bias, "shape") or tuple(expert_bias.shape) != (num_experts,):
            raise ValueError(
                f"expert_bias must have shape [E]=({num_experts},), got {getattr(expert_bias, 'shape', expert_bias)!r}")
        if not jnp.issubdtype(expert_bias.dtype, jnp.floating):
            raise ValueError(f"expert_bias must be a float array, got dtype {expert_bias.dtype}")
    return RouterConfig(
        topk=int(topk), score_function=score_function, use_pre_softmax=use_pre_softmax,
        num_groups=num_groups, group_topk=group_topk, scaling_factor=float(scaling_factor),
        has_bias=expert_bias is not None, aux_scores=compute_aux_scores, group_score_topk=group_score_topk)


def resolve_backend(backend: str) -> str:
    """The concrete backend for `backend` ("auto" resolves per platform)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return AUTO_BACKEND.get(jax.default_backend(), "xla")
    return backend


def _forward_impl(backend: str):
    if backend == "xla":
        return router_xla.router_xla
    from expertd.kernels.router import pallas as router_pallas  # imported lazily: Pallas is only needed here

    return router_pallas.router_pallas


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fast_router(backend, cfg, logits, expert_bias):
    return _forward_impl(backend)(logits, expert_bias, cfg)


def _fast_router_fwd(backend, cfg, logits, expert_bias):
    probs, routing_map = _forward_impl(backend)(logits, expert_bias, cfg)
    return (probs, routing_map), (logits, expert_bias, routing_map)


def _fast_router_bwd(backend, cfg, residuals, cotangents):
    # Selection is piecewise constant: differentiate the weights for the chosen map (fp32 math).
    logits, expert_bias, routing_map = residuals
    grad_probs, _ = cotangents
    _, vjp = jax.vjp(lambda x: routing_weights(x, expert_bias, routing_map, cfg), logits)
    (grad_logits,) = vjp(grad_probs)
    grad_bias = None if expert_bias is None else jnp.zeros_like(expert_bias)  # selection only
    return grad_logits, grad_bias


_fast_router.defvjp(_fast_router_fwd, _fast_router_bwd)


def fused_topk_with_score_function(logits, topk, *, use_pre_softmax=False, num_groups=None,
                                   group_topk=None, scaling_factor=1.0, score_function="softmax",
                                   expert_bias=None, compute_aux_scores=False, backend="auto",
                                   group_score_topk=None):
    """Route each token to its top-k experts.

    Args:
      logits: `[..., E]` float32 / bfloat16 / float16 router logits; leading dims are tokens.
      topk: experts per token, 1 <= topk <= E.
      use_pre_softmax: softmax only. True: softmax over all E, then top-k of the probabilities (not
        renormalised). False: top-k of the logits, then softmax over the k selected.
      num_groups, group_topk: group-limited top-k (DeepSeek-V3): keep the `group_topk` groups (of
        E / num_groups experts) with the largest sum of their top `topk // group_topk` scores.
        None or a value <= 0 for group_topk disables grouping.
      group_score_topk: (beyond TE) sum each group's top `group_score_topk` scores instead
        (Hugging Face's DeepSeek-V3 / Mistral 4 rule: 2); then topk need not be a multiple of
        group_topk.
      scaling_factor: Python float multiplying the final weights.
      score_function: "softmax", "sigmoid" or "sqrtsoftplus". Sigmoid / sqrtsoftplus weights are
        normalised to sum to 1 when topk > 1.
      expert_bias: `[E]` float, added for selection only (no gradient): sigmoid / sqrtsoftplus
        scores, or (beyond TE, ERNIE 4.5) softmax-pre probabilities, whose weights stay unbiased.
      compute_aux_scores: return dense float32 scores for the aux loss (softmax, or normalised
        sigmoid / sqrtsoftplus, over all E, for every topk) and their top-k map; grouping, bias,
        pre-softmax and scaling are ignored (as TE).
      backend: "auto", "reference", "xla" or "pallas".

    Returns:
      probs: `[..., E]` in the logits dtype (float32 with compute_aux_scores), zero off-route.
      routing_map: bool `[..., E]`, exactly topk True per row.
    """
    cfg = make_router_config(
        logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias,
        compute_aux_scores=compute_aux_scores, group_score_topk=group_score_topk)
    backend = resolve_backend(backend)
    bias = None if (expert_bias is None or cfg.aux_scores) else jnp.asarray(expert_bias)
    logits = jnp.asarray(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    if backend == "reference":
        probs, routing_map = router_reference(flat, bias, cfg)
    else:
        probs, routing_map = _fast_router(backend, cfg, flat, bias)
    return probs.reshape(logits.shape), routing_map.reshape(logits.shape)


def fused_moe_aux_loss(probs, tokens_per_expert, topk, coeff, *, total_num_tokens=None, num_experts=None):
    """Switch-style load-balancing loss, float32 scalar.

      loss = E * coeff / (topk * T^2) * sum_c tokens_per_expert[c] * sum_t probs[t, c]

    Args:
      probs: `[T, C]` float; normally the dense aux scores (compute_aux_scores=True). C is E, or a
        multiple of E for the sequence aux loss (scores reshaped `[S, B*E]`).
      tokens_per_expert: `[C]` int or float: tokens the main router sent to each column's expert
        (the column sum of its routing map). No gradient flows to it.
      topk: experts per token (Python int >= 1). coeff: Python float.
      total_num_tokens: T; defaults to probs.shape[0]. A Python int or a scalar array (e.g. the
        number of valid tokens in a padded batch).
      num_experts: logical E; defaults to C.
    """
    _check_logits(probs, "probs")
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [T, C], got shape {tuple(probs.shape)}")
    num_cols = probs.shape[1]
    if not hasattr(tokens_per_expert, "shape") or tuple(tokens_per_expert.shape) != (num_cols,):
        raise ValueError(f"tokens_per_expert must have shape [C]=({num_cols},), "
                         f"got {getattr(tokens_per_expert, 'shape', type(tokens_per_expert).__name__)}")
    if not _is_int(topk) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if not isinstance(coeff, numbers.Real) or isinstance(coeff, bool) or not math.isfinite(coeff):
        raise ValueError(f"coeff must be a finite Python float, got {coeff!r}")
    num_experts = num_cols if num_experts is None else num_experts
    if not _is_int(num_experts) or num_experts < 1 or num_cols % num_experts:
        raise ValueError(f"num_experts must be an int dividing the {num_cols} columns of probs, got {num_experts!r}")
    if total_num_tokens is None:
        total_num_tokens = probs.shape[0]
    if _is_int(total_num_tokens) and total_num_tokens < 1:
        raise ValueError(f"total_num_tokens must be >= 1, got {total_num_tokens}")
    if not _is_int(total_num_tokens) and jnp.ndim(total_num_tokens) != 0:
        raise ValueError(f"total_num_tokens must be an int or a scalar array, got {total_num_tokens!r}")
    t = jnp.asarray(total_num_tokens, jnp.float32)
    const = jnp.float32(num_experts * coeff / topk) / t / t  # ((E*coeff)/topk)/T/T, as TE
    tpe = jax.lax.stop_gradient(jnp.asarray(tokens_per_expert).astype(jnp.float32))
    per_column = jnp.asarray(probs).astype(jnp.float32).sum(axis=0)
    return const * jnp.dot(per_column, tpe, precision=jax.lax.Precision.HIGHEST)


def topk_ids_and_weights(probs, routing_map, topk):
    """Dense top-k view of a routing: ids int32 `[..., k]`, weights float32 `[..., k]`.

    Ordered by descending weight, ties to the lower expert id. Rows must have exactly `topk`
    routed experts (as the router produces); surplus slots of a row with fewer carry weight 0.
    """
    _check_logits(probs, "probs")
    if not hasattr(routing_map, "shape") or tuple(routing_map.shape) != tuple(probs.shape):
        raise ValueError(f"routing_map must have the shape of probs {tuple(probs.shape)}, "
                         f"got {getattr(routing_map, 'shape', type(routing_map).__name__)}")
    if not _is_int(topk) or not 1 <= topk <= probs.shape[-1]:
        raise ValueError(f"topk must be an int in [1, E={probs.shape[-1]}], got {topk!r}")
    routed = jnp.asarray(routing_map).astype(jnp.bool_)
    weights = jnp.asarray(probs).astype(jnp.float32)
    # Unrouted experts rank below every routed one, whatever its weight.
    key = jnp.where(routed, weights, -jnp.inf)
    _, ids = jax.lax.top_k(key, topk)
    weights = jnp.where(jnp.take_along_axis(routed, ids, axis=-1),
                        jnp.take_along_axis(weights, ids, axis=-1), 0.0)
    return ids.astype(jnp.int32), weights
