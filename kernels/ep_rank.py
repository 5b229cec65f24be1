"""One rank's step of the expert-parallel layer (`expertd.kernels.ep`), run inside `shard_map`.

Rank-deduplicated dispatch and combine, as DeepEP, NCCL EP and TransformerEngine's EP do it (Tr
tokens on the rank, k top-k, R ranks, S physical slots per rank, H hidden):

1. route the rank's tokens (`moe.route`, fp32) to logical experts, and each (token, expert) to a
   physical slot: each rank splits its tokens of a replicated expert evenly between the
   replicas, in token order (`physical_slots`; deterministic);
2. lay the tokens out one row per (token, destination rank) (`ragged.rank_rows`): the token's
   hidden state once, plus the destination's local slots and weights for up to min(k, S) experts
   (an int32 [N, 2 * min(k, S)] metadata row that travels beside it: slots, then the fp32 weights'
   bits);
3. all_gather the [2, R] (rows, pairs) counts of every rank, then exchange the rows:
   "ragged"   counts first, then only the rows (`ragged_all_to_all`; on CPU its emulation) into a
              receive buffer of R * Tr rows (a source can send a rank each of its tokens once);
   "capacity" a dense `all_to_all` of a fixed [R, C, H] block per rank: row c of block d is my
              c-th row for destination d; rows past C are dropped (the highest tokens of that
              destination) and counted;
4. the receiver expands its rows to expert-major (token, slot) rows (`dispatch.permute`, with an
   extra empty slot S for "no expert"), runs `moe.routed_ffn` on its S slots, and reduces
   each row to ONE weighted partial sum over its experts (`dispatch.unpermute`, fp32), cast to
   x.dtype for the trip back;
5. the reverse exchange returns one partial per (token, rank) to the token's rank, which adds
   them in fp32 (a gather over the token's rows, in destination order), then the shared experts.

Every rank runs every collective, even with no tokens.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels import dispatch as dispatch_ops
from expertd.kernels import moe, ragged
from expertd.kernels.eplb import PlacementTables
from expertd.kernels.params import MoEParams

# Per-rank counters of RankOutputs.per_rank, in this order.
COUNTERS = ("dropped_pairs", "dropped_rows", "rows_out", "rows_in", "wire_rows", "kept_rows", "pairs_out",
            "pairs_in", "meta_rows")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static sizes of one layer call (hashable: part of the jit cache key)."""

    cfg: moe.MoEConfig
    num_ranks: int
    slots_per_rank: int  # S = (E + N) / R physical slots per rank
    rows_per_rank: int  # Tr = T / R, rounded up
    mode: str  # "ragged" or "capacity"
    capacity: int  # rows per (source, destination) block of the capacity exchange

    @property
    def send_rows(self) -> int:
        """N: the most rows one rank sends (each token to at most min(k, R) ranks)."""
        return self.rows_per_rank * min(self.cfg.topk, self.num_ranks)

    @property
    def row_experts(self) -> int:
        """kk: the most experts one row carries (a token's experts on one rank)."""
        return min(self.cfg.topk, self.slots_per_rank)

    @property
    def recv_rows(self) -> int:
        """M: receive buffer rows (every source may send each of its tokens once, or its C rows)."""
        return self.num_ranks * (self.rows_per_rank if self.mode == "ragged" else self.capacity)


class Received(NamedTuple):
    """What one rank holds after the dispatch exchange (M = plan.recv_rows, kk = plan.row_experts).

    rows:      [M, H] received hidden states, source-major (unused rows are zero)
    slots:     int32 [M, kk] local slots each row's token goes to; -1 past them and on unused rows
    weights:   fp32 [M, kk] their routing weights; 0 past them
    kept_send: int32 [R] rows of mine each destination kept (all of them in ragged mode)
    """

    rows: jax.Array
    slots: jax.Array
    weights: jax.Array
    kept_send: jax.Array


class RankOutputs(NamedTuple):
    """One rank's results, stacked over the ranks by shard_map.

    out:               [Tr, H] x.dtype, the layer output of the rank's tokens
    topk_ids:          int32 [Tr, k] their logical routing (-1 on padding rows)
    topk_weights:      fp32 [Tr, k] (0 on padding rows)
    tokens_per_expert: int32 [1, E] the rank's routed (token, logical expert) pairs per expert
    slot_tokens:       int32 [1, S] (token, expert) pairs each of the rank's slots ran (after drops)
    per_rank:          int32 [1, len(COUNTERS)] the counters named by COUNTERS
    """

    out: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array
    tokens_per_expert: jax.Array
    slot_tokens: jax.Array
    per_rank: jax.Array


