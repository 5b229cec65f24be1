"""Expert-parallel MoE layer: experts sharded E/R per rank over a mesh axis, tokens exchanged.

Public API (T tokens, H hidden, E experts, El = E/R local experts, k top-k, R ranks on `axis`):

  shard_params(params: MoEParams, cfg, mesh, axis="ep") -> MoEParams
      Places the params on the mesh once: w_gate / w_up / w_down split on their expert dim (El
      experts per rank), everything else replicated. Serving calls this once so that ep_moe_layer
      never re-transfers weights.

  ep_moe_layer(params: MoEParams, x [T, H], cfg, mesh, *, axis="ep", dispatch="auto", capacity_factor=None,
               valid_tokens=None, return_stats=False, backend="auto", ragged_all_to_all=None, token_ids=None)
      -> out [T, H] in x.dtype, or (out, stats) with return_stats.
      Same contract as `moe.moe_layer` (valid_tokens: None, an int count or a bool [T] mask;
      padding rows are not routed and come back as zeros; token_ids int32 [T], required by
      hash-routed layers and sharded with the tokens, ignored by the others). x and params may be
      host (numpy) or device arrays; with several processes every process passes the same host values.
      dispatch:
        "ragged"    counts are exchanged first, then only the routed rows travel
                    (`jax.lax.ragged_all_to_all`) into a worst-case receive buffer; dropless.
                    GPU/TPU only: XLA:CPU cannot compile the op.
        "capacity"  a dense `all_to_all` of a fixed [R, C, H] buffer per rank (C rows for every
                    destination). Default C is the dropless worst case T/R * min(k, El);
                    capacity_factor f sets C = ceil(f * (T/R) * k / R): the rows past C of a
                    destination are dropped, counted in stats["dropped_pairs"], and their weight is
                    NOT renormalised away (a dropped pair simply contributes nothing).
        "auto"      "ragged" on GPU/TPU, else "capacity" (also "capacity" when capacity_factor is
                    given).
      backend: grouped-GEMM backend of `expertd.kernels.experts` for the local experts.
      ragged_all_to_all: the op the ragged path calls (default `jax.lax.ragged_all_to_all`);
      `ragged.ragged_all_to_all_emulated` runs the same ragged code on CPU.
      stats (jax arrays): topk_ids int32 [T, k] and topk_weights fp32 [T, k] (the routing each rank
      computed for its tokens, `moe.route`'s: -1 / 0 on padding rows, so a caller needs no second
      routing pass), tokens_per_expert int32 [E] (routed, global, padding excluded),
      dropped_pairs int32 [], rows_received int32 [R] (rows each rank's experts ran, after drops),
      bytes_sent float32 [R] (dispatch + combine payload rows incl. padding, plus the count
      exchange), min_bytes float32 [R] (routed rows only, both directions), bytes_ratio float32 []
      = sum(bytes_sent) / sum(min_bytes) (inf when nothing is routed). Bytes describe the exchange
      algorithm: the ragged path counts routed rows whichever ragged_all_to_all implementation
      runs (the CPU emulation moves more).

One rank's step (all inside one shard_map; every rank runs every collective, even with no tokens):
route its T/R tokens (`moe.route`, fp32) -> permute copies expert-major, which is destination-rank
major (`dispatch.permute`, a `Permutation`) -> all_gather the per-expert counts [R, E] -> exchange
rows (`Received`) -> re-sort the received rows by local expert (`ragged.expert_major_positions`, an
`ExpertMajorOrder`) -> `experts.grouped_ffn` -> reverse exchange -> weighted fp32 combine on the
token's own rank (`dispatch.unpermute`) -> shared experts on the local tokens.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels import dispatch as dispatch_ops
from expertd.kernels import moe, ragged
from expertd.kernels.params import EXPERT_FIELDS, MoEParams
from expertd.kernels.routing import TokenIdsError

DISPATCH_MODES = ("auto", "ragged", "capacity")
EXPERT_KEYS = EXPERT_FIELDS  # sharded on dim 0 (weights and per-expert biases); the rest replicated (issue 25)
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # where XLA compiles ragged-all-to-all


def _num_ranks(mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not a mesh axis; mesh axes are {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


def _check_experts_divide(cfg: moe.MoEConfig, num_ranks: int) -> None:
    if cfg.num_experts % num_ranks:
        raise ValueError(f"cfg.num_experts={cfg.num_experts} must be divisible by the {num_ranks} ranks of the EP axis")


def _place(value, sharding: NamedSharding):
    """A global array with `sharding`; host values are copied from every process's own copy."""
    if isinstance(value, jax.core.Tracer):  # under an outer jit
        return jax.lax.with_sharding_constraint(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)  # every process holds the same full value
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: MoEParams, cfg: moe.MoEConfig, mesh, axis: str = "ep") -> MoEParams:
    """Place `params` on `mesh`: expert weights [E, ...] split over `axis`, the rest replicated."""
    moe.check_params(params, cfg)
    _check_experts_divide(cfg, _num_ranks(mesh, axis))
    return params.replace(**{
        name: _place(value, NamedSharding(mesh, P(axis) if name in EXPERT_KEYS else P()))
        for name, value in params.items()
    })


