"""Expert-parallel MoE layer: physical expert slots over a mesh axis, tokens exchanged once per rank.

Public API (T tokens, H hidden, E logical experts, k top-k, R ranks on `axis`; with a placement,
P = E + N physical slots, S = P / R per rank; without one, P = E and expert e is slot e):

  plan_placement(load [E], num_ranks, num_redundant, *, num_groups=None, num_nodes=1) -> Placement
      DeepSeek's EPLB policy over an observed load (`expertd.kernels.eplb`, which also holds the
      Placement type: physical_to_logical [R, S], replica counts, logical_to_physical, balancedness).

  shard_params(params: MoEParams, cfg, mesh, axis="ep", *, placement=None) -> MoEParams
      Places the LOGICAL params on the mesh once: w_gate / w_up / w_down laid out in the
      placement's physical order (row p = logical expert physical_to_logical.flat[p], so the
      weights of a replicated expert are copied to each of its slots), split on their first dim
      (S slots per rank); everything else replicated. Without a placement: expert e on slot e
      (E % R == 0), and placing already placed params again is a no-op.

  placement_tables(placement, mesh) -> PlacementTables
      The placement's run-time tables (replicas [E, N + 1], counts [E]) replicated on the mesh:
      what ep_moe_layer reads to pick a replica. Their shape depends only on (E, N), so a server
      swaps placements without recompiling.

  relayout(params, old: Placement, new: Placement, mesh, axis="ep") -> MoEParams
      Physical params laid out for `old` -> the same weights laid out for `new`. Ranks whose slots
      do not change keep their device buffers; the others get a new buffer assembled on the host
      from the slots that already hold each expert (same rank first), put on their device with
      `device_put`: no collective, so it can run beside the steps of another thread. One process.

  ep_moe_layer(params: MoEParams, x [T, H], cfg, mesh, *, axis="ep", dispatch="auto",
               capacity_factor=None, valid_tokens=None, return_stats=False, backend="auto",
               ragged_all_to_all=None, placement=None)
      -> out [T, H] in x.dtype, or (out, stats) with return_stats.
      Same contract as `moe.moe_layer` (valid_tokens: None, an int count or a bool [T] mask;
      padding rows are not routed and come back as zeros), computed as `ep_rank` describes: every
      token travels once to each rank holding at least one of its experts and comes back as one
      weighted partial sum per (token, rank), added in fp32 on its own rank.
      placement: None (expert e on slot e), a Placement, or PlacementTables (host or device). With
        one, params must be `shard_params(params, cfg, mesh, placement=...)`'s output (expert
        weights [P, ...] in its physical order; host expert weights with a non-identity Placement
        are refused, since they can only be logical). Each rank splits its tokens of a replicated
        expert evenly over its replicas (the n-th, in token order, to replica (n + rank) % count).
      token_ids: int32 [T], required by hash-routed layers (sharded with the tokens), ignored by
        the others.
      dispatch:
        "ragged"    counts first, then only the routed rows (`jax.lax.ragged_all_to_all`) into a
                    receive buffer of R * T/R rows; dropless. GPU/TPU only: XLA:CPU cannot compile
                    the op (`ragged.ragged_all_to_all_emulated` runs the same code on CPU).
        "capacity"  a dense all_to_all of a fixed [R, C, H] block per rank. Default C = T/R, the
                    dropless worst case (a token goes to a rank once); capacity_factor f sets
                    C = ceil(f * (T/R) * min(k, R) / R): the rows past C of a destination are
                    dropped with all their experts, counted, and the kept weights are NOT
                    renormalised.
        "auto"      "ragged" on GPU/TPU, else "capacity" (also "capacity" with a capacity_factor).
      backend: grouped-GEMM backend of `expertd.kernels.experts` for the rank's slots.
      In bf16 each partial is rounded to bf16 for the trip back (as DeepEP's bf16 combine), then
      the partials are added in fp32: one bf16 rounding more than `moe.moe_layer`.

  stats (jax arrays; "rows" are hidden-state rows of H * itemsize(x.dtype) bytes):
      topk_ids int32 [T, k], topk_weights fp32 [T, k]: the logical routing each rank computed (-1 /
        0 on padding rows), so a caller needs no second routing pass;
      tokens_per_expert int32 [E]: routed (token, logical expert) pairs, padding excluded, pre-drop;
      tokens_per_slot int32 [P]: pairs each physical slot ran (after drops);
      rows_received int32 [R]: pairs each rank's slots ran, its load; balancedness fp32 [] = mean /
        max of it (1 when nothing ran);
      dropped_pairs int32 [], dropped_rows int32 []: capacity drops (0 in ragged mode);
      per rank, both directions (dispatch out + combine back), payload rows only:
      bytes_sent fp32 [R]: rows the rank puts on the wire (capacity: its whole [R, C, H] buffers;
        rows a rank sends itself count too: they go through the same buffers);
      min_rank_bytes fp32 [R]: the minimum of this scheme, one row per (token, destination rank)
        its tokens hit out, one per (token, rank) pair it received back; ragged mode sends exactly
        this;
      padding_bytes fp32 [R]: bytes_sent minus the rows that carried a token (capacity padding);
      pair_bytes fp32 [R]: what one row per (token, expert) pair would send (the scheme before);
      meta_bytes fp32 [R]: not in the above: the [2, R] int32 count all_gather and the int32
        (slot, weight) metadata rows of the dispatch;
      bytes_ratio fp32 [] = sum(bytes_sent) / sum(min_rank_bytes) (inf when nothing is routed).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels import ep_rank, moe, ragged
from expertd.kernels.eplb import Placement, PlacementTables, plan_placement
from expertd.kernels.params import EXPERT_FIELDS, MoEParams, logical_shape, param_shapes
from expertd.kernels.routing import TokenIdsError

__all__ = ["DISPATCH_MODES", "Placement", "PlacementTables", "ep_moe_layer", "placement_tables", "plan_placement",
           "relayout", "resolve_dispatch", "shard_params"]

DISPATCH_MODES = ("auto", "ragged", "capacity")
# laid out by slot and split on dim 0 (weights and per-expert biases); all other params are replicated
EXPERT_KEYS = EXPERT_FIELDS
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # where XLA compiles ragged-all-to-all


def _num_ranks(mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not a mesh axis; mesh axes are {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


def _as_placement(placement, cfg: moe.MoEConfig, num_ranks: int) -> Placement:
    if placement is None:
        if cfg.num_experts % num_ranks:
            raise ValueError(f"cfg.num_experts={cfg.num_experts} must be divisible by the {num_ranks} ranks of the EP "
                             "axis (or give a placement whose E + N slots are)")
        return Placement.identity(cfg.num_experts, num_ranks)
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be an eplb.Placement or None, got {type(placement).__name__}")
    if placement.num_logical != cfg.num_experts or placement.num_ranks != num_ranks:
        raise ValueError(f"placement is for {placement.num_logical} experts on {placement.num_ranks} ranks; the layer "
                         f"has {cfg.num_experts} experts and the EP axis {num_ranks} ranks")
    return placement


def _place(value, sharding: NamedSharding):
    """A global array with `sharding`; host values are copied from every process's own copy."""
    if isinstance(value, jax.core.Tracer):  # under an outer jit
        return lax.with_sharding_constraint(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)  # every process holds the same full value
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.lru_cache(maxsize=64)
def _take_program(sharding: NamedSharding):
    return jax.jit(lambda a, order: jnp.take(a, order, axis=0), out_shardings=sharding)


