"""Expert-parallel MoE layer (expertd.kernels.ep) against the single-device layer, on 1-8 simulated
CPU devices, with and without redundant experts (EPLB placements).

Compiling one (family, R, slots, mode, shape) costs 1-3 s of CPU, so shapes are shared on purpose:
most tests use T=24, E=8, k=2 and a (family, R, slots, mode) that an earlier test compiled (jit
cache hits). A placement's tables are run-time arrays: two placements of one shape share a compile.

Tolerance: fp32 outputs equal `moe.moe_layer` to 1e-5. Both layers compute the same expert
products in fp32 and add the k weighted outputs in fp32; only the order of that sum differs (the
EP layer adds one partial per rank), which moves the last bits of an O(1) value.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_multiprocess import family_layer_config
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels import ep, eplb, moe, ragged

H, I = 32, 16
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16: both layers round the same fp32-accumulated values to bf16, but the EP layer also rounds
# each rank's partial sum to bf16 for the trip back (one more rounding of 2^-8 relative).
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")

moe_layer_jit = jax.jit(moe.moe_layer, static_argnames=("cfg", "backend", "return_routing"))
emulated = ragged.ragged_all_to_all_emulated


@functools.cache
def mesh_of(r):
    return jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])


@functools.cache
def setup(family, num_experts=None, topk=None, dtype="float32"):
    # Qwen3 with k=4 of 16 experts: more experts per token than a rank holds at R=8 (E/R=2).
    e, k = (16, 4) if family == "qwen3_moe" else (8, 2)
    cfg = family_layer_config(family, num_experts or e, topk or k, H, I)
    params = moe.init_params(cfg, jax.random.key(0), jnp.dtype(dtype))
    return cfg, jax.tree.map(np.asarray, params)


def tokens(t, seed=1, dtype=np.float32):
    return np.asarray(jax.random.normal(jax.random.key(seed), (t, H), jnp.float32)).astype(dtype)


def reference(params, x, cfg, **kw):
    out, routing = moe_layer_jit(params, jnp.asarray(x), cfg, return_routing=True, **kw)
    return np.asarray(out.astype(jnp.float32)), jax.tree.map(np.asarray, routing)


def mode_kw(mode):
    return dict(dispatch=mode, ragged_all_to_all=emulated) if mode == "ragged" else dict(dispatch=mode)


def run_ep(params, x, cfg, r, placement=None, **kw):
    if placement is not None and not placement.is_identity:
        params = ep.shard_params(params, cfg, mesh_of(r), placement=placement)
    out, stats = ep.ep_moe_layer(params, x, cfg, mesh_of(r), return_stats=True, placement=placement, **kw)
    return np.asarray(out.astype(jnp.float32)), jax.tree.map(np.asarray, stats)


def skewed_params(cfg, params, target_rank, r):
    """Router weights that send every token to experts of `target_rank` only (x[:, 0] is set to 8)."""
    el = cfg.num_experts // r
    w = np.array(params.router_weight)
    w[0] = -4.0
    w[0, target_rank * el:(target_rank + 1) * el] = 4.0 + np.arange(el) * 0.5
    params = params.replace(router_weight=w)
    if params.expert_bias is not None:
        params = params.replace(expert_bias=np.zeros_like(params.expert_bias))
    return params


def skewed_tokens(t, seed=2):
    x = tokens(t, seed)
    x[:, 0] = 8.0
    return x


def expected_exchange(ids, placement, r):
    """By hand from the routing: per rank, rows out (one per (token, destination rank)), rows in,
    (token, expert) pairs out and in, and the pairs each physical slot runs. The rank's n-th token
    of expert e (token order) uses replica (n + rank) % count[e]."""
    t = len(ids)
    tr, s = -(-t // r), placement.slots_per_rank
    replicas, counts = placement.logical_to_physical, placement.replica_counts
    out = {name: np.zeros(r, np.int64) for name in ("rows_out", "rows_in", "pairs_out", "pairs_in")}
    slot_tokens = np.zeros(placement.num_physical, np.int64)
    for src in range(r):
        nth = np.zeros(placement.num_logical, np.int64)
        for tok in range(src * tr, min(t, (src + 1) * tr)):
            dests = set()
            for e in ids[tok]:
                if e < 0:
                    continue
                slot = replicas[e, (nth[e] + src) % counts[e]]
                nth[e] += 1
                slot_tokens[slot] += 1
                dests.add(slot // s)
                out["pairs_out"][src] += 1
                out["pairs_in"][slot // s] += 1
            out["rows_out"][src] += len(dests)
            for d in dests:
                out["rows_in"][d] += 1
    return out, slot_tokens


def check_against_reference(params, x, cfg, r, placement, mode):
    want, routing = reference(params, x, cfg)
    got, stats = run_ep(params, x, cfg, r, placement, **mode_kw(mode))
    np.testing.assert_allclose(got, want, **FP32_TOL)
    np.testing.assert_array_equal(stats["topk_ids"], routing["topk_ids"])
    # Both compute the router logits as an fp32 dot, but each rank over its own rows: XLA's CPU dot
    # may sum in another order for another row count (seen on AMD EPYC, not on Xeon): the weights
    # then differ by up to 4e-6 relatively (atol 0: tiny weights are held to the same rtol).
    np.testing.assert_allclose(stats["topk_weights"], routing["topk_weights"], rtol=FP32_TOL["rtol"], atol=0)
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])
    assert stats["dropped_pairs"] == 0 and stats["dropped_rows"] == 0
    placement = placement or eplb.Placement.identity(cfg.num_experts, r)
    counted, slot_tokens = expected_exchange(routing["topk_ids"], placement, r)
    np.testing.assert_array_equal(stats["tokens_per_slot"], slot_tokens)
    np.testing.assert_array_equal(stats["rows_received"], slot_tokens.reshape(r, -1).sum(1))
    row = H * 4
    np.testing.assert_array_equal(stats["min_rank_bytes"], (counted["rows_out"] + counted["rows_in"]) * row)
    np.testing.assert_array_equal(stats["pair_bytes"], (counted["pairs_out"] + counted["pairs_in"]) * row)
    if mode == "ragged":  # the exchange sends exactly the minimum of the scheme
        np.testing.assert_array_equal(stats["bytes_sent"], stats["min_rank_bytes"])
        np.testing.assert_array_equal(stats["padding_bytes"], 0)
    else:  # dropless capacity: fixed [R, T/R] blocks both ways, the rest of them padding
        np.testing.assert_array_equal(stats["bytes_sent"], 2 * r * -(-len(x) // r) * row)
        np.testing.assert_array_equal(stats["padding_bytes"], stats["bytes_sent"] - stats["min_rank_bytes"])
    return stats


@pytest.mark.parametrize("mode", ("capacity", "ragged"))
@pytest.mark.parametrize("redundant", (False, True))
@pytest.mark.parametrize("r", (4, 8))
@pytest.mark.parametrize("family", FAMILIES)
def test_equals_moe_layer_uniform_and_skewed(family, r, redundant, mode):
    """Every family on 4 and 8 ranks, without and with R redundant slots, both modes; uniform
    routing, then all tokens on one rank's experts with a placement planned from that load (a
    permutation of the experts when there are no redundant slots)."""
    cfg, params = setup(family)
    x = tokens(24)
    n = r if redundant else 0
    uniform = eplb.plan_placement(np.ones(cfg.num_experts), r, n) if redundant else None
    check_against_reference(params, x, cfg, r, uniform, mode)
    hot = skewed_params(cfg, params, target_rank=r - 1, r=r)
    xs = skewed_tokens(24)
    load = reference(hot, xs, cfg)[1]["tokens_per_expert"]
    planned = eplb.plan_placement(load, r, n)
    assert not planned.is_identity
    stats = check_against_reference(hot, xs, cfg, r, planned, mode)
    identity_balance = eplb.Placement.identity(cfg.num_experts, r).balancedness(load)
    if redundant:  # the hot experts' replicas spread their tokens
        assert stats["balancedness"] > identity_balance
    else:  # a permutation can only regroup whole experts
        assert stats["balancedness"] >= identity_balance


@pytest.mark.parametrize("r", (1, 2))
def test_one_and_two_ranks_equal_moe_layer(r):
    cfg, params = setup("deepseek_v3")
    check_against_reference(params, tokens(24), cfg, r, None, "capacity")


@pytest.mark.parametrize("r", (2, 4))
def test_capacity_expert_backend_inside_the_ranks_equals_moe_layer(r):
    """The "capacity" expert backend picks its bucket with lax.switch on each rank's own groups."""
    cfg, params = setup("mixtral")
    x = tokens(24)
    got, stats = run_ep(params, x, cfg, r, dispatch="capacity", backend="capacity")
    np.testing.assert_allclose(got, reference(params, x, cfg)[0], **FP32_TOL)
    assert stats["dropped_pairs"] == 0


