"""The "pallas" router backend: one fused Pallas kernel per block of tokens.

Each program loads a `[BT, Ep]` block of logits (Ep = E rounded up to a power of two; lanes >= E
and rows >= T are masked off and read as -inf) and, in registers, computes the score function,
adds the selection bias, applies group-limited selection, picks the top-k by k rounds of
"max, then the lowest lane holding it" (ties to the lowest expert index, like `lax.top_k`),
normalises, scales, and writes probs and the bool routing map in one pass. All math is fp32.

Written for Pallas-Triton: every block dim is a power of two, loads and stores are masked, there
are no reshapes. On GPU it is compiled (`interpret=False`); on other platforms it runs in
interpret mode, which is how CI checks the same kernel code.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from expertd.kernels.router.reference import NORMALISATION_EPS, RouterConfig, activation

# fp32 elements per block: GPU keeps a block in registers (a few live [BT, Ep] temporaries per
# thread); interpret mode loops over blocks, so fewer, larger blocks are faster there.
GPU_BLOCK_ELEMENTS = 2048
INTERPRET_BLOCK_ELEMENTS = 1 << 16
MAX_BLOCK_TOKENS = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_tokens(num_tokens: int, padded_experts: int, interpret: bool) -> int:
    """Tokens per program: a power of two, at most the (rounded-up) token count."""
    budget = INTERPRET_BLOCK_ELEMENTS if interpret else GPU_BLOCK_ELEMENTS
    cap = _next_pow2(num_tokens) if interpret else MAX_BLOCK_TOKENS
    return max(1, min(cap, budget // padded_experts))


def _topk_mask(values, index, valid, k: int):
    """Bool mask of the k largest `values` per row among `valid` columns, ties to the lowest index.

    k rounds of: the largest free value, then the lowest free column holding it.
    """
    width = values.shape[1]

    def take_best(_, chosen):
        free = valid & ~chosen
        best = jnp.max(jnp.where(free, values, -jnp.inf), axis=1, keepdims=True)
        first = jnp.min(jnp.where(free & (values == best), index, width), axis=1, keepdims=True)
        return chosen | (index == first)

    return lax.fori_loop(0, k, take_best, jnp.zeros(values.shape, jnp.bool_))


def _group_limit(sel, lane, valid, cfg: RouterConfig, num_experts: int):
    """-inf outside each token's `group_topk` best groups (score: sum of its top `group_score_k`)."""
    rows, _ = sel.shape
    group_size = num_experts // cfg.num_groups
    group = lax.broadcasted_iota(jnp.int32, (rows, _next_pow2(cfg.num_groups)), 1)
    lane_group = jnp.where(valid, lane // group_size, -1)  # padding lanes belong to no group

    def score_group(g, scores):
        def take_best(_, carry):
            remaining, total = carry
            best = jnp.max(remaining, axis=1, keepdims=True)
            first = jnp.min(jnp.where(remaining == best, lane, sel.shape[1]), axis=1, keepdims=True)
            return jnp.where(lane == first, -jnp.inf, remaining), total + best

        start = (jnp.where(lane_group == g, sel, -jnp.inf), jnp.zeros((rows, 1), jnp.float32))
        _, total = lax.fori_loop(0, cfg.group_score_k, take_best, start)
        return jnp.where(group == g, total, scores)

    scores = lax.fori_loop(0, cfg.num_groups, score_group, jnp.full(group.shape, -jnp.inf, jnp.float32))
    kept = _topk_mask(scores, group, group < cfg.num_groups, cfg.group_topk)

    def keep_lanes(g, keep):
        group_kept = jnp.max(jnp.where((group == g) & kept, 1, 0), axis=1, keepdims=True) > 0
        return keep | ((lane_group == g) & group_kept)

    keep = lax.fori_loop(0, cfg.num_groups, keep_lanes, jnp.zeros(sel.shape, jnp.bool_))
    return jnp.where(keep, sel, -jnp.inf)


def _router_kernel(logits_ref, bias_ref, scale_ref, probs_ref, map_ref, *, cfg: RouterConfig,
                   num_tokens: int, num_experts: int):
    rows, width = logits_ref.shape
    lane = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    valid = lane < num_experts
    inside = valid & (row < num_tokens)
    lane_row = lax.broadcasted_iota(jnp.int32, (1, width), 1) < num_experts  # for [1, E] operands
    x = plgpu.load(logits_ref, mask=inside, other=-jnp.inf).astype(jnp.float32)
    x = jnp.where(valid, x, -jnp.inf)

    # 1. scores (dense, over the valid lanes) and the values selection works on
    if cfg.score_function == "softmax":
        exp = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        dense = exp / jnp.sum(exp, axis=1, keepdims=True)
        sel = dense if (cfg.use_pre_softmax or cfg.aux_scores) else x
        if cfg.has_bias and cfg.use_pre_softmax and not cfg.aux_scores:  # probs + bias (ERNIE 4.5)
            sel = jnp.where(valid, dense + plgpu.load(bias_ref, mask=lane_row, other=0.0), -jnp.inf)
    else:
        bias = plgpu.load(bias_ref, mask=lane_row, other=0.0)  # zeros when there is no bias
        act = jnp.where(valid, activation(x, cfg.score_function), 0.0)
        dense = act / (jnp.sum(act, axis=1, keepdims=True) + NORMALISATION_EPS) if cfg.aux_scores else act
        sel = jnp.where(valid, dense + bias, -jnp.inf)
    if cfg.grouped:
        sel = _group_limit(sel, lane, valid, cfg, num_experts)

    # 2. top-k over the experts
    chosen = _topk_mask(sel, lane, valid, cfg.topk)

    # 3. weights of the chosen experts
    if cfg.aux_scores:
        probs = dense
    elif cfg.score_function == "softmax" and not cfg.use_pre_softmax:
        picked = jnp.where(chosen, x, -jnp.inf)
        exp = jnp.where(chosen, jnp.exp(picked - jnp.max(picked, axis=1, keepdims=True)), 0.0)
        probs = exp / jnp.sum(exp, axis=1, keepdims=True)
    elif cfg.score_function == "softmax":
        probs = jnp.where(chosen, dense, 0.0)
    else:
        probs = jnp.where(chosen, sel - bias, 0.0)  # unbiased by fp32 subtraction, as TE
        if cfg.topk > 1:
            probs = probs / (jnp.sum(probs, axis=1, keepdims=True) + NORMALISATION_EPS)
    if not cfg.aux_scores:
        probs = probs * plgpu.load(scale_ref, mask=lane_row, other=0.0)
    plgpu.store(probs_ref, probs.astype(probs_ref.dtype), mask=inside)
    plgpu.store(map_ref, chosen, mask=inside)


def router_pallas(logits, expert_bias, cfg: RouterConfig, *, interpret: bool | None = None):
    """`[T, E]` logits -> (probs `[T, E]` logits dtype (fp32 aux scores), routing_map bool `[T, E]`).

    The bias and the scaling factor enter the kernel as `[1, E]` fp32 operands (zeros and ones
    when absent; exact), so one compiled kernel serves every bias and scaling setting of the
    sigmoid / sqrtsoftplus scores; softmax-pre selection reads a bias only in the kernel compiled
    for one (ERNIE 4.5), so the other softmax kernels are unchanged.
    """
    num_tokens, num_experts = logits.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bias = jnp.zeros((num_experts,), jnp.float32) if expert_bias is None else expert_bias.astype(jnp.float32)
    scale = jnp.full((num_experts,), cfg.scaling_factor, jnp.float32)
    kernel_cfg = dataclasses.replace(cfg, scaling_factor=1.0,
                                     has_bias=cfg.has_bias and cfg.score_function == "softmax")
    return _router_call(logits, bias.reshape(1, -1), scale.reshape(1, -1), cfg=kernel_cfg, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _router_call(logits, bias, scale, *, cfg: RouterConfig, interpret: bool):
    num_tokens, num_experts = logits.shape
    probs_dtype = jnp.float32 if cfg.aux_scores else logits.dtype
    out_shape = (jax.ShapeDtypeStruct((num_tokens, num_experts), probs_dtype),
                 jax.ShapeDtypeStruct((num_tokens, num_experts), jnp.bool_))
    if num_tokens == 0:
        return jnp.zeros(out_shape[0].shape, probs_dtype), jnp.zeros(out_shape[1].shape, jnp.bool_)
    width = _next_pow2(num_experts)
    rows = block_tokens(num_tokens, width, interpret)
    token_block = pl.BlockSpec((rows, width), lambda i: (i, 0))
    expert_row = pl.BlockSpec((1, width), lambda i: (0, 0))
    kernel = functools.partial(_router_kernel, cfg=cfg, num_tokens=num_tokens, num_experts=num_experts)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, rows),),
        in_specs=[token_block, expert_row, expert_row],
        out_specs=[token_block, token_block],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if rows * width <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="expertd_router",
    )(logits, bias, scale)
