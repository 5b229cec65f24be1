"""Expert-parallel MoE layer: time per layer and bytes on the wire, R in {1, 2, 4, 8} simulated CPU
devices, plus what a real 8-GPU NVLink node would move for DeepSeek-V3 shapes.

Measured (CPU, one process, R simulated devices sharing the machine's cores):
  single     `moe.moe_layer` on one device: the baseline of the same run
  capacity   dense all_to_all, dropless worst-case capacity (the CPU default)
  cap f=1    capacity_factor=1.0 (the balanced share; may drop pairs, counted)
  ragged     jax.lax.ragged_all_to_all: compiled for real to show whether this platform can run it
  ragged-emu the ragged code path through `ragged.ragged_all_to_all_emulated`: same offsets, same
             stats (bytes = routed rows); its time is NOT the real op's (the emulation moves dense
             worst-case blocks)
Bytes are per layer call: dispatch + combine payload of all ranks plus the int32 count all_gather;
"ratio" = bytes / minimum (routed rows only, both directions).

Analytic (no device needed): DeepSeek-V3 (H 7168, E 256, k 8) on 8 ranks, bf16 dispatch and
combine, uniform routing: bytes per rank per layer for both modes and the time at 450 GB/s per
direction per GPU (H100 / H200 NVLink 4).

Run: `flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/ep.py` (writes benchmarks/results/ep.json).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from router import machine  # noqa: E402  (benchmarks/router.py: one machine description for all)

from expertd.kernels import ep, moe, ragged  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ep.json"
NVLINK_BYTES_PER_S = 450e9  # H100 / H200 SXM: 900 GB/s total = 450 GB/s per direction per GPU


def timed(fn, repeats: int):
    """(first call seconds incl. compile, median steady seconds) of fn() -> jax value."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return first, statistics.median(samples)


def measure(cfg, params, x, repeats: int):
    rows = []
    single = jax.jit(moe.moe_layer, static_argnames="cfg")
    x_dev = jnp.asarray(x)
    first, base = timed(lambda: single(params, x_dev, cfg), repeats)
    rows.append(dict(ranks=1, mode="single", first_s=first, ms=base * 1e3, vs_single=1.0))
    modes = (
        ("capacity", dict(dispatch="capacity")),
        ("cap f=1", dict(dispatch="capacity", capacity_factor=1.0)),
        ("ragged", dict(dispatch="ragged", ragged_all_to_all=jax.lax.ragged_all_to_all)),
        ("ragged-emu", dict(dispatch="ragged", ragged_all_to_all=ragged.ragged_all_to_all_emulated)),
    )
    for r in (1, 2, 4, 8):
        mesh = jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])
        placed = ep.shard_params(params, cfg, mesh)
        x_placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep")))
        for name, kw in modes:
            call = functools.partial(ep.ep_moe_layer, placed, x_placed, cfg, mesh, return_stats=True, **kw)
            try:
                first, steady = timed(call, repeats)
            except jax.errors.JaxRuntimeError as err:
                rows.append(dict(ranks=r, mode=name, runnable=False, error=str(err).splitlines()[0][:160]))
                continue
            _, stats = call()
            stats = jax.tree.map(np.asarray, stats)
            rows.append(dict(
                ranks=r, mode=name, first_s=first, ms=steady * 1e3, vs_single=steady / base,
                bytes_sent=float(stats["bytes_sent"].sum()), min_bytes=float(stats["min_bytes"].sum()),
                ratio=float(stats["bytes_ratio"]), dropped_pairs=int(stats["dropped_pairs"]),
                max_rows_per_rank=int(stats["rows_received"].max())))
    return rows


