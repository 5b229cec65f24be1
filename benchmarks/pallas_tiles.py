"""The Pallas grouped GEMM's tilings on a GPU: which tile sizes and Triton launch parameters are fastest
per shape (meant for a lent GPU; `bash benchmarks/gpu_session.sh tiles`).

For each layer shape (E, k, H, I) and tokens T, the routed rows (T*k, bf16, expert sizes from a
random routing) go through `experts.pallas.grouped_ffn_pallas` under every tiling of the grid:
rows per tile `block_m`, and `PallasTiles` (column tile `block_n`, contraction step `block_k`,
`num_warps`, `num_stages`). Each tiling's output is checked against the default tiling's (bf16
tolerance, every row); its median time per call is reported with its active TFLOP/s
(2 * 3 * T * k * H * I per call), its ratio to the default tiling's time and, as the target
(issue 3: >= 60 % at T=4096), its fraction of the dense bf16 matmul rate measured in the same run
(8192^3, random data). `ragged_dot` (XLA's grouped GEMM) is timed beside as the other backend.

    python3 benchmarks/pallas_tiles.py [--quick] [--tokens 4096 256] [--out FILE]
    python3 benchmarks/pallas_tiles.py --smoke     # tiny shape, interpret mode: the script runs (CPU)
    python3 benchmarks/pallas_tiles.py --confirm 64,256,64,8,3 128,128,64,8,4 --rounds 5 --tokens 4096 1024

--confirm times the named tilings (block_m,block_n,block_k,num_warps,num_stages) and the default in
alternation, --rounds times, and reports each one's time over the default's in the same round (the
range over rounds): a sweep's winner is adopted only where that range stays below one.

Prints one table per case (fastest first) and writes benchmarks/results/pallas_tiles.json (or
--out) with every timing and the fastest tiling per case.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import experts
from expertd.kernels.experts.pallas import PallasTiles, default_tiles, gpu_compute_capability, grouped_ffn_pallas
from expertd.kernels.moe_reference import tolerance

RESULTS = os.path.join(harness.RESULTS, "pallas_tiles.json")
SHAPES = harness.LAYER_SHAPES  # (E, k, H, I), as moe_layer.py
TOKENS = (4096, 256)
LAUNCH = ((4, 2), (4, 3), (8, 3), (8, 4))  # (num_warps, num_stages)
BF16_TOLERANCE = tolerance(jnp.bfloat16)  # of the output's scale (kernels/moe_reference.py)


def tilings(rows_per_expert: float, quick: bool) -> list[tuple[int, PallasTiles]]:
    """(block_m, PallasTiles) to try: row tiles around the rows each expert gets."""
    block_ms = (16, 32, 64) if rows_per_expert < 64 else (64, 128)
    block_ns, block_ks = ((128, 256), (64, 128)) if not quick else ((128,), (64,))
    launch = LAUNCH if not quick else LAUNCH[::3]
    return [(m, PallasTiles(block_n=n, block_k=kk, num_warps=w, num_stages=s))
            for m, n, kk, (w, s) in itertools.product(block_ms, block_ns, block_ks, launch)]


def case_inputs(e, k, h, i, t, seed=0):
    """Routed rows [T*k, H] bf16 grouped by expert, their group sizes [E] (a random top-k routing of
    T tokens) and the expert weights."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]  # k distinct experts per token
    sizes = np.bincount(ids.ravel(), minlength=e).astype(np.int32)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]), jnp.bfloat16)
    xs = jnp.asarray(rng.standard_normal((t * k, h), np.float32), jnp.bfloat16)
    return xs, jnp.asarray(sizes), w(e, h, i), w(e, h, i), w(e, i, h)