def physical_slots(ids, valid, rank, tables: PlacementTables):
    """Global physical slot int32 [Tr, k] of each (token, logical expert) in `ids int [Tr, k]` (-1
    stays -1; valid bool [Tr] marks the routed rows): the rank's n-th token of expert e (in token
    order) goes to replica (n + rank) % count[e] of e. Each rank splits its tokens of an expert
    evenly over the replicas (to within one), starting at a different replica on every rank."""
    routed = ids >= 0
    e = jnp.maximum(ids, 0)
    if tables.replicas.shape[1] == 1:  # no redundant slots: one replica each, nothing to split
        return jnp.where(routed, tables.replicas[e, 0], -1).astype(jnp.int32)
    num_experts = tables.counts.shape[0]
    perm = dispatch_ops.layout(e, num_experts, valid=valid)
    nth = perm.dest - perm.group_offsets[e]  # place of (t, j) among the rank's tokens of its expert
    column = (nth + rank) % tables.counts[e]
    return jnp.where(routed, tables.replicas[e, column], -1).astype(jnp.int32)


def _pack_meta(rows: ragged.RankRows):
    """int32 [N, 2 kk]: slots, then the weights' fp32 bits (one exchange carries both)."""
    return jnp.concatenate([rows.row_slots, lax.bitcast_convert_type(rows.row_weights, jnp.int32)], axis=1)


def _unpack_meta(meta, valid_rows, kk: int):
    slots = jnp.where(valid_rows[:, None], meta[:, :kk], -1)
    weights = jnp.where(slots >= 0, lax.bitcast_convert_type(meta[:, kk:], jnp.float32), 0.0)
    return slots, weights


def _exchange(x, lay: ragged.RankRows, counts, me, plan: Plan, axis: str, ragged_fn) -> Received:
    """Dispatch my rows (x [Tr, H] gathered by lay.row_token); counts int32 [R, R] rows s -> d."""
    m, kk = plan.recv_rows, plan.row_experts
    rows = x.at[lay.row_token].get(mode="fill", fill_value=0)  # [N, H]
    meta = _pack_meta(lay)
    if plan.mode == "ragged":
        ex = ragged.dispatch_exchange_params(counts, me)
        got = ragged_fn(rows, jnp.zeros((m,) + rows.shape[1:], rows.dtype), *ex, axis_name=axis)
        got_meta = ragged_fn(meta, jnp.full((m, meta.shape[1]), -1, jnp.int32), *ex, axis_name=axis)
        valid_rows = jnp.arange(m) < ex.recv_sizes.sum()
        return Received(got, *_unpack_meta(got_meta, valid_rows, kk), lay.send_counts)
    c = plan.capacity
    offsets = ragged.exclusive_cumsum(lay.send_counts)
    got = lax.all_to_all(ragged.pack_slices(rows, offsets, lay.send_counts, c), axis, 0, 0, tiled=True)
    got_meta = lax.all_to_all(ragged.pack_slices(meta, offsets, lay.send_counts, c), axis, 0, 0, tiled=True)
    kept_in = jnp.minimum(counts[:, me], c)
    valid_rows = (jnp.arange(c)[None, :] < kept_in[:, None]).reshape(m)
    slots, weights = _unpack_meta(got_meta.reshape(m, -1), valid_rows, kk)
    return Received(got.reshape((m,) + rows.shape[1:]), slots, weights, jnp.minimum(lay.send_counts, c))


def _run_experts(params: MoEParams, got: Received, plan: Plan, backend: str, out_dtype):
    """The rank's slots on its received rows -> (one weighted partial per row [M, H] out_dtype,
    pairs each slot ran int32 [S]). The layer's expert semantics are `moe`'s: its gated activation
    and per-expert biases (`moe.routed_ffn`, the biases laid out by slot like the weights) and, with
    cfg.router_weight_on_input, each row scaled by its weight before its expert, summed unweighted
    (`moe.input_weights`)."""
    s = plan.slots_per_rank
    has_expert = got.slots >= 0
    ids = jnp.where(has_expert, got.slots, s)  # slot S: an empty slot that no FFN runs
    xs, perm = dispatch_ops.permute(got.rows, ids, s + 1)
    xs, combine_weights = moe.input_weights(xs, perm, got.weights, plan.cfg)
    group_sizes = perm.group_sizes[:s]
    ys = moe.routed_ffn(params, xs, group_sizes, plan.cfg, backend=backend, capacity=plan.recv_rows)
    perm = perm._replace(dest=jnp.where(has_expert, perm.dest, xs.shape[0]))
    partial = dispatch_ops.unpermute(ys, perm, combine_weights, out_dtype=jnp.float32)
    return partial.astype(out_dtype), group_sizes