@pytest.mark.parametrize("num_tokens", (24, 256))  # ~6 rows per expert (streaming path), ~64 (packed)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_native_cpu_expert_backend_inside_the_ranks_equals_moe_layer(dtype, num_tokens):
    """The C++ custom call runs per simulated device inside shard_map (concurrently, each on its
    own thread-local panels in the packed path), on each rank's own groups."""
    from expertd.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no native kernel: {cpu.unavailable_reason()}")
    cfg, params = setup("mixtral", dtype=dtype)
    x = tokens(num_tokens, dtype=jnp.dtype(dtype))
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", backend="native_cpu")
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    np.testing.assert_allclose(got, reference(params, x, cfg, backend="native_cpu")[0], **tol)
    np.testing.assert_allclose(got, reference(params, x, cfg, backend="expert_loop")[0], **tol)
    assert stats["dropped_pairs"] == 0


def test_bf16_matches_moe_layer_within_documented_tolerance():
    cfg, params = setup("deepseek_v3", dtype="bfloat16")
    x = tokens(24, dtype=jnp.bfloat16)
    want, routing = reference(params, x, cfg)
    got, stats = run_ep(params, x, cfg, 4, dispatch="ragged", ragged_all_to_all=emulated)
    np.testing.assert_allclose(got, want, **BF16_TOL)
    # bf16 rows are 2 bytes per element.
    counted, _ = expected_exchange(routing["topk_ids"], eplb.Placement.identity(8, 4), 4)
    np.testing.assert_array_equal(stats["bytes_sent"], (counted["rows_out"] + counted["rows_in"]) * H * 2)