def _gather_place(value, order: np.ndarray, sharding: NamedSharding):
    """value [E, ...] -> value[order] [P, ...] with `sharding`, each process building only its shards."""
    if isinstance(value, jax.core.Tracer):
        return lax.with_sharding_constraint(jnp.take(value, jnp.asarray(order), axis=0), sharding)
    if isinstance(value, jax.Array):
        return _take_program(sharding)(value, order)
    if not hasattr(value, "__array__"):
        raise TypeError(f"expert weights to lay out for a placement must be arrays, got {type(value).__name__} "
                        "(prepared weights keep their own layout; place the arrays they were made from)")
    host = np.asarray(value)
    return jax.make_array_from_callback((len(order),) + host.shape[1:], sharding,
                                        lambda index: host[order[index[0]]])


def shard_params(params: MoEParams, cfg: moe.MoEConfig, mesh, axis: str = "ep", *, placement=None) -> MoEParams:
    """Place logical `params` on `mesh` in `placement`'s physical layout; see the module docstring."""
    moe.check_params(params, cfg)
    placement = _as_placement(placement, cfg, _num_ranks(mesh, axis))
    split, replicated = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P())
    order = placement.physical_to_logical.reshape(-1)
    identity = placement.is_identity

    def lay_out(name, value):
        if name not in EXPERT_KEYS:
            return _place(value, replicated)
        return _place(value, split) if identity else _gather_place(value, order, split)

    return params.replace(**{name: lay_out(name, value) for name, value in params.items()})


def placement_tables(placement: Placement, mesh) -> PlacementTables:
    """`placement.tables()` as device arrays replicated over `mesh` (see the module docstring)."""
    replicated = NamedSharding(mesh, P())
    return PlacementTables(*(_place(t, replicated) for t in placement.tables()))


