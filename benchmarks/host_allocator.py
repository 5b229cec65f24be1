"""What keeping freed host buffers (expertd.server.host.allocator) is worth: the MoE layer with its
buffers reused as they are, against the same calls with their pages given back first.

glibc's default (big blocks mmap'd per call, munmap'd when freed) cannot be switched back on in a
process that took host_allocator's settings, and two processes run apart in time differ by more
than the effect on a shared VM. So both sides run in one process, interleaved: "retained" is the process
as `expertd serve --retain-freed-memory` runs it; "faulting" first calls malloc_trim(0) (untimed),
which hands every free page back to the kernel as the default munmap does, so the call faults its
buffers in again, as it does by default. Each side reports its median time and its page faults per call (ru_minflt).

Shapes: the layer (`moe.moe_layer`, backend "auto" on `moe.prepare_params`, compiled with
`moe.compiler_options` as the server does) at (E, k, H, I) in {(8, 2, 1024, 2048), (64, 8, 1024,
512)}, T in {1024, 4096}, bf16 and fp32; and one XLA elementwise op over 128 MiB (a fresh 128 MiB
output per call). Only blocks above glibc's mmap threshold (32 MiB at most) fault per call by
default: at T=256 a default process takes no faults per call, while malloc_trim would make the
"faulting" side fault there anyway, so smaller T (--tokens) overstate what the default loses.
Prints a table and writes benchmarks/results/allocator.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import sys
import time

import harness
import jax  # noqa: E402  (after host_allocator: see main)
import jax.numpy as jnp  # noqa: E402

from expertd.kernels import moe  # noqa: E402
from expertd.server.host import allocator, memory

SHAPES, DTYPES = harness.LAYER_SHAPES, harness.LAYER_DTYPES
TOKENS = (1024, 4096)
RESULTS = os.path.join(harness.RESULTS, "allocator.json")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(call, rounds: int, give_back) -> dict:
    """Median seconds and page faults per call of `call` retained and after `give_back()`, alternated.
    A retained call follows an untimed one, which faults back in what the last give_back released."""
    sides = {"retained": ([], []), "faulting": ([], [])}
    for round_ in range(rounds):
        for side in harness.order(sides, round_):
            (give_back if side == "faulting" else call)()
            f0, t0 = faults(), time.perf_counter()
            call()
            seconds, count = sides[side]
            seconds.append(time.perf_counter() - t0)
            count.append(faults() - f0)
    return {side: {"median_s": statistics.median(s), "faults_per_call": statistics.median(c)}
            for side, (s, c) in sides.items()}


def layer_case(e, k, h, i, family, t, dtype_name, rounds, give_back) -> dict:
    dtype = jnp.dtype(dtype_name)
    cfg = harness.layer_config(e, k, h, i, family)
    params = moe.prepare_params(moe.init_params(cfg, jax.random.key(0), dtype), cfg)  # as the server serves them
    memory.advise_huge_pages(jax.tree.leaves(params))
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32).astype(dtype)
    options = moe.compiler_options(cfg, t, dtype=dtype) or None  # as the server compiles it
    fn = jax.jit(lambda p, v: moe.moe_layer(p, v, cfg), compiler_options=options)
    for _ in range(3):  # compile, then let the heap reach its steady state
        jax.block_until_ready(fn(params, x))
    result = interleaved(lambda: jax.block_until_ready(fn(params, x)), rounds, give_back)
    return dict(case=f"layer E={e} k={k} {dtype_name} T={t}", E=e, k=k, H=h, I=i, T=t, dtype=dtype_name, **result)


def elementwise_case(rounds, give_back, nbytes=128 << 20) -> dict:
    y = jnp.ones((nbytes // 4,), jnp.float32)
    bump = jax.jit(lambda v: v + 1.0)
    for _ in range(3):
        jax.block_until_ready(bump(y))
    result = interleaved(lambda: jax.block_until_ready(bump(y)), rounds, give_back)
    return dict(case=f"XLA y + 1 over {nbytes >> 20} MiB", **result)


def print_rows(rows) -> None:
    print(f"{'case':40s} {'retained ms':>12s} {'faulting ms':>12s} {'gain':>6s} {'faults/call':>12s}")
    for r in rows:
        kept, lost = r["retained"], r["faulting"]
        print(f"{r['case']:40s} {kept['median_s'] * 1e3:12.2f} {lost['median_s'] * 1e3:12.2f} "
              f"{lost['median_s'] / kept['median_s']:6.2f} "
              f"{kept['faults_per_call']:5.0f} / {lost['faults_per_call']:<6.0f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--experts", type=int, nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=0, help="timed calls per side (default: 8 at T >= 4096, else 20)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    state = allocator.retain_freed_memory()  # before JAX's first computation
    if not state.applied:  # e.g. not glibc: nothing to compare (`make bench` goes on)
        print(f"skipped: host_allocator did not apply: {state.reason}")
        return
    libc = ctypes.CDLL(None)

    def give_back():
        libc.malloc_trim(0)

    rows = [elementwise_case(args.rounds or 10, give_back)]
    print_rows(rows)
    for e, k, h, i, family in SHAPES:
        if e not in args.experts:
            continue
        for dtype_name in args.dtypes:
            for t in args.tokens:
                rounds = args.rounds or (8 if t >= 4096 else 20)
                rows.append(layer_case(e, k, h, i, family, t, dtype_name, rounds, give_back))
                print_rows(rows[-1:])
                sys.stdout.flush()
    print()
    print_rows(rows)
    harness.write_results(args.out, "host_allocator", rows)


if __name__ == "__main__":
    main()
