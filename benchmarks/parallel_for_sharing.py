"""The native kernels' sharing rule: when a ParallelFor call wakes the pool, and when the caller runs alone.

`kernels/cpu/csrc/parallel.h`: a call of at most `kCallerOnlyWork` multiply-adds runs on the calling
thread alone; a bigger one is shared with XLA:CPU's intra-op pool. This times, in one process, the
grouped matmul (`cpu.grouped_matmul`, fp32 row-major weights) over a grid of work sizes, each both
ways (`diagnostics.caller_only_work`: "alone" every call on the caller, "shared" every call of two or more
tasks shared), and the served `tiny` layer's single-token step (serving.py's layer, `Engine.forward`)
both ways. Each is timed back to back and after an idle gap (`--gap-ms` of sleep before each call,
as a lone client's decode steps arrive); modes alternate in rounds. Per case: the median wall time
per call, the process's CPU time per call (every thread's: a woken helper's spinning counts), and
shared / alone for both (< 1: sharing is faster or cheaper). "rule" names the way the bound picks.

    .venv/bin/python benchmarks/parallel_for_sharing.py [--rounds 5] [--calls 100] [--gap-ms 0.5]

Prints a table; JSON in benchmarks/results/parallel_for_sharing.json.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu
from expertd.kernels.cpu import diagnostics

RESULTS = harness.RESULTS / "parallel_for_sharing.json"
# (rows, K, C) of one grouped matmul; the rows are spread over min(rows, 8) of 8 experts.
SHAPES = ((2, 64, 256), (2, 128, 256), (2, 256, 256), (4, 256, 256), (16, 64, 256), (2, 512, 512),
          (4, 512, 512), (64, 64, 256), (8, 1024, 768), (256, 64, 256))
EXPERTS = 8
MODES = {"alone": 1 << 62, "shared": 0}  # caller_only_work bounds


def matmul_case(rows: int, k: int, c: int):
    """A zero-argument call of one grouped matmul of ``rows x k x c`` multiply-adds."""
    rng = np.random.default_rng(0)
    sizes = np.bincount(np.arange(rows) % min(rows, EXPERTS), minlength=EXPERTS).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
    w = jnp.asarray(rng.standard_normal((EXPERTS, k, c), np.float32))
    gs, call = jnp.asarray(sizes), jax.jit(cpu.grouped_matmul)
    return lambda: call(x, gs, w).block_until_ready()


def tiny_layer_step():
    """The served ``tiny`` layer's single-token step, as the server runs it (a zero-argument call)."""
    engine, hidden = harness.tiny_engine()
    x = np.ones((1, hidden), np.float32)
    return lambda: np.asarray(harness.padded_forward(engine, 0, [x]).output)[:1]


def time_calls(call, calls: int, gap_s: float) -> tuple[list[float], float]:
    """(wall seconds of each call, process CPU seconds over all of them, the gaps' excluded as far
    as sleeping costs none)."""
    walls, cpu_start = [], time.process_time()
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    return walls, time.process_time() - cpu_start


def measure(call, rounds: int, calls: int, gap_s: float) -> dict:
    """Both modes, alternating in ``rounds``: {mode: (median wall us, CPU us per call)}."""
    walls, cpu_s = {m: [] for m in MODES}, dict.fromkeys(MODES, 0.0)
    for bound in MODES.values():  # warm both ways first
        with diagnostics.caller_only_work(bound):
            time_calls(call, 10, 0.0)
    for round_index in range(rounds):
        for mode in harness.order(MODES, round_index):
            with diagnostics.caller_only_work(MODES[mode]):
                w, c = time_calls(call, calls, gap_s)
            walls[mode] += w
            cpu_s[mode] += c
    return {mode: (float(np.median(walls[mode])) * 1e6, cpu_s[mode] / (rounds * calls) * 1e6) for mode in MODES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per case; the modes alternate")
    parser.add_argument("--calls", type=int, default=100, help="calls per mode per round")
    parser.add_argument("--gap-ms", type=float, default=0.5, help="idle time before each call of the gap cases")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not cpu.available():
        sys.exit(f"the native CPU kernel is unavailable: {cpu.unavailable_reason()}")
    bound = diagnostics.caller_only_work_now()
    cases = [(f"matmul {r}x{k}x{c}", r * k * c, matmul_case(r, k, c)) for r, k, c in SHAPES]
    cases.append(("tiny layer, T=1", None, tiny_layer_step()))
    print(f"kCallerOnlyWork {bound} multiply-adds; {args.rounds} rounds x {args.calls} calls per mode; "
          f"gap {args.gap_ms} ms")
    print(f"{'case':>24} {'MACs':>9} {'rule':>6} {'gap':>5} | {'alone us':>8} {'cpu':>6} | "
          f"{'shared us':>9} {'cpu':>6} | {'wall s/a':>8} {'cpu s/a':>7}")
    rows = []
    for name, macs, call in cases:
        rule = "" if macs is None else ("alone" if macs <= bound else "shared")
        for gap_ms in (0.0, args.gap_ms):
            got = measure(call, args.rounds, args.calls, gap_ms / 1e3)
            (aw, ac), (sw, sc) = got["alone"], got["shared"]
            row = {"case": name, "macs": macs, "rule": rule, "gap_ms": gap_ms, "alone_wall_us": round(aw, 1),
                   "alone_cpu_us": round(ac, 1), "shared_wall_us": round(sw, 1), "shared_cpu_us": round(sc, 1),
                   "wall_shared_over_alone": round(sw / aw, 2), "cpu_shared_over_alone": round(sc / ac, 2)}
            rows.append(row)
            print(f"{name:>24} {macs or '':>9} {rule:>6} {gap_ms:>5} | {aw:8.1f} {ac:6.1f} | {sw:9.1f} {sc:6.1f} | "
                  f"{sw / aw:8.2f} {sc / ac:7.2f}", flush=True)
    harness.write_json(args.out, {
        "benchmark": "parallel_for_sharing", "date": harness.machine.now(utc=True),
        "machine": harness.machine.processor(), "isa": cpu.isa(), "caller_only_work": bound,
        "rounds": args.rounds, "calls": args.calls, "rows": rows}, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
