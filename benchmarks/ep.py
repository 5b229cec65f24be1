"""Expert-parallel MoE layer: bytes on the wire against the minimum, rank load balance with and
without EPLB, and time per layer call, on 8 simulated CPU devices (or the visible GPUs).

Four parts (one JSON, benchmarks/results/ep.json):

1. bytes: DeepSeek-V3's router (E 256, k 8, sigmoid + bias, 8 groups / 4 kept, or plain top-8 for
   "uniform") on 8 ranks, routing measured at a reduced hidden size; the row counts do not depend
   on H, so the bytes at H = 7168 bf16 are the measured rows times 14,336. Per mode: bytes_sent /
   min_rank_bytes (the rank-deduplicated minimum, goal <= 1.05 in ragged mode) and / pair_bytes
   (one row per (token, expert) pair: the scheme before).
2. skew: the same router with a Zipf-like expert popularity (the selection bias), calibrated so the
   plain layout's max / mean rank load is ~2; a placement planned from one batch's load (EPLB, N = 0
   and N = E / 8) measured on another batch: max / mean of the pairs each rank ran (the layer's
   rows_received), goal <= 1.15 at N = E / 8.
3. time: ms per layer call per mode at R in {1, 2, 4, 8} against `moe.moe_layer` in the same run
   (R simulated devices share the CPU's cores: functional, not an EP speed-up); "ragged" is the
   real `jax.lax.ragged_all_to_all` (not runnable on XLA:CPU), "ragged-emu" the same code through
   `ragged.ragged_all_to_all_emulated` (its bytes are the real op's, its time is not).
4. analytic: DeepSeek-V3 on an 8-GPU NVLink node, bytes per rank per layer and µs at 450 GB/s.

The run ends with the goals above checked on its own numbers (met / NOT met).

Run: `flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/ep.py` (writes benchmarks/results/ep.json;
`--quick`: small sizes to check that it runs, written to /tmp; `--parts bytes,skew`: only the exact
counts, which need no quiet machine). On a GPU machine with several GPUs:
`JAX_PLATFORMS=cuda python benchmarks/ep.py`.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import machine, print_table, results, time_calls  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from expertd.kernels import ep, eplb, moe, ragged  # noqa: E402

RESULTS = results.RESULTS / "ep.json"
NVLINK_BYTES_PER_S = 450e9  # H100 / H200 SXM: 900 GB/s total = 450 GB/s per direction per GPU
V3_HIDDEN, V3_ROW_BYTES = 7168, 7168 * 2  # DeepSeek-V3's hidden size, bf16 rows


def mesh_of(r):
    return jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])


def ragged_fn():
    """The real op where XLA compiles it, else the emulation."""
    cpu = jax.default_backend() == "cpu"
    return dict(ragged_all_to_all=ragged.ragged_all_to_all_emulated) if cpu else {}


def v3_config(hidden, intermediate, grouped=True):
    return moe.MoEConfig(num_experts=256, topk=8, hidden_size=hidden, intermediate_size=intermediate,
                         score_function="sigmoid", use_expert_bias=True, num_groups=8 if grouped else None,
                         group_topk=4 if grouped else None, norm_topk_prob=True, scaling_factor=2.5)


def host_params(cfg, seed=0, dtype=jnp.float32):
    return jax.tree.map(np.asarray, moe.init_params(cfg, jax.random.key(seed), dtype))


def tokens(t, hidden, seed, dtype=np.float32):
    return np.asarray(jax.random.normal(jax.random.key(seed), (t, hidden), jnp.float32)).astype(dtype)


def layer_stats(params, x, cfg, r, placement=None, **kw):
    mesh = mesh_of(r)
    if placement is not None and not placement.is_identity:
        params = ep.shard_params(params, cfg, mesh, placement=placement)
    _, stats = ep.ep_moe_layer(params, x, cfg, mesh, return_stats=True, placement=placement, **kw)
    return jax.tree.map(np.asarray, stats)


def measure_bytes(tokens_per_rank: int, r: int, hidden: int):
    rows = []
    for routing, grouped in (("uniform top-8", False), ("DeepSeek-V3, <= 4 groups", True)):
        cfg = v3_config(hidden, 16, grouped)
        params = host_params(cfg)
        x = tokens(tokens_per_rank * r, hidden, seed=1)
        for mode, kw in (("ragged", dict(dispatch="ragged", **ragged_fn())), ("capacity", dict(dispatch="capacity")),
                         ("capacity f=1", dict(dispatch="capacity", capacity_factor=1.0))):
            s = layer_stats(params, x, cfg, r, **kw)
            row_bytes = hidden * 4
            sent, minimum, pairs = (float(s[k].sum()) / row_bytes for k in ("bytes_sent", "min_rank_bytes",
                                                                              "pair_bytes"))
            rows.append(dict(tokens_per_rank=tokens_per_rank, routing=routing, mode=mode, rows_sent=sent,
                             min_rank_rows=minimum, pair_rows=pairs, vs_min=sent / minimum, vs_pairs=sent / pairs,
                             min_vs_pairs=minimum / pairs, dropped_pairs=int(s["dropped_pairs"]),
                             mb_per_rank_at_v3=sent * V3_ROW_BYTES / r / 1e6,
                             meta_share=float(s["meta_bytes"].sum()) / (sent * V3_ROW_BYTES)))
    return rows


def zipf_bias(num_experts, exponent, seed):
    rng = np.random.default_rng(seed)
    log_popularity = -exponent * np.log(np.arange(1, num_experts + 1))
    rng.shuffle(log_popularity)
    return log_popularity - log_popularity.mean()


def measure_skew(tokens_per_rank: int, r: int, hidden: int, target: float = 2.0):
    """Calibrate the Zipf bias scale so the plain layout runs at max / mean ~ `target`, then
    compare placements planned from one batch on another."""
    cfg = v3_config(hidden, 16)
    params = host_params(cfg)
    route = jax.jit(lambda p, x: moe.route(p, x, cfg)[0])
    fit, held_out = tokens(tokens_per_rank * r, hidden, seed=2), tokens(tokens_per_rank * r, hidden, seed=3)
    shape = zipf_bias(cfg.num_experts, 1.0, seed=4)
    identity = eplb.Placement.identity(cfg.num_experts, r)

    def load_of(scale, x):
        biased = params.replace(expert_bias=(scale * shape).astype(np.float32))
        ids = np.asarray(route(biased, x))
        return biased, np.bincount(ids.reshape(-1), minlength=cfg.num_experts).astype(float)

    lo, hi = 0.0, 1.0
    while 1 / identity.balancedness(load_of(hi, fit)[1]) < target and hi < 64:
        hi *= 2
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 / identity.balancedness(load_of(mid, fit)[1]) < target else (lo, mid)
    biased, fit_load = load_of(hi, fit)
    _, test_load = load_of(hi, held_out)
    rows = []
    for name, placement in (("plain layout", identity),
                            ("EPLB, N = 0", eplb.plan_placement(fit_load, r, 0)),
                            (f"EPLB, N = E/8 = {cfg.num_experts // 8}", eplb.plan_placement(fit_load, r,
                                                                                           cfg.num_experts // 8))):
        s = layer_stats(biased, held_out, cfg, r, placement, dispatch="capacity")
        load = s["rows_received"].astype(float)
        rows.append(dict(placement=name, bias_scale=hi, expert_max_over_mean=float(test_load.max() / test_load.mean()),
                         planned_max_over_mean=1 / placement.balancedness(test_load),
                         measured_max_over_mean=float(load.max() / load.mean()),
                         max_replicas=int(placement.replica_counts.max()),
                         ranks_hit_per_token=float(s["min_rank_bytes"].sum() / s["pair_bytes"].sum() * cfg.topk)))
    return rows


def timed(fn, repeats: int):
    """(first call seconds incl. compile, median steady seconds) of fn() -> jax value."""
    timing = time_calls(lambda: jax.block_until_ready(fn()), min_calls=repeats)
    return timing.first_s, timing.median


def measure_time(num_tokens, experts, topk, hidden, intermediate, repeats, max_ranks):
    cfg = moe.MoEConfig(num_experts=experts, topk=topk, hidden_size=hidden, intermediate_size=intermediate)
    params = host_params(cfg, dtype=jnp.bfloat16)
    x = tokens(num_tokens, hidden, seed=1, dtype=jnp.bfloat16)
    single = jax.jit(moe.moe_layer, static_argnames="cfg")
    first, base = timed(lambda: single(params, jnp.asarray(x), cfg), repeats)
    rows = [dict(ranks=1, mode="single", first_s=first, ms=base * 1e3, vs_single=1.0)]
    modes = (("capacity", dict(dispatch="capacity")), ("cap f=1", dict(dispatch="capacity", capacity_factor=1.0)),
             ("ragged", dict(dispatch="ragged", ragged_all_to_all=jax.lax.ragged_all_to_all)),
             ("ragged-emu", dict(dispatch="ragged", ragged_all_to_all=ragged.ragged_all_to_all_emulated)))
    for r in (1, 2, 4, 8):
        if r > max_ranks:
            break
        mesh = mesh_of(r)
        placements = [("", None)]
        if r == max_ranks:  # one redundant slot per rank, planned for a load rising with the expert id
            placements.append((f" +EPLB N={r}", eplb.plan_placement(np.arange(1.0, experts + 1) ** 2, r, r)))
        x_placed = jax.device_put(x, NamedSharding(mesh, P("ep")))
        for suffix, placement in placements:
            placed = ep.shard_params(params, cfg, mesh, placement=placement)
            tables = None if placement is None else ep.placement_tables(placement, mesh)
            for name, kw in modes:
                call = functools.partial(ep.ep_moe_layer, placed, x_placed, cfg, mesh, return_stats=True,
                                         placement=tables, **kw)
                try:
                    first, steady = timed(call, repeats)
                except jax.errors.JaxRuntimeError as err:
                    rows.append(dict(ranks=r, mode=name + suffix, runnable=False, error=str(err).splitlines()[0][:160]))
                    continue
                stats = jax.tree.map(np.asarray, call()[1])
                rows.append(dict(ranks=r, mode=name + suffix, first_s=first, ms=steady * 1e3, vs_single=steady / base,
                                 vs_min=float(stats["bytes_ratio"]), dropped_pairs=int(stats["dropped_pairs"]),
                                 balancedness=float(stats["balancedness"])))
    return rows


def deepseek_v3_nvlink(tokens_per_rank: int, ranks: int = 8):
    """Analytic bytes per rank per layer for DeepSeek-V3 on `ranks` GPUs, bf16 rows, uniform
    routing (a rank gets back as many rows as it sends; its own 1/R never leaves HBM)."""
    experts, topk, groups_kept = 256, 8, 4
    local = experts // ranks
    pairs = tokens_per_rank * topk
    ranks_hit = ranks * (1 - math.comb(experts - local, topk) / math.comb(experts, topk))
    cases = (  # (mode, rows sent each way, receive buffer rows)
        ("one row per (token, expert) pair (before)", pairs, ranks * tokens_per_rank * min(topk, local)),
        ("one row per (token, rank), uniform: ragged", ranks_hit * tokens_per_rank, ranks * tokens_per_rank),
        ("one row per (token, rank), <= 4 groups: ragged", groups_kept * tokens_per_rank, ranks * tokens_per_rank),
        ("capacity, dropless (C = T/R)", ranks * tokens_per_rank, ranks * tokens_per_rank),
    )
    out = []
    for mode, rows_each_way, recv_rows in cases:
        each_way = rows_each_way * V3_ROW_BYTES
        remote = each_way * (ranks - 1) / ranks
        out.append(dict(tokens_per_rank=tokens_per_rank, mode=mode, rows_each_way=rows_each_way,
                        mb_each_way=each_way / 1e6, vs_pairs=rows_each_way / pairs,
                        us_dispatch_plus_combine_at_450=2 * remote / NVLINK_BYTES_PER_S * 1e6,
                        recv_buffer_gb=recv_rows * V3_ROW_BYTES / 1e9))
    return out


PARTS = ("bytes", "skew", "time", "analytic")
QUICK_OUT = pathlib.Path("/tmp/expertd-ep-quick.json")  # quick runs never overwrite the recorded results


def goals(bytes_rows, skew_rows):
    """The issue's goals, checked on this run's numbers: [(goal, value, met)]."""
    out = []
    ragged_rows = [row["vs_min"] for row in bytes_rows if row["mode"] == "ragged"]
    if ragged_rows:
        out.append(("ragged bytes_sent / min_rank_bytes <= 1.05", max(ragged_rows), max(ragged_rows) <= 1.05))
    by_name = {row["placement"].split(" =")[0]: row for row in skew_rows}
    if skew_rows:
        plain = by_name["plain layout"]["measured_max_over_mean"]
        out.append(("plain layout max / mean rank load ~2 (1.8 .. 2.2)", plain, 1.8 <= plain <= 2.2))
        with_eplb = skew_rows[-1]["measured_max_over_mean"]
        out.append((f"{skew_rows[-1]['placement']}: max / mean rank load <= 1.15", with_eplb, with_eplb <= 1.15))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes: check that the script runs (writes {QUICK_OUT} unless --out)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)} (bytes and skew are exact counts, "
                             "valid on a loaded machine; time is not)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None, help=f"result JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; expected a subset of {list(PARTS)}")
    out_path = args.out or (QUICK_OUT if args.quick else RESULTS)
    max_ranks = min(8, len(jax.devices()))
    if args.quick:
        sizes = dict(bytes_tokens=(16,), skew_tokens=64, hidden=32, time=(256, 32, 4, 64, 32), repeats=1)
    else:
        sizes = dict(bytes_tokens=(128, 512), skew_tokens=1024, hidden=64, time=(1024, 32, 4, 512, 256),
                     repeats=args.repeats)
    bytes_rows = [row for t in sizes["bytes_tokens"] for row in measure_bytes(t, max_ranks, sizes["hidden"])] \
        if "bytes" in parts else []
    skew_rows = measure_skew(sizes["skew_tokens"], max_ranks, sizes["hidden"]) if "skew" in parts else []
    t, e, k, h, i = sizes["time"]
    time_rows = measure_time(t, e, k, h, i, sizes["repeats"], max_ranks) if "time" in parts else []
    analytic = deepseek_v3_nvlink(128) + deepseek_v3_nvlink(4096) if "analytic" in parts else []

    print(f"expert parallelism, {machine.describe()}, {max_ranks} ranks" + (" (quick sizes)" if args.quick else ""))
    if bytes_rows:
        print_table("bytes: DeepSeek-V3 routing, measured rows (x 14,336 B at H=7168 bf16)", bytes_rows,
                    ["tokens_per_rank", "routing", "mode", "vs_min", "vs_pairs", "min_vs_pairs", "dropped_pairs",
                     "mb_per_rank_at_v3", "meta_share"])
    if skew_rows:
        print_table("skew: Zipf-like popularity, placement planned on one batch, measured on another", skew_rows,
                    ["placement", "expert_max_over_mean", "planned_max_over_mean", "measured_max_over_mean",
                     "max_replicas", "ranks_hit_per_token"])
    if time_rows:
        print_table(f"time: T={t} E={e} k={k} H={h} I={i} bf16, random routing", time_rows,
                    ["ranks", "mode", "ms", "vs_single", "first_s", "vs_min", "dropped_pairs", "balancedness"])
        for row in time_rows:
            if row.get("runnable") is False:
                print(f"  ranks={row['ranks']} {row['mode']}: not runnable here: {row['error']}")
    if analytic:
        print_table("DeepSeek-V3 on 8 NVLink GPUs, per rank per layer, bf16 (analytic)", analytic,
                    ["tokens_per_rank", "mode", "mb_each_way", "vs_pairs", "us_dispatch_plus_combine_at_450",
                     "recv_buffer_gb"])
    checked = goals(bytes_rows, skew_rows)
    if checked:
        print("\ngoals" + (" (quick sizes: too few tokens per expert to judge the skew goals)" if args.quick else ""))
        for goal, value, met in checked:
            print(f"  {'met' if met else 'NOT met'}: {goal} (got {value:.4g})")
    print()
    results.write_json(out_path, dict(
        benchmark="ep", date=machine.today(), machine=machine.describe(), ranks=max_ranks,
        quick=args.quick, parts=parts, load_average=os.getloadavg(), sizes=sizes, bytes=bytes_rows, skew=skew_rows,
        time=time_rows, deepseek_v3_nvlink=analytic,
        goals=[dict(goal=g, value=v, met=m) for g, v, m in checked]))

if __name__ == "__main__":
    main()
