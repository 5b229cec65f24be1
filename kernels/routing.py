"""A layer's routing in Hugging Face semantics: logits, the top-k router, the families' weights.

Public API (T tokens, H hidden, E experts, k top-k, V a hash-routed layer's vocabulary):

  router_logits(params, x [T, H], cfg) -> fp32 logits [T, E]
      x @ router_weight in full fp32, with cfg.router_input_norm (x RMS-normed and scaled by
      router_input_scale first) and cfg.router_bias (+ router_bias).
  route(params, x [T, H], cfg, valid=None, *, token_ids=None, router_backend="auto")
      -> (ids int32 [T, k], weights fp32 [T, k]): router_logits, then route_from_logits.
  route_from_logits(params, logits [T, E], cfg, valid=None, *, token_ids=None, router_backend="auto")
      -> (ids, weights): ids in descending weight order (-1 / 0 on rows where valid is False).
  check_token_ids(token_ids, cfg, num_tokens=None) -> None
      The host check of a request's token ids for a hash-routed layer: TokenIdsError (a ValueError
      whose `field` is "token_ids") when they are missing, not integers of shape [T], or a value
      is outside [0, V). Layers that are not hash-routed accept anything (ids are ignored there).
  hash_token_rows(token_ids [T], cfg) -> int32 [T]: the ids clipped into [0, V) (what the kernel
      gathers with: it never reads out of bounds, whatever the ids).

`params` is a MoEParams or a RouterParams (the router's fields alone).

Semantics (router math in fp32; checked against the Hugging Face modelling code):
  selection and weights are `expertd.kernels.router` (TransformerEngine's router) with the
  config's score function, groups (group_score_topk: HF's top-2 group score), selection bias
  (sigmoid / sqrtsoftplus scores, or softmax-pre probabilities as ERNIE 4.5) and scaling; then
  norm_topk_prob, when it overrides the router's own normalisation, recomputes the weights from
  the unbiased scores: w / (sum + 1e-20), or w / max(sum, norm_topk_min) (ERNIE's moe_norm_min),
  times scaling_factor;
  hash-routed layers (DeepSeek-V4 hash_moe, modeling_deepseek_v4.py DeepseekV4HashRouter):
  ids = tid2eid[token_id], weights = score(logits)[ids] normalised the same way, times scaling;
  per_expert_scale (Gemma 4): weights *= per_expert_scale[ids], last.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from expertd.kernels.config import MoEConfig
from expertd.kernels.ffn import rms_norm
from expertd.kernels.params import MoEParams, RouterParams
from expertd.kernels.router import fused_topk_with_score_function, topk_ids_and_weights
from expertd.kernels.router.reference import NORMALISATION_EPS

__all__ = ["TokenIdsError", "check_token_ids", "hash_token_rows", "route", "route_from_logits", "router_logits"]


class TokenIdsError(ValueError):
    """Bad token ids for a hash-routed layer; `field` is "token_ids" (a server maps it to
    INVALID_ARGUMENT with a field violation) and `description` says what was expected."""

    def __init__(self, description: str):
        super().__init__(f"token_ids: {description}")
        self.field = "token_ids"
        self.description = description


def check_token_ids(token_ids, cfg: MoEConfig, num_tokens: int | None = None) -> None:
    """For a hash-routed `cfg`: TokenIdsError unless `token_ids` is an integer array [T] (T =
    num_tokens when given) with every value in [0, cfg.hash_vocab_size); the message names the
    first bad position and value. Other layers: nothing to check (token ids are ignored there)."""
    if not cfg.hash_routed:
        return
    vocab = cfg.hash_vocab_size
    if token_ids is None:
        raise TokenIdsError(f"required: this layer is hash-routed (expert ids come from tid2eid[token_id], "
                            f"vocabulary {vocab}); send one int32 token id per token")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise TokenIdsError(f"must be an integer array [T], got {ids.dtype} shape {list(ids.shape)}")
    if num_tokens is not None and ids.shape[0] != num_tokens:
        raise TokenIdsError(f"must hold one id per token: expected {num_tokens}, got {ids.shape[0]}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise TokenIdsError(f"token_ids[{bad[0]}] = {ids[bad[0]]} is out of the vocabulary [0, {vocab})"
                            + (f" ({bad.size} ids out of range)" if bad.size > 1 else ""))


def hash_token_rows(token_ids, cfg: MoEConfig):
    """int32 `[T]`: the token ids clipped into [0, V), the rows of tid2eid a hash-routed layer
    reads (the host check, `check_token_ids`, rejects ids outside; the clip keeps the gather in
    bounds whatever arrives)."""
    return jnp.clip(jnp.asarray(token_ids).astype(jnp.int32), 0, cfg.hash_vocab_size - 1)


def _check_router_params(params) -> None:
    if not isinstance(params, (MoEParams, RouterParams)):
        raise TypeError(f"params must be a MoEParams or RouterParams (see expertd.kernels.params), "
                        f"got {type(params).__name__}")


def router_logits(params: MoEParams | RouterParams, x, cfg: MoEConfig):
    """`x [T, H]` -> fp32 logits `[T, E]`, computed in full fp32 (HIGHEST precision: left at
    DEFAULT, GPUs round the operands to TF32 / bf16 and near-equal logits swap experts)."""
    _check_router_params(params)
    if cfg.router_input_norm:  # Gemma 4: rmsnorm(x) * router.scale * H^-1/2, then the projection
        x = rms_norm(x, params.router_input_scale, cfg.norm_eps)
    logits = jnp.matmul(x.astype(jnp.float32), params.router_weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    if cfg.router_bias:  # gpt-oss: part of the logits, so it moves the weights too
        logits = logits + params.router_bias.astype(jnp.float32)
    return logits


def route(params: MoEParams | RouterParams, x, cfg: MoEConfig, valid=None, *, token_ids=None,
          router_backend: str = "auto"):
    """Router step: `x [T, H]` -> (ids int32 [T, k], weights fp32 [T, k]) in HF semantics;
    `token_ids int32 [T]` for a hash-routed layer (see the module docstring)."""
    return route_from_logits(params, router_logits(params, x, cfg), cfg, valid, token_ids=token_ids,
                             router_backend=router_backend)


def route_from_logits(params: MoEParams | RouterParams, logits, cfg: MoEConfig, valid=None, *, token_ids=None,
                      router_backend: str = "auto"):
    """Fp32 `logits [T, E]` (router_logits') -> (ids int32 [T, k], weights fp32 [T, k])."""
    _check_router_params(params)
    logits = logits.astype(jnp.float32)
    if cfg.hash_routed:
        ids, weights = _hash_route(params, logits, cfg, token_ids)
    else:
        ids, weights = _topk_route(params, logits, cfg, router_backend)
    if cfg.per_expert_scale:  # Gemma 4: after normalisation and scaling
        weights = weights * jnp.take(params.per_expert_scale.astype(jnp.float32), ids)
    if cfg.hash_routed or cfg.per_expert_scale:
        ids, weights = _descending(ids, weights)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return ids, weights


def _topk_route(params, logits, cfg: MoEConfig, router_backend: str):
    probs, routing_map = fused_topk_with_score_function(
        logits, cfg.topk, use_pre_softmax=cfg.use_pre_softmax, num_groups=cfg.num_groups,
        group_topk=cfg.group_topk, scaling_factor=float(cfg.scaling_factor),
        score_function=cfg.score_function, expert_bias=params.expert_bias if cfg.use_expert_bias else None,
        backend=router_backend, group_score_topk=cfg.group_score_topk)
    ids, weights = topk_ids_and_weights(probs, routing_map, cfg.topk)
    if _overrides_normalisation(cfg):
        # The router's weights are normalised differently; recompute from the raw scores.
        raw = jnp.take_along_axis(_dense_scores(logits, cfg.score_function), ids, axis=-1)
        weights = _normalised(raw, cfg) * jnp.float32(cfg.scaling_factor)
    return ids, weights


def _hash_route(params, logits, cfg: MoEConfig, token_ids):
    if token_ids is None:
        raise TokenIdsError(f"required: this layer is hash-routed (cfg.hash_vocab_size={cfg.hash_vocab_size}); "
                            "pass token_ids int32 [T]")
    if jnp.ndim(token_ids) != 1 or jnp.shape(token_ids)[0] != logits.shape[0]:
        raise TokenIdsError(f"must be [T={logits.shape[0]}], got shape {jnp.shape(token_ids)}")
    table = params.tid2eid.astype(jnp.int32)
    ids = jnp.clip(jnp.take(table, hash_token_rows(token_ids, cfg), axis=0), 0, cfg.num_experts - 1)
    raw = jnp.take_along_axis(_dense_scores(logits, cfg.score_function), ids, axis=-1)
    normalise = cfg.topk > 1 if cfg.norm_topk_prob is None else cfg.norm_topk_prob
    weights = _normalised(raw, cfg) if normalise else raw
    return ids, weights * jnp.float32(cfg.scaling_factor)


def _normalised(raw, cfg: MoEConfig):
    """raw [T, k] / (sum + 1e-20), or / max(sum, norm_topk_min) when that floor is set; without
    norm_topk_prob=True (and outside hash routing) raw as it is."""
    if cfg.norm_topk_prob is False:
        return raw
    total = raw.sum(axis=-1, keepdims=True)
    if cfg.norm_topk_min is not None:
        return raw / jnp.maximum(total, jnp.float32(cfg.norm_topk_min))
    return raw / (total + NORMALISATION_EPS)


def _overrides_normalisation(cfg: MoEConfig) -> bool:
    if cfg.norm_topk_prob is None:
        return False
    if cfg.norm_topk_min is not None:
        return True
    if cfg.score_function == "softmax":
        return cfg.use_pre_softmax and cfg.norm_topk_prob
    return cfg.norm_topk_prob != (cfg.topk > 1)


def _dense_scores(logits, score_function: str):
    """The unbiased fp32 scores `[T, E]` a router weighs experts by."""
    if score_function == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def _descending(ids, weights):
    """(ids, weights) reordered by descending weight (ties: the earlier slot)."""
    weights, order = lax.top_k(weights, weights.shape[-1])
    return jnp.take_along_axis(ids, order, axis=-1), weights