def _source_slots(old: Placement, new: Placement) -> np.ndarray:
    """int [P]: for each slot of `new`, a slot of `old` holding the same expert (the same slot,
    else one on the same rank, else the first)."""
    s = old.slots_per_rank
    old_flat, new_flat = old.physical_to_logical.reshape(-1), new.physical_to_logical.reshape(-1)
    holders = old.logical_to_physical
    source = np.empty(new_flat.size, np.int64)
    for p, e in enumerate(new_flat):
        if old_flat[p] == e:
            source[p] = p
            continue
        candidates = holders[e][holders[e] >= 0]
        same_rank = candidates[candidates // s == p // s]
        source[p] = same_rank[0] if same_rank.size else candidates[0]
    return source


def relayout(params: MoEParams, old: Placement, new: Placement, mesh, axis: str = "ep") -> MoEParams:
    """`params` laid out for `old` -> laid out for `new`; see the module docstring."""
    if (old.num_logical, old.physical_to_logical.shape) != (new.num_logical, new.physical_to_logical.shape):
        raise ValueError(f"relayout needs placements of one shape: {old} and {new}")
    if old == new:
        return params
    if jax.process_count() > 1:
        raise ValueError("relayout moves weights through this process's host memory: one process only")
    s = new.slots_per_rank
    source = _source_slots(old, new)
    unchanged = (old.physical_to_logical == new.physical_to_logical).all(axis=1)  # [R]
    sharding = NamedSharding(mesh, P(axis))

    def move(value):
        shards = {(shard.index[0].start or 0) // s: shard for shard in value.addressable_shards}
        host: dict[int, np.ndarray] = {}

        def rank_rows(rank):
            if rank not in host:
                host[rank] = np.asarray(shards[rank].data)
            return host[rank]

        parts = []
        for shard in value.addressable_shards:
            rank = (shard.index[0].start or 0) // s
            if unchanged[rank]:
                parts.append(shard.data)
                continue
            rows = np.stack([rank_rows(src // s)[src % s] for src in source[rank * s:(rank + 1) * s]])
            parts.append(jax.device_put(rows, shard.device))
        return jax.make_array_from_single_device_arrays(value.shape, sharding, parts)

    present = [name for name in EXPERT_KEYS if getattr(params, name) is not None]  # biases are optional
    for name in present:
        if logical_shape(getattr(params, name))[0] != new.num_physical:
            raise ValueError(f"params.{name} holds {logical_shape(getattr(params, name))[0]} slots, the placement "
                             f"{new.num_physical}")
    return params.replace(**{name: move(getattr(params, name)) for name in present})


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


def _check_physical_params(params: MoEParams, cfg: moe.MoEConfig, num_physical: int) -> None:
    """moe.check_params, with the expert weights' first dim the P physical slots."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be a MoEParams (MoEParams.from_dict(d, cfg) builds one from a dict of "
                        f"arrays), got {type(params).__name__}")
    for name, shape in param_shapes(cfg).items():
        value = getattr(params, name)
        want = (num_physical,) + shape[1:] if name in EXPERT_KEYS else shape
        if value is None:
            raise ValueError(f"params is missing {name!r} (expected shape {want})")
        if logical_shape(value) != want:
            hint = " (lay them out with ep.shard_params(params, cfg, mesh, placement=placement))" \
                if name in EXPERT_KEYS and num_physical != cfg.num_experts else ""
            raise ValueError(f"params.{name} must have shape {want}, got {logical_shape(value)}{hint}")


def _tables_of(placement, cfg: moe.MoEConfig, num_ranks: int, params: MoEParams):
    """(PlacementTables, P) for ep_moe_layer's `placement` argument."""
    if placement is None or isinstance(placement, Placement):
        placement = _as_placement(placement, cfg, num_ranks)
        if not placement.is_identity and any(isinstance(getattr(params, n), np.ndarray) for n in EXPERT_KEYS
                                             if getattr(params, n) is not None):
            raise ValueError("with a placement, params must be laid out for it: ep.shard_params(params, cfg, mesh, "
                             "placement=placement) (host expert weights can only be logical)")
        return placement.tables(), placement.num_physical
    if not isinstance(placement, PlacementTables):
        raise TypeError(f"placement must be an eplb.Placement, PlacementTables or None, got {type(placement).__name__}")
    if placement.replicas.ndim != 2 or placement.replicas.shape[0] != cfg.num_experts \
            or placement.counts.shape != (cfg.num_experts,):
        raise ValueError(f"placement tables must be replicas [E={cfg.num_experts}, N + 1] and counts [E], got "
                         f"{placement.replicas.shape} and {placement.counts.shape}")
    num_physical = cfg.num_experts + placement.replicas.shape[1] - 1  # E + N
    if num_physical % num_ranks:
        raise ValueError(f"the placement's {num_physical} expert slots are not divisible by the {num_ranks} ranks")
    return placement, num_physical


@functools.partial(jax.jit, static_argnames=("plan", "mesh", "axis", "backend", "ragged_fn", "num_tokens"))
def _forward(params: MoEParams, tables: PlacementTables, x, valid, token_ids, *, plan, mesh, axis, backend, ragged_fn,
             num_tokens):
    param_spec = params.replace(**{name: P(axis) if name in EXPERT_KEYS else P() for name, _ in params.items()})
    body = functools.partial(ep_rank.rank_forward, plan=plan, axis=axis, backend=backend, ragged_fn=ragged_fn)
    # check_vma=False: the Pallas expert / router kernels inside need it (jax-on-cpu.md 4).
    out_specs = ep_rank.RankOutputs(*(P(axis),) * len(ep_rank.RankOutputs._fields))
    args = (params, tables, x, valid) + (() if token_ids is None else (token_ids,))
    in_specs = (param_spec, PlacementTables(P(), P())) + (P(axis),) * (len(args) - 2)
    res = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    c = {name: res.per_rank[:, i].astype(jnp.float32) for i, name in enumerate(ep_rank.COUNTERS)}
    row_bytes = plan.cfg.hidden_size * jnp.dtype(x.dtype).itemsize
    load = res.slot_tokens.sum(axis=1)
    bytes_sent = c["wire_rows"] * row_bytes
    min_rank_bytes = (c["rows_out"] + c["rows_in"]) * row_bytes
    total_min = min_rank_bytes.sum()
    r = plan.num_ranks
    stats = {
        "topk_ids": res.topk_ids[:num_tokens],
        "topk_weights": res.topk_weights[:num_tokens],
        "tokens_per_expert": res.tokens_per_expert.sum(axis=0),
        "tokens_per_slot": res.slot_tokens.reshape(-1),
        "rows_received": load,
        "balancedness": jnp.where(load.max() > 0, load.mean() / jnp.maximum(load.max(), 1), 1.0).astype(jnp.float32),
        "dropped_pairs": res.per_rank[:, 0].sum(),
        "dropped_rows": res.per_rank[:, 1].sum(),
        "bytes_sent": bytes_sent,
        "min_rank_bytes": min_rank_bytes,
        "padding_bytes": (c["wire_rows"] - c["kept_rows"]) * row_bytes,
        "pair_bytes": (c["pairs_out"] + c["pairs_in"]) * row_bytes,
        "meta_bytes": 2 * r * r * 4 + c["meta_rows"] * plan.row_experts * 8,
        "bytes_ratio": jnp.where(total_min > 0, bytes_sent.sum() / jnp.maximum(total_min, 1.0), jnp.inf),
    }
    return res.out[:num_tokens], stats


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


def ep_moe_layer(params: MoEParams, x, cfg: moe.MoEConfig, mesh, *, axis: str = "ep", dispatch: str = "auto",
                 capacity_factor=None, valid_tokens=None, return_stats: bool = False, backend: str = "auto",
                 ragged_all_to_all=None, placement=None, token_ids=None):
    """Expert-parallel MoE forward `x [T, H]` -> `[T, H]` (x.dtype); see the module docstring."""
    if getattr(x, "ndim", None) != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, H={cfg.hidden_size}], got shape {getattr(x, 'shape', None)}")
    if x.shape[0] < 1:
        raise ValueError("x must hold at least one token row, got T=0")
    r = _num_ranks(mesh, axis)
    tables, num_physical = _tables_of(placement, cfg, r, params)
    _check_physical_params(params, cfg, num_physical)
    _check_capacity_factor(capacity_factor)
    mode = resolve_dispatch(dispatch, mesh, capacity_factor=capacity_factor, ragged_all_to_all=ragged_all_to_all)
    t = x.shape[0]
    rows_per_rank = -(-t // r)
    capacity = ragged.rank_capacity(rows_per_rank, cfg.topk, r, capacity_factor)
    plan = ep_rank.Plan(cfg, r, num_physical // r, rows_per_rank, mode, capacity)
    token_sharding, replicated = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P())
    x_global = _place(_pad_rows(x, rows_per_rank * r), token_sharding)
    valid = _place(_valid_rows(valid_tokens, t, rows_per_rank * r), token_sharding)
    split = NamedSharding(mesh, P(axis))
    params = params.replace(**{name: _place(value, split if name in EXPERT_KEYS else replicated)
                               for name, value in params.items()})
    tables = PlacementTables(*(_place(v, replicated) for v in tables))
    ids = _token_id_rows(token_ids, cfg, t, rows_per_rank * r)
    ids = None if ids is None else _place(ids, token_sharding)
    out, stats = _forward(params, tables, x_global, valid, ids, plan=plan, mesh=mesh, axis=axis, backend=backend,
                          ragged_fn=ragged_all_to_all or lax.ragged_all_to_all, num_tokens=t)
    return (out, stats) if return_stats else out
