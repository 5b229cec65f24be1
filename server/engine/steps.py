"""The engine's steps: pure functions of (layer params, tokens padded to a bucket, valid count).

The engine jit-compiles each of them per (layer config, bucket) with the config static. Rows at
and after `num_valid` are padding: not routed, not counted, not in the aux loss, zero outputs (the
kernels mask them; the steps do not mask again). B is the bucket (padded token count); the other
shape letters are as everywhere (T, H, E, k).

Hash-routed layers (`cfg.hash_routed`: expert ids from tid2eid[token_id], DeepSeek-V4) take one
more step input after num_valid, `token_ids int32 [B]` (checked on the host, padding rows 0); the
engine compiles and passes it only for such layers, so the other steps are unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp

from expertd.kernels import moe
from expertd.kernels import router as router_ops
from expertd.kernels.eplb import PlacementTables
from expertd.kernels.params import MoEParams, RouterParams


def forward_step(params: MoEParams, x, num_valid, token_ids=None, *, cfg, backend):
    """x [B, H], num_valid int32 scalar, token_ids int32 [B] (hash-routed layers only, else None)
    -> (out [B, H], ids int32 [B, k], weights fp32 [B, k], counts int32 [E])."""
    out, routing = moe.moe_layer(params, x, cfg, backend=backend, valid_tokens=num_valid, return_routing=True,
                                 token_ids=token_ids)
    return out, routing["topk_ids"], routing["topk_weights"], routing["tokens_per_expert"]


def ep_forward_step(placed: tuple[MoEParams, PlacementTables], x, num_valid, token_ids=None, *, cfg, backend, mesh,
                    ep, axis):
    """`forward_step` over the expert-parallel mesh: `ep.ep_moe_layer` (tokens sharded over `axis`,
    the layer's physical expert slots split over it), traced under the engine's jit like every
    other step.

    placed: (params laid out by `ep.shard_params` for the layer's placement, that placement's
    device tables `ep.placement_tables`: run-time arrays, so another placement of the same shape
    reuses the step); x [B, H], token_ids int32 [B] (hash-routed layers only, else None) ->
    (out [B, H], ids int32 [B, k], weights fp32 [B, k], counts int32 [E]): the routing each rank
    computed inside the layer (`ep_moe_layer`'s stats), not computed again.
    """
    params, tables = placed
    out, stats = ep.ep_moe_layer(params, x, cfg, mesh, axis=axis, valid_tokens=num_valid, return_stats=True,
                                 backend=backend, placement=tables, token_ids=token_ids)
    return out, stats["topk_ids"], stats["topk_weights"], stats["tokens_per_expert"]


def route_step(router: RouterParams, tokens, num_valid, coeff, token_ids=None, *, cfg, from_logits):
    """tokens [B, H] (hidden) or [B, E] (logits), token_ids int32 [B] (hash-routed layers only) ->
    (ids [B, k], weights [B, k], counts [E], aux loss, aux scores fp32 [B, E]).

    Selection and weights are `expertd.kernels.moe.route`'s (router_logits, then
    route_from_logits), so Route agrees with Forward; given logits are the router's whole logits
    (its input norm and bias included). The aux scores are the router's dense per-token scores
    (zero on padding rows): with them and the ids, the aux loss of any subset of the rows can be
    computed exactly on the host (`aux_loss_of`).
    """
    valid = jnp.arange(tokens.shape[0]) < num_valid
    logits = tokens.astype(jnp.float32) if from_logits else moe.router_logits(router, tokens, cfg)
    ids, weights = moe.route_from_logits(router, logits, cfg, valid, token_ids=token_ids)
    counts = jnp.zeros(cfg.num_experts, jnp.int32).at[ids.reshape(-1)].add(
        jnp.repeat(valid, cfg.topk).astype(jnp.int32), mode="drop")
    scores, _ = router_ops.fused_topk_with_score_function(
        logits, cfg.topk, score_function=cfg.score_function, compute_aux_scores=True)
    scores = jnp.where(valid[:, None], scores, 0.0)
    aux = router_ops.fused_moe_aux_loss(scores, counts, cfg.topk, 1.0, total_num_tokens=jnp.maximum(num_valid, 1))
    return ids, weights, counts, aux * coeff, scores
