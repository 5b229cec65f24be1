"""Ragged all-to-all: a CPU emulation of `jax.lax.ragged_all_to_all` and the offset arithmetic
expert parallelism needs around it, with its typed handles (`RaggedExchange`, `RankRows`).

XLA:CPU cannot compile `jax.lax.ragged_all_to_all` ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"). `ragged_all_to_all_emulated` has the same arguments and the
same semantics, built from a dense tiled `all_to_all`: every slice is packed into a fixed
`[K, max_slice_rows, ...]` block (`pack_slices`), the blocks are exchanged, and the received rows
are scattered to their output offsets. It moves `max_slice_rows` rows per slice instead of the
slice's true size, so it is for correctness checks (CPU tests run the ragged EP code through it),
not for speed.

Semantics (shared by both; K = len(send_sizes), a multiple of R = axis size, slice i goes to rank
i // (K // R)):
- `operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]` is my slice i.
- `output_offsets[i]` is where my slice i lands in the RECEIVER's output (a sender-side value).
- `recv_sizes[i]` is the size of the slice I receive from rank i // (K // R); it must satisfy
  `send_sizes == all_to_all(recv_sizes, axis, 0, 0, tiled=True)`.
- The result is `output` with the received slices written in; other rows keep `output`'s values.

The metadata helpers are pure functions of a rows matrix `counts [R, R]` (`counts[s, d]` = rows
rank s sends to rank d; every rank sees the same all-gathered matrix) and work on numpy or jax
arrays alike. Dispatch uses a source-major receive layout: the rows rank `me` receives from source
s start at `sum(counts[:s, me])`.

Rank-deduplicated rows (what the EP layer exchanges, as DeepEP and NCCL EP do): a token travels
once to every rank that holds at least one of its experts, carrying that rank's local expert
slots and weights (`rank_rows` lays one rank's tokens out so, a `RankRows`); `rank_capacity`
sizes the fixed-capacity exchange of such rows.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class RaggedExchange(NamedTuple):
    """The four int32 `[R]` size / offset arguments of one `ragged_all_to_all` (module docstring),
    in its argument order: `ragged_fn(operand, output, *exchange, axis_name=...)`.

    input_offsets:  where my slice i starts in my operand
    send_sizes:     rows of my slice i
    output_offsets: where my slice i lands in its receiver's output (a sender-side value)
    recv_sizes:     rows I receive from rank i
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


def exclusive_cumsum(x, axis: int = 0):
    """Exclusive prefix sum along `axis`: out[i] = sum(x[:i]); same shape and dtype as `x`."""
    x = jnp.asarray(x)
    return jnp.cumsum(x, axis=axis, dtype=x.dtype) - x


