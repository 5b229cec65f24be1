"""Local token dispatch: permute tokens into expert-major rows, and combine them back.

The layout (moe-semantics.md section 3.1): expert e owns the contiguous block of rows
`[group_offsets[e], group_offsets[e] + group_sizes[e])`; inside a block the (token, expert) copies
are in ascending token order; with `align_size = A > 0` every block is rounded up to a multiple of
A with zero pad rows at its end. The buffer has a static worst-case size (shapes must be static
under jit); rows past the last block are zero.

Public API (the expert-parallel layer reuses these; shapes named T tokens, H hidden, k top-k,
E experts, N buffer rows):

  permute(x [T, H], topk_ids int32 [T, k], num_experts: int, *, align_size: int = 0,
          valid=None (bool [T])) -> (rows [N, H] x.dtype, Permutation)
      N = buffer_rows(T, k, E, align_size) (static). Tokens with valid[t] False are not routed:
      they are in no block, do not count in tokens_per_expert, and unpermute gives them zeros.

  Permutation (a NamedTuple, so a pytree):
      dest              int32 [T, k]  row of copy (t, j); N where the copy is not routed
      token_of_row      int32 [N]     source token of each row; T for pad rows and the unused tail
      group_sizes       int32 [E]     rows of each expert's block (aligned counts when A > 0)
      group_offsets     int32 [E]     first row of each block (exclusive cumsum of group_sizes)
      tokens_per_expert int32 [E]     routed copies per expert, without padding

  unpermute(rows [N, H], perm, topk_weights fp32 [T, k] | None = None, *, out_dtype=None)
      -> [T, H] out_dtype (default rows.dtype):  out[t] = sum_j w[t, j] * rows[dest[t, j]],
      accumulated in fp32; unrouted copies contribute nothing (masked with `where`, so NaN in
      unused rows never leaks). Without weights the copies are summed.

  layout(topk_ids [T, k], num_experts, *, align_size=0, valid=None) -> Permutation
      permute without the gather (cpu.layout computes the same in C++, and cpu.combine the same
      as unpermute with out_dtype float32).

  buffer_rows(T, k, E, align_size) -> int: the static N above.

  scale_rows(rows [N, H], perm, topk_weights fp32 [T, k]) -> [N, H] rows.dtype
      Every routed row times its copy's weight (rounded to rows.dtype), pad rows zero: the
      expert input of a layer that weights the input instead of the output (Llama 4), which
      then combines with `unpermute(..., topk_weights=None)`.

`permute_reference` / `unpermute_reference` are plain-jnp versions written for clarity (one-hot
running counts instead of a sort, a dense selection matrix instead of a gather) that the tests
compare against.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Permutation(NamedTuple):
    """Where every (token, slot) copy went: the handle from dispatch to combine (a pytree).

    dest:              int32 [T, k] row of copy (t, j); N where the copy is not routed
    token_of_row:      int32 [N] source token of each row; T for pad rows and the unused tail
    group_sizes:       int32 [E] rows of each expert's block (aligned counts when A > 0)
    group_offsets:     int32 [E] first row of each block (exclusive cumsum of group_sizes)
    tokens_per_expert: int32 [E] routed copies per expert, without padding
    """

    dest: jax.Array
    token_of_row: jax.Array
    group_sizes: jax.Array
    group_offsets: jax.Array
    tokens_per_expert: jax.Array


def buffer_rows(num_tokens: int, topk: int, num_experts: int, align_size: int = 0) -> int:
    """Static worst-case row count of the permuted buffer.

    Unaligned: T*k. Aligned to A: every non-empty block gains at most A-1 pad rows and at most
    min(E, T*k) blocks are non-empty; the aligned total is a multiple of A, so rounding the bound
    down to a multiple of A still holds it (the formula of moe-semantics.md 3.1, tightened).
    """
    copies = num_tokens * topk
    if align_size <= 1:
        return copies
    padded = copies + min(num_experts, copies) * (align_size - 1)
    return (padded // align_size) * align_size


def check_layout_args(topk_ids, num_experts, align_size, valid) -> tuple[int, int]:
    """Validate `layout`'s arguments (cpu.layout shares this); returns (T, k)."""
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {topk_ids.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be an integer array, got {topk_ids.dtype}")
    if int(num_experts) < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if int(align_size) < 0:
        raise ValueError(f"align_size must be >= 0, got {align_size}")
    if valid is not None and getattr(valid, "shape", None) != (topk_ids.shape[0],):
        raise ValueError(f"valid must be a bool [T] mask with T={topk_ids.shape[0]}, "
                         f"got {getattr(valid, 'shape', valid)}")
    return topk_ids.shape


def _check_args(x, topk_ids, num_experts, align_size, valid):
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    if topk_ids.ndim == 2 and topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, k] with T={x.shape[0]}, got shape {topk_ids.shape}")
    check_layout_args(topk_ids, num_experts, align_size, valid)


