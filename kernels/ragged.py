"""Ragged all-to-all: a CPU emulation of `jax.lax.ragged_all_to_all` and the offset arithmetic
expert parallelism needs around it, with its typed handles (`RaggedExchange`, `ExpertMajorOrder`).

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
s start at `sum(counts[:s, me])`. `expert_major_positions` re-sorts a received buffer by local
expert; `worst_case_rows`, `capacity_rows` and `kept_counts` size the fixed-capacity exchange.
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


class ExpertMajorOrder(NamedTuple):
    """A received buffer re-sorted by local expert (`expert_major_positions`).

    positions:   int32 [M], where each received row goes in the expert-major layout; M (out of
                 range: a scatter with mode="drop" skips it) for padding rows
    group_sizes: int32 [El], rows of each local expert
    """

    positions: jax.Array
    group_sizes: jax.Array


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


def expert_major_positions(counts, source_starts, num_rows: int) -> ExpertMajorOrder:
    """Where each received row goes when the receive buffer is re-sorted by local expert.

    counts int [R, El]: rows from source s for my local expert e, stored contiguously per source
    in expert order (source s's rows start at `source_starts[s]`, int [R]; gaps between sources are
    padding). num_rows: static length M of the receive buffer. Returns an ExpertMajorOrder
    (positions int32 [M], group_sizes int32 [El]): a valid row goes to `positions[r] <
    sum(counts)` of an expert-major layout (expert e's rows from all sources, source s before s+1,
    arrival order kept); padding rows get `positions[r] == M` (out of range: a scatter with
    mode="drop" skips them).
    """
    counts = jnp.asarray(counts, jnp.int32)
    num_sources, num_local = counts.shape
    group_sizes = jnp.sum(counts, axis=0)
    # One segment per (source, expert), in source-major order.
    seg_starts = (jnp.asarray(source_starts, jnp.int32)[:, None] + exclusive_cumsum(counts, axis=1)).reshape(-1)
    seg_sizes = counts.reshape(-1)
    # Destination start of each segment: expert block start + rows of earlier sources.
    seg_dest = (exclusive_cumsum(group_sizes)[None, :] + exclusive_cumsum(counts, axis=0)).reshape(-1)
    r = jnp.arange(num_rows, dtype=jnp.int32)
    # Last segment starting at or before r; empty segments sharing that start come earlier in the
    # order, so the pick is the one that can hold r. Segment starts are non-decreasing.
    seg = jnp.clip(jnp.searchsorted(seg_starts, r, side="right") - 1, 0, num_sources * num_local - 1)
    within = r - seg_starts[seg]
    valid = (within >= 0) & (within < seg_sizes[seg])
    return ExpertMajorOrder(jnp.where(valid, seg_dest[seg] + within, num_rows).astype(jnp.int32), group_sizes)


def worst_case_rows(tokens_per_rank: int, topk: int, experts_per_rank: int) -> int:
    """Most rows one rank can send one destination: every token reaches at most min(k, El) of the
    destination's El experts (one row per (token, expert) pair)."""
    return int(tokens_per_rank) * min(int(topk), int(experts_per_rank))


def capacity_rows(tokens_per_rank: int, topk: int, num_experts: int, num_ranks: int,
                  capacity_factor: float | None = None) -> int:
    """Rows per destination of the fixed-size ("capacity") exchange.

    None: the dropless worst case `worst_case_rows`. A factor f > 0: ceil(f * tokens_per_rank * k / R)
    (f times the balanced share), at least 1 and at most the worst case.
    """
    worst = worst_case_rows(tokens_per_rank, topk, num_experts // num_ranks)
    if capacity_factor is None:
        return worst
    balanced = tokens_per_rank * topk / num_ranks
    return int(min(worst, max(1, math.ceil(float(capacity_factor) * balanced))))


def kept_counts(counts, capacity):
    """Rows that survive a per-destination capacity.

    counts int [..., El]: one destination's rows per local expert, sent in expert order; a
    destination takes its first `capacity` rows. Returns int32 [..., El], kept <= counts; the
    dropped rows are the last ones (highest expert, then highest token) of each destination.
    """
    counts = jnp.asarray(counts, jnp.int32)
    before = exclusive_cumsum(counts, axis=-1)
    return jnp.clip(capacity - before, 0, counts).astype(jnp.int32)