def deepseek_v3_nvlink(tokens_per_rank: int, ranks: int = 8):
    """Analytic bytes per rank per layer for DeepSeek-V3 shapes on `ranks` GPUs, bf16 rows.

    Uniform routing, so a rank gets back as many rows as it sends. The rank's own block never
    leaves HBM, so the NVLink time counts (R-1)/R of the rows. Rows are (token, expert) pairs; the
    two "1 row per rank" lines are a design we do not implement (DeepEP normal mode: a token goes
    once to each rank it hits, the receiver fans it out to its experts), for comparison.
    """
    hidden, experts, topk, groups_kept = 7168, 256, 8, 4
    row = hidden * 2
    local = experts // ranks
    pairs = tokens_per_rank * topk
    meta = ranks * experts * 4  # the int32 [R, E] count all_gather
    worst = ragged.worst_case_rows(tokens_per_rank, topk, local)  # per destination
    cap_f1 = ragged.capacity_rows(tokens_per_rank, topk, experts, ranks, 1.0)
    # Ranks hit by k distinct experts drawn uniformly (E/R per rank), and DeepSeek-V3's
    # group-limited routing (8 groups = the 8 ranks' expert blocks, 4 kept: at most 4 ranks).
    ranks_hit = ranks * (1 - math.comb(experts - local, topk) / math.comb(experts, topk))
    cases = (  # (mode, rows sent each way, receive buffer rows)
        ("ragged (ours)", pairs, ranks * worst),
        ("capacity, dropless (ours)", ranks * worst, ranks * worst),
        ("capacity f=1 (ours, drops)", ranks * cap_f1, ranks * cap_f1),
        ("1 row per rank hit, uniform", ranks_hit * tokens_per_rank, ranks * tokens_per_rank),
        ("1 row per rank hit, <=4 groups", groups_kept * tokens_per_rank, ranks * tokens_per_rank),
    )
    out = []
    for mode, rows_each_way, recv_rows in cases:
        each_way = rows_each_way * row
        remote = each_way * (ranks - 1) / ranks
        out.append(dict(
            tokens_per_rank=tokens_per_rank, mode=mode, rows_each_way=rows_each_way,
            mb_each_way=each_way / 1e6, mb_remote_each_way=remote / 1e6,
            ratio=(2 * each_way + meta) / (2 * pairs * row),
            us_each_way_at_450=remote / NVLINK_BYTES_PER_S * 1e6,
            us_dispatch_plus_combine_at_450=2 * remote / NVLINK_BYTES_PER_S * 1e6,
            recv_buffer_gb=recv_rows * row / 1e9))
    return out


def print_table(title, rows, columns):
    print(f"\n{title}")
    widths = [max([len(c)] + [len(str(r.get(c, ""))) for r in rows if isinstance(r.get(c), str)]) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        cells = []
        for c, w in zip(columns, widths):
            v = row.get(c, "-")
            if isinstance(v, float):
                text = f"{v:.4f}" if c == "ratio" else f"{v:.4g}"
            else:
                text = str(v)
            cells.append(text.rjust(w))
        print("  ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="global tokens per layer call")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)

    cfg = moe.MoEConfig(num_experts=args.experts, topk=args.topk, hidden_size=args.hidden,
                        intermediate_size=args.intermediate)
    params = jax.tree.map(np.asarray, moe.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    x = np.asarray(jax.random.normal(jax.random.key(1), (args.tokens, args.hidden), jnp.float32).astype(jnp.bfloat16))
    rows = measure(cfg, params, x, args.repeats)
    analytic = deepseek_v3_nvlink(128) + deepseek_v3_nvlink(4096)

    print(f"expert parallelism, {machine()}")
    print(f"T={args.tokens} E={args.experts} k={args.topk} H={args.hidden} I={args.intermediate} bf16, random routing")
    print_table("CPU, simulated devices (ratio = bytes on the wire / routed rows only)", rows,
                ["ranks", "mode", "ms", "vs_single", "first_s", "ratio", "dropped_pairs", "max_rows_per_rank"])
    for row in rows:
        if row.get("runnable") is False:
            print(f"  ranks={row['ranks']} {row['mode']}: not runnable here: {row['error']}")
    print_table("DeepSeek-V3 on 8 NVLink GPUs, per rank per layer, bf16 (analytic)", analytic,
                ["tokens_per_rank", "mode", "mb_each_way", "ratio", "us_each_way_at_450", "recv_buffer_gb"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="ep", date=datetime.date.today().isoformat(), machine=machine(),
        config=dict(tokens=args.tokens, experts=args.experts, topk=args.topk, hidden=args.hidden,
                    intermediate=args.intermediate, dtype="bfloat16", repeats=args.repeats),
        cpu=rows, deepseek_v3_nvlink=analytic), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