def check_unpermute_args(rows, perm: Permutation, topk_weights) -> tuple[int, int]:
    """Validate `unpermute`'s arguments (cpu.combine shares this); returns (T, k)."""
    t, k = perm.dest.shape
    if rows.ndim != 2 or rows.shape[0] != perm.token_of_row.shape[0]:
        raise ValueError(f"rows must be [N, H] with N={perm.token_of_row.shape[0]}, got {rows.shape}")
    if topk_weights is not None and topk_weights.shape != (t, k):
        raise ValueError(f"topk_weights must be [T, k] = {(t, k)}, got {topk_weights.shape}")
    return t, k


def _aligned(counts, align_size: int):
    if align_size <= 1:
        return counts
    return (counts + align_size - 1) // align_size * align_size


def _exclusive_cumsum(v):
    return jnp.cumsum(v) - v


def flat_experts(topk_ids, num_experts, valid):
    """Flat (t*k + j) expert ids with unrouted copies set to E (sorts after every real expert)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(t * k).astype(jnp.int32)
    if valid is not None:
        flat = jnp.where(jnp.repeat(valid.astype(bool), k), flat, num_experts)
    return flat


def _layout(flat_sorted, order, counts, num_tokens, topk, num_experts, align_size, num_rows):
    """Permutation from the copies sorted by expert (`order`: copy index of each sorted slot).

    Sorted slot p of expert e goes to row p + (pad rows of the blocks before e); slots of
    unrouted copies (sorted last) go nowhere (row N)."""
    sizes = _aligned(counts, align_size).astype(jnp.int32)
    offsets = _exclusive_cumsum(sizes).astype(jnp.int32)
    routed = flat_sorted < num_experts
    slot = jnp.arange(flat_sorted.shape[0], dtype=jnp.int32)
    if align_size > 1:
        pad_before = offsets - _exclusive_cumsum(counts).astype(jnp.int32)
        slot = slot + jnp.take(pad_before, jnp.minimum(flat_sorted, num_experts - 1))
    row = jnp.where(routed, slot, num_rows)
    dest = jnp.zeros_like(row).at[order].set(row)  # inverse permutation: copy -> row
    token = jnp.where(routed, order // topk, num_tokens)
    if align_size > 1 or row.shape[0] != num_rows:
        token_of_row = jnp.full((num_rows,), num_tokens, jnp.int32).at[row].set(token, mode="drop")
    else:
        token_of_row = token  # unaligned: sorted slot p is row p
    perm = Permutation(dest.reshape(num_tokens, topk), token_of_row, sizes, offsets, counts.astype(jnp.int32))
    return perm


def layout(topk_ids, num_experts: int, *, align_size: int = 0, valid=None) -> Permutation:
    """The Permutation of `topk_ids int32 [T, k]` alone (permute without the gather)."""
    t, k = check_layout_args(topk_ids, num_experts, align_size, valid)
    flat = flat_experts(topk_ids, num_experts, valid)
    # One stable sort by expert keeps the (t, j) order, i.e. ascending tokens inside each expert.
    flat_sorted, order = lax.sort((flat, jnp.arange(t * k, dtype=jnp.int32)), num_keys=1, is_stable=True)
    counts = jnp.bincount(flat, length=num_experts + 1)[:num_experts]
    return _layout(flat_sorted, order, counts, t, k, num_experts, align_size,
                   buffer_rows(t, k, num_experts, align_size))


def permute(x, topk_ids, num_experts: int, *, align_size: int = 0, valid=None):
    """Expert-major permutation of `x [T, H]` by `topk_ids int32 [T, k]`; see module docstring."""
    _check_args(x, topk_ids, num_experts, align_size, valid)
    perm = layout(topk_ids, num_experts, align_size=align_size, valid=valid)
    return x.at[perm.token_of_row].get(mode="fill", fill_value=0), perm


def unpermute(rows, perm: Permutation, topk_weights=None, *, out_dtype=None):
    """Weighted fp32 combine of expert-major `rows [N, H]` back to `[T, H]`; see module docstring."""
    t, k = check_unpermute_args(rows, perm, topk_weights)
    out_dtype = rows.dtype if out_dtype is None else out_dtype
    routed = perm.dest < rows.shape[0]  # [T, k]
    picked = rows.at[perm.dest].get(mode="fill", fill_value=0).astype(jnp.float32)  # [T, k, H]
    if topk_weights is not None:
        picked = picked * topk_weights.astype(jnp.float32)[..., None]
    picked = jnp.where(routed[..., None], picked, 0.0)
    return picked.sum(axis=1).astype(out_dtype)


def scale_rows(rows, perm: Permutation, topk_weights):
    """`rows [N, H]` with routed row dest[t, j] times topk_weights[t, j] (fp32 product rounded to
    rows.dtype) and every other row zero (pad rows may hold NaN: masked with `where`)."""
    t, k = check_unpermute_args(rows, perm, topk_weights)
    n = rows.shape[0]
    row_weight = jnp.zeros((n,), jnp.float32).at[perm.dest.reshape(t * k)].set(
        topk_weights.reshape(t * k).astype(jnp.float32), mode="drop")
    routed = jnp.zeros((n,), jnp.bool_).at[perm.dest.reshape(t * k)].set(True, mode="drop")
    scaled = rows.astype(jnp.float32) * row_weight[:, None]
    return jnp.where(routed[:, None], scaled, 0.0).astype(rows.dtype)


# ----------------------------------------------------------------------------------------------
# References (clarity over speed): positions from a one-hot running count, combine as a dense
# [T, k, N] selection matrix.


def permute_reference(x, topk_ids, num_experts: int, *, align_size: int = 0, valid=None):
    """Same contract as `permute`, computed without a sort: each copy's row is the count of copies
    before it in expert-major order (a one-hot running count), then gathered row by row."""
    _check_args(x, topk_ids, num_experts, align_size, valid)
    t, k = topk_ids.shape
    num_rows = buffer_rows(t, k, num_experts, align_size)
    flat = flat_experts(topk_ids, num_experts, valid)
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)  # [T*k, E]; unrouted rows are 0
    counts = onehot.sum(axis=0)
    sizes = _aligned(counts, align_size)
    earlier_same_expert = ((jnp.cumsum(onehot, axis=0) - onehot) * onehot).sum(axis=1)
    block_start = jnp.take(_exclusive_cumsum(sizes), jnp.minimum(flat, num_experts - 1))
    dest = jnp.where(flat < num_experts, block_start + earlier_same_expert, num_rows).astype(jnp.int32)
    token_of_row = jnp.full((num_rows,), t, jnp.int32)
    token_of_row = token_of_row.at[dest].set(jnp.arange(t * k, dtype=jnp.int32) // k, mode="drop")
    rows = jnp.where((token_of_row < t)[:, None], x[jnp.minimum(token_of_row, t - 1)], 0)
    perm = Permutation(dest.reshape(t, k), token_of_row, sizes.astype(jnp.int32),
                       _exclusive_cumsum(sizes).astype(jnp.int32), counts.astype(jnp.int32))
    return rows.astype(x.dtype), perm


def unpermute_reference(rows, perm: Permutation, topk_weights=None, *, out_dtype=None):
    """Same contract as `unpermute`, as a dense fp32 selection-matrix product (small shapes only)."""
    t, k = perm.dest.shape
    out_dtype = rows.dtype if out_dtype is None else out_dtype
    n = rows.shape[0]
    select = perm.dest[..., None] == jnp.arange(n)[None, None, :]  # [T, k, N]
    w = jnp.ones((t, k), jnp.float32) if topk_weights is None else topk_weights.astype(jnp.float32)
    safe_rows = jnp.where(jnp.isin(jnp.arange(n), perm.dest)[:, None], rows.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkn,nh->th", jnp.where(select, w[..., None], 0.0), safe_rows,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)