def pack_slices(operand, offsets, sizes, max_slice_rows: int):
    """Copy ragged slices into fixed-size blocks.

    operand [N, ...]; offsets, sizes int [K]. Returns `[K, max_slice_rows, ...]` in operand dtype
    where block i row j = `operand[offsets[i] + j]` for j < min(sizes[i], max_slice_rows) and 0
    otherwise (rows past `max_slice_rows` are cut off: callers size it for their worst case or
    count the cut rows as drops).
    """
    offsets = jnp.asarray(offsets, jnp.int32)
    sizes = jnp.asarray(sizes, jnp.int32)
    j = jnp.arange(max_slice_rows, dtype=jnp.int32)
    rows = offsets[:, None] + j[None, :]  # [K, cap]
    valid = j[None, :] < sizes[:, None]
    if operand.shape[0] == 0:
        return jnp.zeros((offsets.shape[0], max_slice_rows) + operand.shape[1:], operand.dtype)
    gathered = operand[jnp.clip(rows, 0, operand.shape[0] - 1)]
    mask = valid.reshape(valid.shape + (1,) * (operand.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros((), operand.dtype))


def unpack_slices(blocks, offsets, sizes, output):
    """Inverse of `pack_slices`: write block i's first `sizes[i]` rows to `output[offsets[i]:]`.

    blocks [K, cap, ...]; offsets, sizes int [K] (sizes above cap are treated as cap); output
    [M, ...] in blocks' dtype. Returns output with those rows written; other rows keep their
    values, rows that would land past M are skipped.
    """
    cap = blocks.shape[1]
    j = jnp.arange(cap, dtype=jnp.int32)
    dest = jnp.asarray(offsets, jnp.int32)[:, None] + j[None, :]
    # Rows beyond a slice's size get an out-of-range index and are dropped by the scatter.
    dest = jnp.where(j[None, :] < jnp.asarray(sizes, jnp.int32)[:, None], dest, output.shape[0])
    return output.at[dest.reshape(-1)].set(blocks.reshape((-1,) + blocks.shape[2:]), mode="drop")


def ragged_all_to_all_emulated(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
    axis_index_groups=None, max_slice_rows: int | None = None,
):
    """Drop-in for `jax.lax.ragged_all_to_all` (same arguments, same result) that runs on CPU.

    Call inside `shard_map` over `axis_name`. operand [N, ...], output [M, ...] (same trailing
    shape and dtype), the four int arrays [K] with K a multiple of the axis size. Returns [M, ...].
    `max_slice_rows` (default N, always enough) bounds the rows one slice can carry; the dense
    exchange moves K * max_slice_rows rows per rank whatever the true sizes are.
    """
    if axis_index_groups is not None:
        raise ValueError("ragged_all_to_all_emulated: axis_index_groups is not supported (expected None)")
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(
            f"ragged_all_to_all_emulated: operand {operand.shape} {operand.dtype} and output "
            f"{output.shape} {output.dtype} must share trailing shape and dtype"
        )
    num_slices = jnp.shape(send_sizes)[0]
    num_ranks = jax.lax.axis_size(axis_name)
    if num_slices % num_ranks:
        raise ValueError(
            f"ragged_all_to_all_emulated: {num_slices} slices is not a multiple of the axis size {num_ranks}"
        )
    cap = operand.shape[0] if max_slice_rows is None else int(max_slice_rows)
    packed = pack_slices(operand, input_offsets, send_sizes, cap)  # [K, cap, ...]
    received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)
    # The receiver's write offsets are the senders' output_offsets, routed like the data.
    write_offsets = jax.lax.all_to_all(jnp.asarray(output_offsets, jnp.int32), axis_name, 0, 0, tiled=True)
    return unpack_slices(received, write_offsets, recv_sizes, output)


def dispatch_exchange_params(counts, rank) -> RaggedExchange:
    """Arguments for the forward (dispatch) ragged exchange with a source-major receive layout.

    counts int [R, R] (`counts[s, d]`: rows s sends to d; my rows are stored destination-major);
    rank: my index. Returns a RaggedExchange, int32 [R] each:
    send_sizes = counts[me], input_offsets = exclusive cumsum of it, recv_sizes = counts[:, me],
    output_offsets[d] = sum(counts[:me, d]) (where my rows land in d's source-major buffer).
    """
    counts = jnp.asarray(counts, jnp.int32)
    send_sizes = counts[rank]
    input_offsets = exclusive_cumsum(send_sizes)
    output_offsets = exclusive_cumsum(counts, axis=0)[rank]
    recv_sizes = counts[:, rank]
    return RaggedExchange(input_offsets, send_sizes, output_offsets, recv_sizes)


def combine_exchange_params(counts, rank) -> RaggedExchange:
    """Arguments for the reverse (combine) exchange: send every received row back to its source.

    counts int [R, R] as in `dispatch_exchange_params`. My rows are in the dispatch receive layout
    (source-major); they return to the destination-major slots they left from. Returns
    `(input_offsets, send_sizes, output_offsets, recv_sizes)`, int32 [R]: send_sizes = counts[:, me],
    input_offsets[s] = sum(counts[:s, me]), output_offsets[s] = sum(counts[s, :me]),
    recv_sizes = counts[me].
    """
    counts = jnp.asarray(counts, jnp.int32)
    send_sizes = counts[:, rank]
    input_offsets = exclusive_cumsum(send_sizes)
    output_offsets = exclusive_cumsum(counts, axis=1)[:, rank]
    recv_sizes = counts[rank]
    return RaggedExchange(input_offsets, send_sizes, output_offsets, recv_sizes)