def resolve_dispatch(dispatch: str, mesh, *, capacity_factor=None, ragged_all_to_all=None) -> str:
    """The concrete mode ("ragged" or "capacity") that `dispatch` runs on this mesh."""
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
    platform = mesh.devices.flat[0].platform
    native_ragged = platform in RAGGED_PLATFORMS
    if dispatch == "auto":
        return "ragged" if native_ragged and capacity_factor is None else "capacity"
    if dispatch == "ragged":
        if capacity_factor is not None:
            raise ValueError("capacity_factor applies to dispatch='capacity' only (ragged is dropless)")
        if not native_ragged and ragged_all_to_all is None:
            raise ValueError(
                f"dispatch='ragged' needs jax.lax.ragged_all_to_all, which XLA:{platform.upper()} cannot "
                "compile; use dispatch='capacity' or 'auto' "
                "(or pass ragged_all_to_all=ragged.ragged_all_to_all_emulated)")
    return dispatch


def _check_capacity_factor(capacity_factor) -> None:
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not np.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a finite number > 0 or None, got {capacity_factor!r}")


def _valid_rows(valid_tokens, num_tokens: int, padded: int):
    """Bool [T_pad]: valid rows of the padded batch (padding past T is never valid)."""
    if valid_tokens is None:
        return np.arange(padded) < num_tokens
    if isinstance(valid_tokens, (int, np.integer)) and not isinstance(valid_tokens, bool):
        return np.arange(padded) < min(int(valid_tokens), num_tokens)
    mask = moe.valid_mask(valid_tokens, num_tokens)
    if isinstance(mask, jax.core.Tracer) or isinstance(valid_tokens, jax.Array):
        return jnp.pad(mask, (0, padded - num_tokens))
    return np.pad(np.asarray(mask), (0, padded - num_tokens))


def _token_id_rows(token_ids, cfg: moe.MoEConfig, num_tokens: int, padded: int):
    """int32 [T_pad]: a hash-routed layer's token ids padded with 0 (padding rows are not routed);
    None for other layers. TokenIdsError when they are missing or not [T]; their values are the
    caller's to check on the host (`moe.check_token_ids`; the kernel clips them into [0, V))."""
    if not cfg.hash_routed:
        return None
    if token_ids is None:
        moe.check_token_ids(None, cfg)  # raises: required
    if tuple(np.shape(token_ids)) != (num_tokens,):
        raise TokenIdsError(f"must hold one id per token: expected shape [{num_tokens}], "
                            f"got {list(np.shape(token_ids))}")
    if isinstance(token_ids, np.ndarray):
        return np.pad(token_ids.astype(np.int32), (0, padded - num_tokens))
    return jnp.pad(jnp.asarray(token_ids, jnp.int32), (0, padded - num_tokens))


