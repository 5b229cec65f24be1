"""Where a small-batch MoE layer call waits: the native kernels' ParallelFor calls, timed from inside.

Builds the native CPU library's trace build (`cpu.BuildOptions(trace=True)`, its own build, see
kernels/cpu/csrc/parallel.h) and runs, interleaved in rounds, three programs on the served weights
(`moe.prepare_params`, huge pages, as `benchmarks/moe_layer.py` serves them):
  layer    the served MoE layer (router, layout, gate / up / down, SwiGLU, combine)
  ffn      its grouped FFN alone (gate, up, SwiGLU, down) on a fixed routing
  kernels  the three grouped matmuls alone (gate + up added, no SwiGLU)
For each: the median wall time per call, and per ParallelFor call in program order its median
duration (start to the last task's end), the median gap to the next ParallelFor call (for the last
one: to the next program call, through Python and dispatch), when the helper joined, how far apart
caller and helper finished, and how long the caller took to return after a helper finished last.

    .venv/bin/python benchmarks/parallel_for_trace.py [--experts 8 64] [--tokens 16] [--calls 200]
        [--sync-dispatch]

Prints a table; JSON in benchmarks/results/parallel_for_trace.json.
"""
from __future__ import annotations

import argparse
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu, moe
from expertd.kernels.cpu import diagnostics

SHAPES = {shape[0]: shape for shape in harness.LAYER_SHAPES}  # by E
CALLS_PER_ROUND = 20


def programs(cfg, served, x):
    """{name: zero-argument call} for the layer, its FFN alone and its three matmuls alone."""
    layer = jax.jit(lambda p, x: moe.moe_layer(p, x, cfg, backend="native_cpu"))
    ids, _ = moe.route(served, x, cfg)
    perm = cpu.layout(jnp.maximum(ids, 0), cfg.num_experts)
    gs, src = perm.group_sizes, perm.token_of_row
    w = (served.w_gate, served.w_up, served.w_down)
    ffn = jax.jit(lambda x, gs, src, w: cpu.grouped_ffn(x, gs, *w, source=src))

    @jax.jit
    def kernels(x, gs, src, w):
        x32 = x.astype(jnp.float32)
        gate = cpu.grouped_matmul(x32, gs, w[0], source=src)
        up = cpu.grouped_matmul(x32, gs, w[1], source=src)
        return cpu.grouped_matmul(gate + up, gs, w[2])

    return {"layer": lambda: layer(served, x), "ffn": lambda: ffn(x, gs, src, w),
            "kernels": lambda: kernels(x, gs, src, w)}


def run_rounds(calls: dict, total_calls: int) -> dict:
    """Each program CALLS_PER_ROUND times per round, programs interleaved: {name: (wall seconds
    per call, trace records)}."""
    for call in calls.values():
        jax.block_until_ready(call())
    diagnostics.parallel_for_trace()
    walls, records = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(max(1, total_calls // CALLS_PER_ROUND)):
        for name, call in calls.items():
            for _ in range(CALLS_PER_ROUND):
                start = time.perf_counter()
                jax.block_until_ready(call())
                walls[name].append(time.perf_counter() - start)
            records[name].append(diagnostics.parallel_for_trace())
    return {name: (np.array(walls[name]), np.concatenate(records[name])) for name in calls}


def summarize(wall: np.ndarray, records: np.ndarray) -> dict:
    """Medians (µs) per ParallelFor position in a program call; see the module docstring."""
    f = {name: records[:, i].astype(float) for i, name in enumerate(diagnostics.TRACE_FIELDS)}
    per_call = len(records) // len(wall)
    end = np.maximum(f["caller_done"], f["helper_done"])
    nan = np.full(len(records), np.nan)
    helper_last = f["helper_done"] > f["caller_done"]

    def by_position(values):  # NaN: not applicable to that record
        return [round(float(np.nanmedian(values[pos::per_call])) * 1e-3, 1)
                if np.isfinite(values[pos::per_call]).any() else None for pos in range(per_call)]

    return {"ms_per_call": float(np.median(wall)) * 1e3, "parallel_for_per_call": per_call,
            "tasks": [int(np.median(f["tasks"][pos::per_call])) for pos in range(per_call)],
            "duration_us": by_position(end - f["start"]),
            "gap_after_us": by_position(np.append(f["start"][1:] - end[:-1], np.nan)),
            "helper_join_us": by_position(np.where(f["helper_start"] > 0, f["helper_start"] - f["start"], nan)),
            "finish_apart_us": by_position(np.where(f["helper_done"] > 0,
                                                    np.abs(f["helper_done"] - f["caller_done"]), nan)),
            "return_after_helper_us": by_position(np.where(helper_last, f["returned"] - f["helper_done"], nan)),
            "helper_last_share": float(helper_last.mean())}


def print_rows(rows):
    print(f"{'E':>3} {'dtype':>8} {'program':>8} {'ms':>6}  per ParallelFor call (µs, medians): "
          "duration | gap after | helper join | finish apart | return after helper")
    for row in rows:
        s = row["summary"]
        print(f"{row['E']:>3} {row['dtype']:>8} {row['program']:>8} {s['ms_per_call']:6.3f}  "
              f"{s['duration_us']} | {s['gap_after_us']} | {s['helper_join_us']} | "
              f"{s['finish_apart_us']} | {s['return_after_helper_us']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="*", default=[8, 64], choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200, help="calls of each program")
    parser.add_argument("--sync-dispatch", action="store_true",
                        help="jax_cpu_enable_async_dispatch=False: run each call on the calling thread")
    parser.add_argument("--out", default=str(harness.RESULTS / "parallel_for_trace.json"))
    args = parser.parse_args(argv)
    if args.sync_dispatch:  # read when the CPU client is made, so before the first computation
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    cpu.configure(cpu.BuildOptions(trace=True))  # before the library is first built / loaded
    if not cpu.available():
        sys.exit(f"the native CPU kernel is unavailable: {cpu.unavailable_reason()}")
    rows = []
    for e in args.experts:
        for dtype_name in args.dtypes:
            cfg, _, served, backend, x = harness.served_case(*SHAPES[e], args.tokens, jnp.dtype(dtype_name))
            if backend != "native_cpu":
                print(f"E={e} {dtype_name} T={args.tokens}: auto runs {backend}, not the native kernel; skipped")
                continue
            for name, (wall, records) in run_rounds(programs(cfg, served, x), args.calls).items():
                rows.append({"E": e, "T": args.tokens, "dtype": dtype_name, "program": name,
                             "summary": summarize(wall, records)})
    print_rows(rows)
    bandwidth = harness.copy_bandwidth()
    print(f"copy bandwidth after the run: {bandwidth / 1e9:.1f} GB/s")
    harness.write_results(args.out, "parallel_for_trace", rows, copy_bandwidth_after=bandwidth,
                            isa=cpu.isa(), async_dispatch=not args.sync_dispatch)


if __name__ == "__main__":
    main()