class RankRows(NamedTuple):
    """One rank's tokens laid out for the rank-deduplicated exchange (`rank_rows`): one row per
    (token, destination rank) pair where the token has at least one expert on that rank.

    Shapes: Tr tokens, k top-k, R ranks, S slots per rank; N = Tr * min(k, R) rows (the most a
    rank can send), kk = min(k, S) (the most experts one row carries), kr = min(k, R) (the most
    rows one token has). Rows are destination-major, tokens ascending inside a destination; rows
    past sum(send_counts) are unused.

    send_counts: int32 [R]     rows for each destination rank
    pair_counts: int32 [R]     (token, expert) pairs for each destination (what one row per pair
                               would send)
    row_token:   int32 [N]     the token of each row; Tr for unused rows
    row_dest:    int32 [N]     the destination of each row; R for unused rows
    row_slots:   int32 [N, kk] the destination's local slots the row's token goes to, in the
                               token's top-k order; -1 past them
    row_weights: fp32 [N, kk]  their routing weights; 0 past them
    token_rows:  int32 [Tr, kr] each token's rows, ascending destination; N past them
    """

    send_counts: jax.Array
    pair_counts: jax.Array
    row_token: jax.Array
    row_dest: jax.Array
    row_slots: jax.Array
    row_weights: jax.Array
    token_rows: jax.Array


def rank_rows(slots, weights, num_ranks: int, slots_per_rank: int) -> RankRows:
    """The rank-deduplicated send layout of one rank's routing (see RankRows).

    slots int [Tr, k]: the global physical slot (rank-major: rank = slot // slots_per_rank) of
    each (token, choice), -1 where not routed (padding rows); weights fp32 [Tr, k] the matching
    routing weights. A token's k slots are distinct (its k experts are), so a row never holds more
    than min(k, S) of them.
    """
    tr, k = slots.shape
    r, s = int(num_ranks), int(slots_per_rank)
    n, kk, kr = tr * min(k, r), min(k, s), min(k, r)
    slots = jnp.asarray(slots, jnp.int32)
    routed = slots >= 0
    dest = jnp.where(routed, slots // s, r)  # r: nowhere
    local = jnp.where(routed, slots % s, -1)
    tokens = jnp.arange(tr, dtype=jnp.int32)
    hit = jnp.zeros((tr, r + 1), bool).at[tokens[:, None], dest].set(True)[:, :r]  # [Tr, R]
    flat = hit.T.reshape(-1)  # destination-major (d, t) order is the row order
    row_of = jnp.where(flat, jnp.cumsum(flat, dtype=jnp.int32) - 1, n).reshape(r, tr)  # [R, Tr]
    row_token = jnp.full((n,), tr, jnp.int32).at[row_of.reshape(-1)].set(jnp.tile(tokens, r), mode="drop")
    row_dest = jnp.full((n,), r, jnp.int32).at[row_of.reshape(-1)].set(
        jnp.repeat(jnp.arange(r, dtype=jnp.int32), tr), mode="drop")
    # Place of choice j inside its row: the token's earlier choices with the same destination.
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [j, j'] = j' < j
    place = ((dest[:, :, None] == dest[:, None, :]) & earlier).sum(-1)
    pair_row = jnp.where(routed, row_of[jnp.minimum(dest, r - 1), tokens[:, None]], n)
    row_slots = jnp.full((n, kk), -1, jnp.int32).at[pair_row, place].set(local, mode="drop")
    row_weights = jnp.zeros((n, kk), jnp.float32).at[pair_row, place].set(
        jnp.asarray(weights, jnp.float32), mode="drop")
    token_rows = jnp.sort(row_of.T, axis=1)[:, :kr]  # a token's rows grow with the destination
    pair_counts = jnp.zeros((r + 1,), jnp.int32).at[dest.reshape(-1)].add(1)[:r]
    return RankRows(hit.sum(0).astype(jnp.int32), pair_counts, row_token, row_dest, row_slots, row_weights,
                    token_rows)


def rank_capacity(tokens_per_rank: int, topk: int, num_ranks: int, capacity_factor: float | None = None) -> int:
    """Rows per (source, destination) block of the fixed-size ("capacity") exchange.

    None: tokens_per_rank, the dropless worst case (a token goes to a rank at most once). A factor
    f > 0: ceil(f * tokens_per_rank * min(k, R) / R), f times the share of a destination when every
    token reaches min(k, R) ranks, at least 1 and at most the worst case.
    """
    worst = int(tokens_per_rank)
    if capacity_factor is None:
        return worst
    share = tokens_per_rank * min(int(topk), int(num_ranks)) / num_ranks
    return int(min(worst, max(1, math.ceil(float(capacity_factor) * share))))
