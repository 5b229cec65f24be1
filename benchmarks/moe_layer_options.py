"""moe_layer.py --options-ab: are the CPU rules in `moe.compiler_options` and `experts.choose_backend`
right on this machine?

The layer ("expert_loop") compiled with the default options and with YNNPACK off
(cpu.policy.SMALL_ROWS_CPU_OPTIONS), and "auto" as the server compiles and serves it
(experts.choose_backend picks "native_cpu" where its C++ kernel builds, else "capacity" for fp32
weights with few rows per large expert), calls interleaved, at T in AB_TOKENS; `--experts 128` adds
Qwen3-30B-A3B's layer shape. moe_layer.py writes the rows to benchmarks/results/moe_layer_options_ab.json.
Run it as `moe_layer.py --options-ab [--tokens ...] [--experts ...] [--dtypes ...]`; this module is
its part.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import harness
import jax
import jax.numpy as jnp

from expertd.kernels import experts, moe
from expertd.kernels.cpu import policy as cpu_policy

AB_RESULTS = os.path.join(harness.RESULTS, "moe_layer_options_ab.json")
AB_TOKENS = (1, 4, 16, 64, 128, 256)
# with --experts 128: Qwen3-30B-A3B's layer shape (6 MiB fp32 expert matrices)
AB_EXTRA_SHAPES = ((128, 8, 2048, 768, "qwen3_moe"),)


def options_ab(e, k, h, i, family, t, dtype_name, reps=9):
    """One A/B row, calls interleaved (alternating the order), medians: the layer's "expert_loop"
    compiled with default options and with YNNPACK off, and "auto" compiled as the server does
    (backend by `experts.choose_backend`, options by `moe.compiler_options`, on `moe.prepare_params`)."""
    dtype = jnp.dtype(dtype_name)
    cfg, params, served, _, x = harness.served_case(e, k, h, i, family, t, dtype)
    no_ynn = cpu_policy.small_rows_cpu_options() or None
    variants = {"default": ("expert_loop", None), "no_ynn": ("expert_loop", no_ynn),
                "auto": ("auto", moe.compiler_options(cfg, t, dtype=dtype) or None)}
    fns = {name: jax.jit(lambda p, v, b=backend: moe.moe_layer(p, v, cfg, backend=b), compiler_options=opts)
           for name, (backend, opts) in variants.items()}
    args = {name: served if name == "auto" else params for name in fns}  # auto as served
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        jax.block_until_ready(fn(args[name], x))
    for rep in range(reps):
        for name in harness.order(fns, rep + 1):  # reversed first: the warm-up ran them in order
            start = time.perf_counter()
            jax.block_until_ready(fns[name](args[name], x))
            times[name].append(time.perf_counter() - start)
    default_s, no_ynn_s, auto_s = (statistics.median(times[n]) for n in ("default", "no_ynn", "auto"))
    rule_picks_no_ynn = bool(moe.compiler_options(cfg, t, dtype=dtype, backend="expert_loop"))
    loop_s = no_ynn_s if rule_picks_no_ynn else default_s  # expert_loop as auto compiled it before the backend rule
    return dict(E=e, k=k, H=h, I=i, T=t, dtype=dtype_name, rows_per_expert=t * k / e, default_s=default_s,
                no_ynn_s=no_ynn_s, speedup=default_s / no_ynn_s, rule_picks_no_ynn=rule_picks_no_ynn,
                auto_backend=experts.choose_backend(t * k, e, h, i, dtype), auto_s=auto_s,
                auto_vs_expert_loop=loop_s / auto_s)


def run(args):
    """--options-ab: are the rules in experts.compiler_options / choose_backend right on this machine?"""
    if not cpu_policy.small_rows_cpu_options():
        sys.exit("this jaxlib does not accept cpu.policy.SMALL_ROWS_CPU_OPTIONS; nothing to compare")
    print(f"{'E':>3} {'T':>5} {'dtype':>8} {'rows/E':>7} {'default ms':>10} {'no-ynn ms':>9} {'speedup':>7} "
          f"{'rule':>7} {'auto ms':>8} {'auto backend':>12} {'vs loop':>7}")
    rows = []
    shapes = harness.LAYER_SHAPES + AB_EXTRA_SHAPES
    for (e, k, h, i, family), dtype_name, t in harness.selected_cases(args, shapes, AB_TOKENS):
        r = options_ab(e, k, h, i, family, t, dtype_name)
        rows.append(r)
        print(f"{e:>3} {t:>5} {dtype_name:>8} {r['rows_per_expert']:>7.1f} {r['default_s'] * 1e3:>10.1f} "
              f"{r['no_ynn_s'] * 1e3:>9.1f} {r['speedup']:>7.2f} "
              f"{'no-ynn' if r['rule_picks_no_ynn'] else 'default':>7} "
              f"{r['auto_s'] * 1e3:>8.1f} {r['auto_backend']:>12} {r['auto_vs_expert_loop']:>7.2f}")
        sys.stdout.flush()
    return rows


if __name__ == "__main__":  # `make bench` runs every script in benchmarks/ without arguments
    print("moe_layer_options.py is moe_layer.py --options-ab's part; run that")
