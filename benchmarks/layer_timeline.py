"""Where one MoE layer call's time goes: the served layer traced with jax.profiler, per op.

For each selected case (default: T=16, both shapes of `moe_layer.py`, bf16 and fp32) the layer
runs as the engine serves it (`auto` on `moe.prepare_params`'s params, `moe.compiler_options`), is
warmed up, and is called CALLS times back to back under `jax.profiler`. The trace's complete
events on XLA's threads are summed per op name and divided by the calls; the call period (wall
clock per call, block_until_ready included) is split into

  custom calls:  XLA custom calls (`ffi_call.*`: expertd's C++ kernels on CPU: the three grouped
                 matmuls, the layout and the combine)
  other ops:     every other XLA op (fusions, converts, the router's dot, top-k)
  rest:          the period minus both: Python and PJRT dispatch, the hand-off to XLA's threads
                 and the wait for the result

Prints a table per case and writes benchmarks/results/layer_timeline.json. Written for
XLA:CPU's trace, whose op events run on threads named `tf_XLA...`; it has not been run on a GPU,
whose kernels appear on device streams instead. Run it alone (`flock /tmp/expertd-bench.lock
...`); the profiler adds a few microseconds per op.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import sys
import tempfile
import time

import harness
import jax
import jax.numpy as jnp

from expertd.kernels import moe

RESULTS = os.path.join(harness.RESULTS, "layer_timeline.json")
CALLS = 40
WARMUP_CALLS = 10


def trace_events(trace_dir: pathlib.Path) -> list[dict]:
    """The complete ("X") events of the newest trace under `trace_dir`, each with its thread's name."""
    path = max(trace_dir.glob("**/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [dict(e, thread=threads.get((e["pid"], e.get("tid")), "")) for e in events if e.get("ph") == "X"]


def op_seconds(events: list[dict], calls: int) -> dict[str, dict]:
    """Seconds and count per call of each op run on XLA's threads (the executor's own spans,
    which enclose the ops, left out)."""
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e["thread"].startswith("tf_XLA") and not e["name"].startswith("ThunkExecutor"):
            total[e["name"]] += e["dur"] * 1e-6
            count[e["name"]] += 1
    return {name: {"seconds": total[name] / calls, "per_call": count[name] / calls}
            for name in sorted(total, key=total.get, reverse=True)}


def timeline(e, k, h, i, family, t, dtype_name, calls=CALLS):
    """One case: the layer's call period and its ops, per call."""
    dtype = jnp.dtype(dtype_name)
    cfg, _, served, backend, x = harness.served_case(e, k, h, i, family, t, dtype)
    layer = jax.jit(lambda p, v: moe.moe_layer(p, v, cfg),
                    compiler_options=moe.compiler_options(cfg, t, dtype=dtype) or None)
    for _ in range(WARMUP_CALLS):
        layer(served, x).block_until_ready()
    with tempfile.TemporaryDirectory(prefix="expertd-timeline-") as tmp:
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        for _ in range(calls):
            layer(served, x).block_until_ready()
        period = (time.perf_counter() - t0) / calls
        jax.profiler.stop_trace()
        ops = op_seconds(trace_events(pathlib.Path(tmp)), calls)
    custom = sum(o["seconds"] for name, o in ops.items() if name.startswith("ffi_call"))
    other = sum(o["seconds"] for name, o in ops.items() if not name.startswith("ffi_call"))
    return dict(E=e, k=k, H=h, I=i, T=t, dtype=dtype_name, backend=backend, calls=calls, period_s=period,
                custom_calls_s=custom, other_ops_s=other, rest_s=period - custom - other, ops=ops)


def print_case(row, top=8):
    p = row["period_s"]
    print(f"E={row['E']} k={row['k']} T={row['T']} {row['dtype']} ({row['backend']}): {p * 1e3:.3f} ms per call = "
          f"custom calls {row['custom_calls_s'] * 1e3:.3f} ({row['custom_calls_s'] / p:.0%}) + other ops "
          f"{row['other_ops_s'] * 1e3:.3f} ({row['other_ops_s'] / p:.0%}) + rest {row['rest_s'] * 1e3:.3f} ms "
          f"({row['rest_s'] / p:.0%})")
    for name, o in list(row["ops"].items())[:top]:
        print(f"    {name:40.40s} {o['seconds'] * 1e6:9.1f} us  x{o['per_call']:.0f}")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16])
    parser.add_argument("--dtypes", nargs="*", default=list(harness.LAYER_DTYPES))
    parser.add_argument("--experts", type=int, nargs="*", default=[s[0] for s in harness.LAYER_SHAPES])
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    for (e, k, h, i, family), dtype_name, t in harness.selected_cases(args, harness.LAYER_SHAPES, args.tokens):
        rows.append(timeline(e, k, h, i, family, t, dtype_name, args.calls))
        print_case(rows[-1])
    harness.write_results(args.out, "layer_timeline", rows)


if __name__ == "__main__":
    main()
