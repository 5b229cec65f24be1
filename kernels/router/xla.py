"""The "xla" router backend: the reference math, arranged for XLA to run fast on `[T, E]`.

Same results as the reference (bit-identical routing maps; weights to fp32 rounding), but:
- the weights are computed on the `[T, k]` values `lax.top_k` returns, not on `[T, E]`; for the
  default post-softmax router that means k exponentials per token instead of E;
- probs and the routing map are written by scattering the `[T, k]` weights (unique indices)
  into zeros, instead of masking `[T, E]` arrays with a one-hot expansion.

Note for maintainers: never slice the outputs of `lax.top_k` (e.g. `values[:, k-1]`): on CPU XLA
then turns the top-k into a full sort of every row (far slower). Use whole outputs or reductions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels.router.reference import RouterConfig, group_mask, normalise, selection_scores


def _scatter_rows(columns, values, shape):
    """`[T, E]` zeros (False) with `values` at (t, columns[t, j]); columns unique per row."""
    dtype = jnp.bool_ if values is True else values.dtype
    rows = lax.broadcasted_iota(jnp.int32, columns.shape, 0)
    return jnp.zeros(shape, dtype).at[rows, columns].set(values, unique_indices=True)


def router_xla(logits, expert_bias, cfg: RouterConfig):
    """`[T, E]` logits -> (probs `[T, E]` logits dtype (fp32 aux scores), routing_map bool `[T, E]`)."""
    scores = selection_scores(logits, expert_bias, cfg)  # fp32 [T, E]
    if cfg.aux_scores:
        _, chosen = lax.top_k(scores, cfg.topk)
        return scores, _scatter_rows(chosen, True, scores.shape)
    if cfg.grouped:
        scores = jnp.where(group_mask(scores, cfg), scores, -jnp.inf)
    values, chosen = lax.top_k(scores, cfg.topk)  # [T, k]
    if cfg.score_function == "softmax":
        # post: softmax over the k selected logits; pre: the selected probabilities as they are
        # (with a selection bias, read back unbiased)
        if not cfg.use_pre_softmax:
            weights = jax.nn.softmax(values, axis=-1)
        elif expert_bias is None:
            weights = values
        else:
            weights = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), chosen, axis=-1)
    else:
        if expert_bias is not None:  # unbias by fp32 subtraction, as TE
            values = values - jnp.take(expert_bias.astype(jnp.float32), chosen)
        weights = normalise(values) if cfg.topk > 1 else values
    if cfg.scaling_factor != 1.0:
        weights = weights * jnp.float32(cfg.scaling_factor)
    probs = _scatter_rows(chosen, weights.astype(logits.dtype), scores.shape)
    return probs, _scatter_rows(chosen, True, scores.shape)