@pytest.mark.parametrize("mode", ["capacity", "ragged"])
@pytest.mark.parametrize("r", [2, 4])
def test_all_tokens_to_one_ranks_experts(mode, r):
    cfg, params = setup("mixtral")
    params = skewed_params(cfg, params, target_rank=r - 1, r=r)
    x = skewed_tokens(24)
    want, routing = reference(params, x, cfg)
    el = cfg.num_experts // r
    assert (routing["topk_ids"] // el == r - 1).all()  # the setup really is skewed
    got, stats = run_ep(params, x, cfg, r, **mode_kw(mode))
    np.testing.assert_allclose(got, want, **FP32_TOL)
    assert np.isfinite(got).all()
    assert stats["dropped_pairs"] == 0  # the worst-case capacity holds exactly this case
    np.testing.assert_array_equal(stats["rows_received"], [0] * (r - 1) + [24 * cfg.topk])
    # Both experts of every token are on one rank: one row per token instead of two.
    np.testing.assert_array_equal(stats["min_rank_bytes"].sum() * 2, stats["pair_bytes"].sum())


def test_ranks_that_receive_nothing_and_more_ranks_than_tokens():
    cfg, params = setup("deepseek_v3")
    x = tokens(3)  # R=8: 5 ranks hold only padding rows
    want, _ = reference(params, x, cfg)
    for mode in ("capacity", "ragged"):
        got, stats = run_ep(params, x, cfg, 8, **mode_kw(mode))
        np.testing.assert_allclose(got, want, **FP32_TOL)
        assert got.shape == (3, H)
        assert (stats["rows_received"] == 0).any()


def test_valid_tokens_count_and_mask_with_nan_padding():
    cfg, params = setup("qwen2_moe")
    x = tokens(24)
    x[20:] = np.nan  # padding rows never reach an expert, so their garbage cannot leak
    want, routing = reference(params, x, cfg, valid_tokens=20)
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=20)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    np.testing.assert_array_equal(got[20:], 0)
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])
    assert stats["tokens_per_expert"].sum() == 20 * cfg.topk
    np.testing.assert_array_equal(stats["topk_ids"], routing["topk_ids"])  # -1 on padding rows
    np.testing.assert_array_equal(stats["topk_ids"][20:], -1)
    np.testing.assert_array_equal(stats["topk_weights"][20:], 0)
    mask = np.arange(24) % 3 != 0
    x = tokens(24)
    want, _ = reference(params, x, cfg, valid_tokens=mask)
    got, _ = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=mask)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=0)
    np.testing.assert_array_equal(got, 0)
    assert stats["tokens_per_expert"].sum() == 0 and stats["bytes_ratio"] == np.inf
    assert stats["balancedness"] == 1.0