def median_seconds(fn, args, reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn(*args)`` after a warm-up call."""
    return harness.time_calls(lambda: jax.block_until_ready(fn(*args)), min_calls=reps).median


def tiled_ffn(block_m, tiles, interpret):
    """`grouped_ffn_pallas` jitted at one tiling (None, None: the layer's own choice)."""
    return jax.jit(lambda *a: grouped_ffn_pallas(*a, block_m=block_m, tiles=tiles, interpret=interpret))


def error_per_scale(out, reference) -> float:
    """The largest difference from `reference` (the default tiling's output) over its scale."""
    reference = np.asarray(reference, np.float32)
    return float(np.abs(np.asarray(out, np.float32) - reference).max()) / (float(np.abs(reference).max()) or 1.0)


def parse_tiling(spec: str) -> tuple[int, PallasTiles]:
    """'block_m,block_n,block_k,num_warps,num_stages' -> (block_m, PallasTiles)."""
    try:
        m, n, kk, w, st = (int(v) for v in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a tiling is block_m,block_n,block_k,num_warps,num_stages, got {spec!r}") from None
    return m, PallasTiles(block_n=n, block_k=kk, num_warps=w, num_stages=st)


def confirm_case(e, k, h, i, family, t, candidates, rounds, reps, interpret):
    """The default tiling and `candidates` timed in alternation: per candidate its time over the
    default's in each round."""
    args = case_inputs(e, k, h, i, t)
    flops = 2 * 3 * t * k * h * i
    fns = {"default": tiled_ffn(None, None, interpret)}
    for block_m, tiles in candidates:
        name = f"{block_m},{tiles.block_n},{tiles.block_k},{tiles.num_warps},{tiles.num_stages}"
        fns[name] = tiled_ffn(block_m, tiles, interpret)
    reference = fns["default"](*args)
    errors = {name: error_per_scale(fn(*args), reference) for name, fn in fns.items()}
    seconds = {name: [] for name in fns}
    for r in range(rounds):
        for name in harness.order(fns, r):
            seconds[name].append(median_seconds(fns[name], args, reps))
    rows = [dict(tiling=name, seconds=seconds[name], err_per_scale=errors[name],
                 tflop_per_s=flops / statistics.median(seconds[name]) / 1e12,
                 ratio_to_default=harness.ratios(seconds[name], seconds["default"])) for name in fns]
    return dict(family=family, E=e, k=k, H=h, I=i, T=t, rounds=rounds, rows=rows)


def print_confirm(case) -> None:
    print(f"\n{case['family']} E={case['E']} k={case['k']} T={case['T']}, {case['rounds']} rounds alternating")
    print(f"{'tiling':>18} {'ms (median)':>11} {'TFLOP/s':>8} {'x default (range)':>18} {'err':>8}")
    for r in case["rows"]:
        ratios = r["ratio_to_default"]
        print(f"{r['tiling']:>18} {statistics.median(r['seconds']) * 1e3:>11.3f} {r['tflop_per_s']:>8.1f} "
              f"{min(ratios):>8.2f}-{max(ratios):<9.2f} {r['err_per_scale']:>8.1e}")


def run_case(e, k, h, i, family, t, quick, reps, interpret, dense_rate):
    args = case_inputs(e, k, h, i, t)
    flops = 2 * 3 * t * k * h * i
    default = tiled_ffn(None, None, interpret)
    reference = default(*args)
    base_s = median_seconds(default, args, reps)
    rows = []
    for block_m, tiles in tilings(t * k / e, quick):
        fn = tiled_ffn(block_m, tiles, interpret)
        row = dict(block_m=block_m, **{f: getattr(tiles, f) for f in ("block_n", "block_k", "num_warps", "num_stages")})
        try:
            row["err_per_scale"] = error_per_scale(fn(*args), reference)
            row["seconds"] = median_seconds(fn, args, reps)
        except Exception as err:  # a tiling this GPU cannot run (shared memory, registers): recorded
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    ragged = jax.jit(lambda *a: experts.grouped_ffn(*a, backend="ragged_dot"))
    ragged_s = median_seconds(ragged, args, reps)
    ok = [r for r in rows if "seconds" in r and r["err_per_scale"] <= BF16_TOLERANCE]
    best = min(ok, key=lambda r: r["seconds"]) if ok else None
    return dict(family=family, E=e, k=k, H=h, I=i, T=t, active_tflop=flops / 1e12, default_s=base_s,
                ragged_dot_s=ragged_s, dense_rate_flops_per_s=dense_rate, tilings=rows, best=best,
                wrong=[r for r in rows if r.get("err_per_scale", 0.0) > BF16_TOLERANCE])


def print_case(case) -> None:
    flops = case["active_tflop"] * 1e12
    rate = case["dense_rate_flops_per_s"]
    frac = (lambda s: f"{flops / s / rate:6.1%}") if rate else (lambda s: "     -")
    print(f"\n{case['family']} E={case['E']} k={case['k']} H={case['H']} I={case['I']} T={case['T']}: default "
          f"{case['default_s'] * 1e3:.3f} ms ({frac(case['default_s'])} of dense), ragged_dot "
          f"{case['ragged_dot_s'] * 1e3:.3f} ms")
    print(f"{'block_m':>7} {'block_n':>7} {'block_k':>7} {'warps':>5} {'stages':>6} {'ms':>8} {'TFLOP/s':>8} "
          f"{'of dense':>8} {'x default':>9} {'err':>8}")
    timed = sorted((r for r in case["tilings"] if "seconds" in r), key=lambda r: r["seconds"])
    for r in timed + [r for r in case["tilings"] if "seconds" not in r]:
        if "seconds" not in r:
            print(f"{r['block_m']:>7} {r['block_n']:>7} {r['block_k']:>7} {r['num_warps']:>5} {r['num_stages']:>6} "
                  f"  failed: {r['error'][:60]}")
            continue
        s = r["seconds"]
        print(f"{r['block_m']:>7} {r['block_n']:>7} {r['block_k']:>7} {r['num_warps']:>5} {r['num_stages']:>6} "
              f"{s * 1e3:>8.3f} {flops / s / 1e12:>8.1f} {frac(s):>8} {s / case['default_s']:>9.2f} "
              f"{r['err_per_scale']:>8.1e}")
    if case["wrong"]:
        print(f"  {len(case['wrong'])} tilings out of tolerance: a bug to look at, not a speed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--quick", action="store_true", help="4-8 tilings per case instead of 32-48")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape in interpret mode (runs on CPU)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per tiling (median)")
    parser.add_argument("--confirm", type=parse_tiling, nargs="+", default=None, metavar="M,N,K,WARPS,STAGES",
                        help="time these tilings against the default in alternation instead of the sweep")
    parser.add_argument("--rounds", type=int, default=5, help="--confirm: alternating rounds")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.smoke):
        raise SystemExit("pallas_tiles.py times compiled kernels: run it on a GPU (or --smoke here)")
    shapes, tokens = (((4, 2, 64, 128, "smoke"),), (32,)) if args.smoke else (SHAPES, tuple(args.tokens))
    reps = 2 if args.smoke else args.reps
    dense_rate = harness.dense_matmul_rate() if on_gpu else None
    print(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}"
          + (f"; dense bf16 {dense_rate / 1e12:.0f} TFLOP/s" if dense_rate else "")
          + f"; default bf16 tiles at block_m 64: {default_tiles(64, 2, gpu_compute_capability())}")
    cases = []
    if args.confirm:
        for (e, k, h, i, family), t in itertools.product(shapes, tokens):
            cases.append(confirm_case(e, k, h, i, family, t, args.confirm, args.rounds, reps, not on_gpu))
            print_confirm(cases[-1])
            sys.stdout.flush()
        harness.write_results(args.out, "pallas_tiles_confirm", cases, complete=True)
        return 1 if any(r["err_per_scale"] > BF16_TOLERANCE for c in cases for r in c["rows"]) else 0
    for (e, k, h, i, family), t in itertools.product(shapes, tokens):
        cases.append(run_case(e, k, h, i, family, t, args.quick or args.smoke, reps, not on_gpu, dense_rate))
        print_case(cases[-1])
        sys.stdout.flush()
        harness.write_results(args.out, "pallas_tiles", cases, complete=False)
    harness.write_results(args.out, "pallas_tiles", cases, complete=True)
    return 1 if any(c["wrong"] for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
