"""The engine's steps: pure functions of (layer params, tokens padded to a bucket, valid count).

The engine jit-compiles each of them per (layer config, bucket) with the config static. Rows at
and after `num_valid` are padding: not routed, not counted, not in the aux loss, zero outputs.
B is the bucket (padded token count); the other shape letters are as everywhere (T, H, E, k).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from expertd.kernels import moe
from expertd.kernels import router as router_ops
from expertd.server.model import ROUTER_PARAMS


def pad_tokens(tokens: np.ndarray, bucket: int, dtype) -> np.ndarray:
    """tokens [n, W] -> [bucket, W] in dtype, zero rows after n."""
    padded = np.zeros((bucket, tokens.shape[1]), dtype)
    padded[: tokens.shape[0]] = tokens.astype(dtype, copy=False)
    return padded


def forward_step(params, x, num_valid, *, cfg, backend):
    """x [B, H], num_valid int32 scalar -> (out [B, H], ids int32 [B, k], weights fp32 [B, k], counts int32 [E])."""
    out, routing = moe.moe_layer(moe.MoEParams.from_dict(params), x, cfg, backend=backend, valid_tokens=num_valid,
                                 return_routing=True)
    valid = jnp.arange(x.shape[0]) < num_valid
    out = jnp.where(valid[:, None], out, jnp.zeros_like(out))
    return out, routing["topk_ids"], routing["topk_weights"], routing["tokens_per_expert"]


def ep_forward_step(params, x, num_valid, *, cfg, backend, mesh, ep, axis):
    """`forward_step` over the expert-parallel mesh: `ep.ep_moe_layer` (tokens sharded over `axis`,
    E / R experts per rank), traced under the engine's jit like every other step.

    params: placed as `ep.shard_params` lays them out (expert weights split over `axis`); x [B, H]
    -> (out [B, H], ids int32 [B, k], weights fp32 [B, k], counts int32 [E]). The ids and weights are
    `moe.route`'s on the same tokens: the per-token routing each rank computes inside the layer.
    """
    out, stats = ep.ep_moe_layer(moe.MoEParams.from_dict(params), x, cfg, mesh, axis=axis, valid_tokens=num_valid,
                                 return_stats=True, backend=backend)
    valid = jnp.arange(x.shape[0]) < num_valid
    router = moe.RouterParams.from_dict({name: params[name] for name in ROUTER_PARAMS if name in params})
    ids, weights = moe.route(router, x, cfg, valid)
    out = jnp.where(valid[:, None], out, jnp.zeros_like(out))
    return out, ids, weights, stats["tokens_per_expert"]


def route_step(router, tokens, num_valid, coeff, *, cfg, from_logits):
    """tokens [B, H] (hidden) or [B, E] (logits) -> (ids [B, k], weights [B, k], counts [E], aux loss,
    aux scores fp32 [B, E]).

    Selection and weights are `expertd.kernels.moe.route`'s, so Route agrees with Forward. The aux
    scores are the router's dense per-token scores (zero on padding rows): with them and the ids,
    the aux loss of any subset of the rows can be computed exactly on the host (`aux_loss_of`).
    """
    valid = jnp.arange(tokens.shape[0]) < num_valid
    router = moe.RouterParams.from_dict(router)
    if from_logits:
        # moe.route computes its logits as x @ router_weight in full fp32: with the identity that
        # product is the given logits, exactly.
        logits = tokens.astype(jnp.float32)
        identity = jnp.eye(cfg.num_experts, dtype=jnp.float32)
        ids, weights = moe.route(moe.RouterParams(identity, router.expert_bias), logits, cfg, valid)
    else:
        ids, weights = moe.route(router, tokens, cfg, valid)
        logits = moe.router_logits(router, tokens)
    counts = jnp.zeros(cfg.num_experts, jnp.int32).at[ids.reshape(-1)].add(
        jnp.repeat(valid, cfg.topk).astype(jnp.int32), mode="drop")
    scores, _ = router_ops.fused_topk_with_score_function(
        logits, cfg.topk, score_function=cfg.score_function, compute_aux_scores=True)
    scores = jnp.where(valid[:, None], scores, 0.0)
    aux = router_ops.fused_moe_aux_loss(scores, counts, cfg.topk, 1.0, total_num_tokens=jnp.maximum(num_valid, 1))
    return ids, weights, counts, aux * coeff, scores


def aux_loss_of(score_sums: np.ndarray, tokens_per_expert: np.ndarray, num_tokens: int, topk: int,
                coeff: float) -> float:
    """The load-balancing aux loss of T tokens from their per-expert sums, on the host.

      loss = E * coeff / (k * T^2) * sum_e tokens_per_expert[e] * score_sums[e]

    score_sums [E]: the aux scores (`route_step`) summed over the T tokens; tokens_per_expert [E]:
    the T tokens' routed counts. Equals `router.fused_moe_aux_loss` on those tokens (summed in fp64).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    num_experts = len(score_sums)
    dot = float(np.dot(np.asarray(score_sums, np.float64), np.asarray(tokens_per_expert, np.float64)))
    return num_experts * coeff / (topk * num_tokens * num_tokens) * dot