def dropped_by_hand(topk_ids, r, el, capacity):
    """Per source rank: one row per (token, destination rank), in token order per destination;
    rows past `capacity` drop with all their (token, expert) pairs. Returns (pairs, rows) dropped."""
    t = topk_ids.shape[0]
    per_rank = -(-t // r)
    pairs, rows = set(), 0
    for src in range(r):
        for dst in range(r):
            hits = [tok for tok in range(src * per_rank, min(t, (src + 1) * per_rank))
                    if any(e >= 0 and e // el == dst for e in topk_ids[tok])]
            for tok in hits[capacity:]:
                rows += 1
                pairs.update((tok, j) for j, e in enumerate(topk_ids[tok]) if e // el == dst)
    return pairs, rows


def gated_mlp_np(x, wg, wu, wd):
    g, u = x @ wg, x @ wu
    return (g / (1 + np.exp(-g)) * u) @ wd


def test_low_capacity_factor_reports_the_exact_dropped_pairs():
    capacity_factor = 0.5
    cfg, params = setup("deepseek_v3", num_experts=16, topk=4)
    r, t = 4, 32
    params = skewed_params(cfg, params, target_rank=1, r=r)
    params.router_weight[0, :4] = 3.0  # most pairs go to rank 1, some to rank 0
    x = tokens(t, seed=5)
    x[:, 0] = 1.5  # moderate logits: sigmoid scores stay distinct (no saturation ties)
    x[::3, 0] = 0.0  # a third of the tokens route by their random features
    _, routing = reference(params, x, cfg)
    ids, weights = routing["topk_ids"], routing["topk_weights"]
    per_rank, el = t // r, cfg.num_experts // r
    capacity = ragged.rank_capacity(per_rank, cfg.topk, r, capacity_factor)
    assert capacity == math.ceil(capacity_factor * per_rank * min(cfg.topk, r) / r) == 4
    dropped, dropped_rows = dropped_by_hand(ids, r, el, capacity)
    assert 0 < len(dropped) < t * cfg.topk

    got, stats = run_ep(params, x, cfg, r, dispatch="capacity", capacity_factor=capacity_factor)
    assert stats["dropped_pairs"] == len(dropped) and stats["dropped_rows"] == dropped_rows
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])  # routed, pre-drop
    assert stats["rows_received"].sum() == t * cfg.topk - len(dropped)
    # Dropped pairs contribute nothing and the kept weights are NOT renormalised.
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x64 = x.astype(np.float64)
    want = gated_mlp_np(x64, p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"])
    for tok in range(t):
        for j, e in enumerate(ids[tok]):
            if (tok, j) not in dropped:
                want[tok] += weights[tok, j] * gated_mlp_np(x64[tok], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The bytes on the wire are the fixed buffers: R * C rows out and back per rank.
    np.testing.assert_array_equal(stats["bytes_sent"], 2 * r * capacity * H * 4)
    assert (stats["padding_bytes"] < stats["bytes_sent"]).all()


def test_bytes_and_metadata_accounting():
    cfg, params = setup("mixtral")
    x = tokens(24)
    r, row = 2, H * 4
    _, routing = reference(params, x, cfg)
    counted, _ = expected_exchange(routing["topk_ids"], eplb.Placement.identity(8, r), r)
    _, cap = run_ep(params, x, cfg, r, dispatch="capacity")
    _, rag = run_ep(params, x, cfg, r, dispatch="ragged", ragged_all_to_all=emulated)
    np.testing.assert_array_equal(cap["min_rank_bytes"], rag["min_rank_bytes"])
    np.testing.assert_array_equal(rag["bytes_sent"], rag["min_rank_bytes"])
    assert rag["bytes_ratio"] == 1.0
    np.testing.assert_array_equal(cap["bytes_sent"], 2 * r * 12 * row)  # C = T/R = 12 rows per destination
    np.testing.assert_allclose(cap["bytes_ratio"], cap["bytes_sent"].sum() / cap["min_rank_bytes"].sum(), rtol=1e-6)
    # Metadata, outside the payload: the [2, R] int32 counts to every rank, then per dispatch row
    # min(k, S) = 2 (slot, weight) pairs of int32.
    np.testing.assert_array_equal(rag["meta_bytes"], 2 * r * r * 4 + counted["rows_out"] * 2 * 8)
    np.testing.assert_array_equal(cap["meta_bytes"], 2 * r * r * 4 + r * 12 * 2 * 8)


def test_shard_params_lays_out_physical_slots_and_placed_params_are_reused():
    cfg, params = setup("mixtral")
    mesh = mesh_of(4)
    placed = ep.shard_params(params, cfg, mesh)
    assert isinstance(placed, moe.MoEParams) and placed.w_gate.sharding.spec == P("ep")
    assert placed.w_gate.addressable_shards[0].data.shape == (2, H, I)
    assert placed.router_weight.sharding.is_fully_replicated
    assert ep.shard_params(placed, cfg, mesh).w_up is placed.w_up  # placing again is a no-op
    x = tokens(24)
    host = np.asarray(ep.ep_moe_layer(params, x, cfg, mesh, dispatch="capacity"))
    x_placed = jax.device_put(x, NamedSharding(mesh, P("ep")))
    np.testing.assert_array_equal(np.asarray(ep.ep_moe_layer(placed, x_placed, cfg, mesh, dispatch="capacity")), host)
    # A placement with 4 redundant slots: 3 slots per rank, each slot a copy of its expert's weights.
    placement = eplb.plan_placement(np.arange(1.0, 9.0) ** 2, 4, 4)
    physical = ep.shard_params(params, cfg, mesh, placement=placement)
    assert physical.w_down.shape == (12, I, H)
    assert {s.data.shape for s in physical.w_down.addressable_shards} == {(3, I, H)}
    np.testing.assert_array_equal(np.asarray(physical.w_down), params.w_down[placement.physical_to_logical.reshape(-1)])
    on_device = ep.shard_params(placed, cfg, mesh, placement=placement)  # from device arrays: the same
    np.testing.assert_array_equal(np.asarray(on_device.w_gate), np.asarray(physical.w_gate))


def test_placement_tables_swap_without_recompiling_and_relayout_moves_only_changed_ranks():
    cfg, params = setup("mixtral")
    mesh, r = mesh_of(4), 4
    x = tokens(24)
    want = reference(params, x, cfg)[0]
    first = eplb.plan_placement(np.arange(1.0, 9.0), r, 4)
    second = eplb.plan_placement(np.arange(8.0, 0.0, -1.0) ** 3, r, 4)
    assert first != second and first.num_physical == second.num_physical
    weights = ep.shard_params(params, cfg, mesh, placement=first)
    tables = ep.placement_tables(first, mesh)
    out = ep.ep_moe_layer(weights, x, cfg, mesh, dispatch="capacity", placement=tables)
    np.testing.assert_allclose(np.asarray(out), want, **FP32_TOL)
    compiled = ep._forward._cache_size()
    moved = ep.relayout(weights, first, second, mesh)
    np.testing.assert_array_equal(np.asarray(moved.w_up), np.asarray(ep.shard_params(params, cfg, mesh,
                                                                                     placement=second).w_up))
    same = (first.physical_to_logical == second.physical_to_logical).all(axis=1)
    for old, new in zip(weights.w_up.addressable_shards, moved.w_up.addressable_shards):
        rank = old.index[0].start // 3
        assert (old.data.unsafe_buffer_pointer() == new.data.unsafe_buffer_pointer()) == bool(same[rank])
    assert moved.router_weight is weights.router_weight
    out = ep.ep_moe_layer(moved, x, cfg, mesh, dispatch="capacity", placement=ep.placement_tables(second, mesh))
    np.testing.assert_allclose(np.asarray(out), want, **FP32_TOL)
    assert ep._forward._cache_size() == compiled  # same shapes: the swap reused the compiled step
    assert ep.relayout(weights, first, first, mesh) is weights


def test_auto_dispatch_is_capacity_on_cpu():
    mesh = mesh_of(2)
    assert ep.resolve_dispatch("auto", mesh) == "capacity"
    assert ep.resolve_dispatch("ragged", mesh, ragged_all_to_all=emulated) == "ragged"


@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch="ragged"), "XLA:CPU cannot compile"),
    (dict(dispatch="dense"), "dispatch must be one of"),
    (dict(dispatch="capacity", capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
    (dict(dispatch="ragged", capacity_factor=1.0, ragged_all_to_all=emulated), "capacity_factor applies to"),
    (dict(axis="tp"), "axis 'tp' is not a mesh axis"),
])
def test_bad_arguments_raise_value_errors_naming_them(kwargs, match):
    cfg, params = setup("mixtral")
    with pytest.raises(ValueError, match=match):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(2), **kwargs)


def test_bad_shapes_and_placements_raise_errors():
    cfg, params = setup("mixtral")
    with pytest.raises(ValueError, match="must be divisible by the 3 ranks"):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(3))
    with pytest.raises(ValueError, match=r"x must be \[T, H=32\]"):
        ep.ep_moe_layer(params, np.zeros((4, 8), np.float32), cfg, mesh_of(2))
    with pytest.raises(ValueError, match="w_down"):
        ep.ep_moe_layer(params.replace(w_down=None), tokens(4), cfg, mesh_of(2))
    with pytest.raises(TypeError, match="MoEParams"):
        ep.ep_moe_layer(params.to_dict(), tokens(4), cfg, mesh_of(2))
    placement = eplb.plan_placement(np.arange(8.0), 2, 2)
    with pytest.raises(ValueError, match=r"w_gate must have shape \(10, 32, 16\).*shard_params"):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(2), placement=placement.tables())
    with pytest.raises(ValueError, match="host expert weights can only be logical"):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(2), placement=eplb.plan_placement(np.arange(8.0), 2, 0))
    with pytest.raises(ValueError, match="placement is for 8 experts on 2 ranks"):
        ep.shard_params(params, cfg, mesh_of(4), placement=placement)
    with pytest.raises(TypeError, match="placement must be"):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(2), placement=np.zeros((2, 5)))