def _exchange_back(partial, lay: ragged.RankRows, counts, me, kept_send, plan: Plan, axis: str, ragged_fn):
    """Combine: partials in the receive layout [M, H] -> my rows' partials [N, H] (zero where dropped)."""
    out = jnp.zeros((plan.send_rows,) + partial.shape[1:], partial.dtype)
    if plan.mode == "ragged":
        return ragged_fn(partial, out, *ragged.combine_exchange_params(counts, me), axis_name=axis)
    back = lax.all_to_all(partial.reshape((plan.num_ranks, plan.capacity) + partial.shape[1:]), axis, 0, 0,
                          tiled=True)
    return ragged.unpack_slices(back, ragged.exclusive_cumsum(lay.send_counts), kept_send, out)


def rank_forward(params: MoEParams, tables: PlacementTables, x, valid, token_ids=None, *, plan: Plan, axis: str,
                 backend: str, ragged_fn) -> RankOutputs:
    """One rank: x [Tr, H], valid bool [Tr], token_ids int32 [Tr] (hash-routed layers, else None)
    -> its RankOutputs (see the module docstring). The rows sent are `moe.expert_input(x)`; the
    combined partials end as `moe.finish` makes them (output norm, shared experts on x)."""
    cfg, r = plan.cfg, plan.num_ranks
    me = lax.axis_index(axis)
    ids, weights = moe.route(params, x, cfg, valid, token_ids=token_ids)
    slots = physical_slots(ids, valid, me, tables)
    lay = ragged.rank_rows(slots, weights, r, plan.slots_per_rank)
    counts = lax.all_gather(jnp.stack([lay.send_counts, lay.pair_counts]), axis)  # [R, 2, R]
    rows_counts = counts[:, 0, :]
    got = _exchange(moe.expert_input(params, x, cfg), lay, rows_counts, me, plan, axis, ragged_fn)
    partial, slot_tokens = _run_experts(params, got, plan, backend, x.dtype)
    back = _exchange_back(partial, lay, rows_counts, me, got.kept_send, plan, axis, ragged_fn)
    # A row survives when it is within its destination's kept rows (all of them in ragged mode).
    n = plan.send_rows
    within = jnp.arange(n, dtype=jnp.int32) - ragged.exclusive_cumsum(lay.send_counts)[jnp.minimum(lay.row_dest, r - 1)]
    used = lay.row_dest < r
    kept = used & (within < got.kept_send[jnp.minimum(lay.row_dest, r - 1)])
    row_ok = kept.at[lay.token_rows].get(mode="fill", fill_value=False)  # [Tr, kr]
    picked = back.at[lay.token_rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    out = moe.finish(params, jnp.where(row_ok[..., None], picked, 0.0).sum(axis=1), x, cfg)
    out = jnp.where(valid[:, None], out, 0.0).astype(x.dtype)

    dropped = used & ~kept
    pairs_in_row = (lay.row_slots >= 0).sum(axis=1)
    rows_out, rows_in = lay.send_counts.sum(), rows_counts[:, me].sum()
    kept_rows = got.kept_send.sum() + jnp.minimum(rows_counts[:, me], plan.capacity).sum() \
        if plan.mode == "capacity" else rows_out + rows_in
    wire_rows = 2 * r * plan.capacity if plan.mode == "capacity" else rows_out + rows_in
    meta_rows = r * plan.capacity if plan.mode == "capacity" else rows_out
    per_rank = jnp.stack([jnp.where(dropped, pairs_in_row, 0).sum(), dropped.sum(), rows_out, rows_in,
                          jnp.asarray(wire_rows), kept_rows, lay.pair_counts.sum(), counts[:, 1, me].sum(),
                          jnp.asarray(meta_rows)]).astype(jnp.int32)
    tokens_per_expert = jnp.zeros((cfg.num_experts + 1,), jnp.int32).at[
        jnp.where(ids >= 0, ids, cfg.num_experts).reshape(-1)].add(1)[:cfg.num_experts]
    return RankOutputs(out, ids, weights, tokens_per_expert[None], slot_tokens[None], per_rank[None])