def _pad_rows(x, padded: int):
    extra = padded - x.shape[0]
    if not extra:
        return x
    if isinstance(x, np.ndarray):
        return np.pad(x, ((0, extra), (0, 0)))
    return jnp.pad(x, ((0, extra), (0, 0)))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static sizes of one layer call (hashable: part of the jit cache key)."""

    cfg: moe.MoEConfig
    num_ranks: int
    rows_per_rank: int  # T/R, rounded up
    mode: str  # "ragged" or "capacity"
    capacity: int  # rows per destination of the capacity exchange

    @property
    def local_experts(self) -> int:
        return self.cfg.num_experts // self.num_ranks

    @property
    def recv_rows(self) -> int:
        """Receive buffer rows: every source may send its worst case (ragged) or its C rows."""
        worst = ragged.worst_case_rows(self.rows_per_rank, self.cfg.topk, self.local_experts)
        return self.num_ranks * (worst if self.mode == "ragged" else self.capacity)

    @property
    def expert_rows(self) -> int:
        """Rows one local expert can get: each token reaches an expert at most once."""
        return min(self.recv_rows, self.num_ranks * self.rows_per_rank)


class Received(NamedTuple):
    """What one rank holds after the dispatch exchange (M = plan.recv_rows receive rows, R ranks,
    El local experts).

    rows:          [M, H] received rows, source-major (gaps between sources are padding)
    counts:        int32 [R, El] rows from each source for each local expert, as stored (after
                   the capacity's drops)
    source_starts: int32 [R] first receive row of each source's rows
    kept_send:     int32 [R] rows of mine each destination kept (the combine's return sizes)
    """

    rows: jax.Array
    counts: jax.Array
    source_starts: jax.Array
    kept_send: jax.Array


class RankOutputs(NamedTuple):
    """One rank's results, stacked over the ranks by shard_map (Tr = T/R tokens per rank).

    out:               [Tr, H] x.dtype, the layer output of the rank's tokens
    topk_ids:          int32 [Tr, k] their routing (-1 on padding rows)
    topk_weights:      fp32 [Tr, k] (0 on padding rows)
    tokens_per_expert: int32 [1, E] the rank's routed copies per expert
    per_rank:          int32 [1, 4] dropped pairs, rows its experts ran, payload rows both ways,
                       routed rows both ways
    """

    out: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array
    tokens_per_expert: jax.Array
    per_rank: jax.Array


def _exchange(rows, counts, me, plan: _Plan, axis: str, ragged_fn) -> Received:
    """Dispatch: my rows [N, H] (destination-major), the all-gathered counts [R, E] -> Received."""
    r, el = plan.num_ranks, plan.local_experts
    counts_se = counts.reshape(r, r, el)  # [source, destination, local expert]
    send = counts_se[me]  # [R, El]
    send_sizes = send.sum(-1)
    if plan.mode == "ragged":
        ex = ragged.dispatch_exchange_params(counts_se.sum(-1), me)
        out = jnp.zeros((plan.recv_rows,) + rows.shape[1:], rows.dtype)
        received = ragged_fn(rows, out, *ex, axis_name=axis)
        return Received(received, counts_se[:, me, :], ragged.exclusive_cumsum(ex.recv_sizes), send_sizes)
    packed = ragged.pack_slices(rows, ragged.exclusive_cumsum(send_sizes), send_sizes, plan.capacity)
    received = lax.all_to_all(packed, axis, 0, 0, tiled=True).reshape((plan.recv_rows,) + rows.shape[1:])
    stored = ragged.kept_counts(counts_se[:, me, :], plan.capacity)
    starts = jnp.arange(r, dtype=jnp.int32) * plan.capacity
    return Received(received, stored, starts, ragged.kept_counts(send, plan.capacity).sum(-1))


def _exchange_back(y_recv, counts, me, kept_send, num_rows: int, plan: _Plan, axis: str, ragged_fn):
    """Combine: expert outputs in the receive layout [M, H] -> my rows' outputs [N, H]
    (destination-major, zero where a row was dropped)."""
    r, el = plan.num_ranks, plan.local_experts
    out = jnp.zeros((num_rows,) + y_recv.shape[1:], y_recv.dtype)
    if plan.mode == "ragged":
        ex = ragged.combine_exchange_params(counts.reshape(r, r, el).sum(-1), me)
        return ragged_fn(y_recv, out, *ex, axis_name=axis)
    back = lax.all_to_all(y_recv.reshape((r, plan.capacity) + y_recv.shape[1:]), axis, 0, 0, tiled=True)
    send_sizes = counts.reshape(r, r, el)[me].sum(-1)
    return ragged.unpack_slices(back, ragged.exclusive_cumsum(send_sizes), kept_send, out)


def _rank_forward(params: MoEParams, x, valid, token_ids=None, *, plan: _Plan, axis: str, backend: str,
                  ragged_fn) -> RankOutputs:
    """One rank: x [T/R, H], valid bool [T/R], token_ids int32 [T/R] (hash-routed layers, else None)
    -> its RankOutputs."""
    cfg, r = plan.cfg, plan.num_ranks
    me = lax.axis_index(axis)
    ids, weights = moe.route(params, x, cfg, valid, token_ids=token_ids)
    # issue 25 (layer semantics): the layer's parts, as moe.moe_layer calls them
    rows, perm = dispatch_ops.permute(moe.expert_input(params, x, cfg), jnp.maximum(ids, 0), cfg.num_experts,
                                      valid=valid)
    rows, combine_weights = moe.input_weights(rows, perm, weights, cfg)
    counts = lax.all_gather(perm.tokens_per_expert, axis)  # [R, E]: every exchange size, everywhere
    got = _exchange(rows, counts, me, plan, axis, ragged_fn)
    order = ragged.expert_major_positions(got.counts, got.source_starts, plan.recv_rows)
    xs = jnp.zeros_like(got.rows).at[order.positions].set(got.rows, mode="drop")
    ys = moe.routed_ffn(params, xs, order.group_sizes, cfg, backend=backend, capacity=plan.expert_rows)
    y_recv = ys.at[order.positions].get(mode="fill", fill_value=0)  # padding rows (pos == M) read as 0
    y_rows = _exchange_back(y_recv, counts, me, got.kept_send, rows.shape[0], plan, axis, ragged_fn)
    out = moe.finish(params, dispatch_ops.unpermute(y_rows, perm, combine_weights, out_dtype=jnp.float32), x, cfg)
    out = jnp.where(valid[:, None], out, 0.0).astype(x.dtype)
    sent = perm.tokens_per_expert.sum()
    routed_in = counts.reshape(r, r, plan.local_experts)[:, me, :].sum()
    # Rows on the wire, both directions: ragged moves the routed rows out and back, capacity
    # moves its whole [R, C, H] buffer each way.
    payload = sent + routed_in if plan.mode == "ragged" else 2 * r * plan.capacity
    per_rank = jnp.stack([sent - got.kept_send.sum(), order.group_sizes.sum(), payload, sent + routed_in])
    return RankOutputs(out, ids, weights, perm.tokens_per_expert[None], per_rank[None].astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("plan", "mesh", "axis", "backend", "ragged_fn", "num_tokens"))
def _forward(params: MoEParams, x, valid, token_ids, *, plan, mesh, axis, backend, ragged_fn, num_tokens):
    expert_spec = params.replace(**{name: P(axis) if name in EXPERT_KEYS else P() for name, _ in params.items()})
    body = functools.partial(_rank_forward, plan=plan, axis=axis, backend=backend, ragged_fn=ragged_fn)
    # check_vma=False: the Pallas expert / router kernels inside need it (jax-on-cpu.md 4).
    out_specs = RankOutputs(*(P(axis),) * len(RankOutputs._fields))
    args = (params, x, valid) + (() if token_ids is None else (token_ids,))
    in_specs = (expert_spec,) + (P(axis),) * (len(args) - 1)
    res = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    per_rank = res.per_rank
    row_bytes = plan.cfg.hidden_size * jnp.dtype(x.dtype).itemsize
    count_bytes = plan.num_ranks * plan.cfg.num_experts * 4  # the all_gather of int32 counts
    bytes_sent = per_rank[:, 2].astype(jnp.float32) * row_bytes + count_bytes
    min_bytes = per_rank[:, 3].astype(jnp.float32) * row_bytes
    total_min = min_bytes.sum()
    stats = {
        "topk_ids": res.topk_ids[:num_tokens],
        "topk_weights": res.topk_weights[:num_tokens],
        "tokens_per_expert": res.tokens_per_expert.sum(axis=0),
        "dropped_pairs": per_rank[:, 0].sum(),
        "rows_received": per_rank[:, 1],
        "bytes_sent": bytes_sent,
        "min_bytes": min_bytes,
        "bytes_ratio": jnp.where(total_min > 0, bytes_sent.sum() / jnp.maximum(total_min, 1.0), jnp.inf),
    }
    return res.out[:num_tokens], stats


def ep_moe_layer(params: MoEParams, x, cfg: moe.MoEConfig, mesh, *, axis: str = "ep", dispatch: str = "auto",
                 capacity_factor=None, valid_tokens=None, return_stats: bool = False, backend: str = "auto",
                 ragged_all_to_all=None, token_ids=None):
    """Expert-parallel MoE forward `x [T, H]` -> `[T, H]` (x.dtype); see the module docstring."""
    if getattr(x, "ndim", None) != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, H={cfg.hidden_size}], got shape {getattr(x, 'shape', None)}")
    if x.shape[0] < 1:
        raise ValueError("x must hold at least one token row, got T=0")
    moe.check_params(params, cfg)
    r = _num_ranks(mesh, axis)
    _check_experts_divide(cfg, r)
    _check_capacity_factor(capacity_factor)
    mode = resolve_dispatch(dispatch, mesh, capacity_factor=capacity_factor, ragged_all_to_all=ragged_all_to_all)
    t = x.shape[0]
    rows_per_rank = -(-t // r)
    capacity = ragged.capacity_rows(rows_per_rank, cfg.topk, cfg.num_experts, r, capacity_factor)
    plan = _Plan(cfg, r, rows_per_rank, mode, capacity)
    token_sharding = NamedSharding(mesh, P(axis))
    x_global = _place(_pad_rows(x, rows_per_rank * r), token_sharding)
    valid = _place(_valid_rows(valid_tokens, t, rows_per_rank * r), token_sharding)
    ids = _token_id_rows(token_ids, cfg, t, rows_per_rank * r)
    ids = None if ids is None else _place(ids, token_sharding)
    params = shard_params(params, cfg, mesh, axis)  # a no-op for already placed params
    out, stats = _forward(params, x_global, valid, ids, plan=plan, mesh=mesh, axis=axis, backend=backend,
                          ragged_fn=ragged_all_to_all or lax.ragged_all_to_all, num_tokens=t)
    return (out, stats) if return_stats else out
