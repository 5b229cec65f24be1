"""Router kernels: median time per call of every backend against an unfused XLA baseline.

Baseline ("unfused"): softmax over all E, `lax.top_k`, then scatter the k probabilities and the
routing map into dense `[T, E]` zeros: the textbook router, jitted as one XLA program. The router
backends run the same math (`use_pre_softmax=True`: softmax, top-k, no renormalisation), so the
ratio column is like for like; "ratio" = backend time / baseline time in the same run (< 1 is
faster). A second, smaller table times the default post-softmax router and a DeepSeek-V3 style
router (sigmoid + expert bias + groups 8/4 + scaling), again against the baseline.

Grid: T in {128, 4096, 32768} x E in {8, 64, 256} x k in {2, 8}, float32 logits.

On GPU it also reports achieved bandwidth against the floor of one read of the logits plus one
write of probs and map (T*E*(4 + 4 + 1) bytes for fp32), as a fraction of the device's measured
copy bandwidth. On CPU the "pallas" backend runs in interpret mode: a correctness path, timed
for completeness only.

Run: `flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/router.py [--quick]`
(writes benchmarks/results/router.json).
"""
from __future__ import annotations

import argparse
import functools

import harness
import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels.router import fused_topk_with_score_function

RESULTS = harness.RESULTS / "router.json"
BACKENDS = ("reference", "xla", "pallas")


def unfused_router(logits, topk):
    """The baseline: softmax + lax.top_k + scatter, `[T, E]` -> (probs, routing_map)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    values, experts = lax.top_k(probs, topk)
    rows = lax.broadcasted_iota(jnp.int32, experts.shape, 0)
    dense = jnp.zeros(logits.shape, logits.dtype).at[rows, experts].set(values.astype(logits.dtype))
    routing_map = jnp.zeros(logits.shape, jnp.bool_).at[rows, experts].set(True)
    return dense, routing_map


def median_seconds(fn, x, budget_s: float, max_repeats: int) -> tuple[float, int]:
    """(median wall seconds, calls timed) of fn(x) after one warm-up call (compile): at least 3,
    at most ``max_repeats``, as many as fit in ``budget_s``."""
    timing = harness.time_calls(lambda: jax.block_until_ready(fn(x)), max_calls=max_repeats, budget_s=budget_s)
    return timing.median, len(timing.samples)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write of a 1 GiB buffer), GPU only."""
    x = jnp.ones((1 << 28,), jnp.float32)
    copy = jax.jit(lambda v: v * 1.0)
    seconds, _ = median_seconds(copy, x, 1.0, 20)
    return 2 * x.nbytes / seconds


def bench_grid(tokens, experts, topks, budget_s, interpret_budget_s):
    rows = []
    key = jax.random.key(0)
    gpu = jax.default_backend() == "gpu"
    for t in tokens:
        for e in experts:
            logits = jax.random.normal(jax.random.fold_in(key, t * e), (t, e), jnp.float32)
            for k in topks:
                if k > e:
                    continue
                entry = {"T": t, "E": e, "k": k, "dtype": "float32", "router": "softmax-pre"}
                base, n = median_seconds(jax.jit(functools.partial(unfused_router, topk=k)), logits, budget_s, 50)
                entry["baseline_ms"] = base * 1e3
                for backend in BACKENDS:
                    interpreted = backend == "pallas" and not gpu
                    fn = jax.jit(functools.partial(fused_topk_with_score_function, topk=k, use_pre_softmax=True,
                                                   backend=backend))
                    seconds, n = median_seconds(fn, logits, interpret_budget_s if interpreted else budget_s,
                                                5 if interpreted else 50)
                    entry[f"{backend}_ms"] = seconds * 1e3
                    entry[f"{backend}_ratio"] = seconds / base
                    if gpu:
                        entry[f"{backend}_bytes_per_s"] = t * e * (4 + 4 + 1) / seconds
                rows.append(entry)
                print(format_row(entry), flush=True)
    return rows


def bench_settings(budget_s, interpret_budget_s):
    """Default post-softmax and DeepSeek-V3 style routing at T=4096, E=256, k=8."""
    t, e, k = 4096, 256, 8
    logits = jax.random.normal(jax.random.key(1), (t, e), jnp.float32)
    bias = jnp.linspace(-0.1, 0.1, e, dtype=jnp.float32)
    settings = {
        "softmax-post": dict(),
        "sigmoid+bias+groups 8/4+scale 2.5": dict(score_function="sigmoid", expert_bias=bias, num_groups=8,
                                                  group_topk=4, scaling_factor=2.5),
    }
    base, _ = median_seconds(jax.jit(functools.partial(unfused_router, topk=k)), logits, budget_s, 50)
    rows = []
    for name, kwargs in settings.items():
        entry = {"T": t, "E": e, "k": k, "dtype": "float32", "router": name, "baseline_ms": base * 1e3}
        for backend in BACKENDS:
            interpreted = backend == "pallas" and jax.default_backend() != "gpu"
            fn = jax.jit(functools.partial(fused_topk_with_score_function, topk=k, backend=backend, **kwargs))
            seconds, _ = median_seconds(fn, logits, interpret_budget_s if interpreted else budget_s,
                                        5 if interpreted else 50)
            entry[f"{backend}_ms"] = seconds * 1e3
            entry[f"{backend}_ratio"] = seconds / base
        rows.append(entry)
        print(format_row(entry), flush=True)
    return rows


def format_row(entry) -> str:
    cells = [f"{entry['router']:<34}", f"{entry['T']:>6}", f"{entry['E']:>4}", f"{entry['k']:>2}",
             f"{entry['baseline_ms']:>9.3f}"]
    for backend in BACKENDS:
        cells.append(f"{entry[backend + '_ms']:>9.3f} ({entry[backend + '_ratio']:.2f})")
    return " | ".join(cells)


HEADER = " | ".join([f"{'router':<34}", f"{'T':>6}", f"{'E':>4}", f"{'k':>2}", f"{'unfused':>9}"]
                    + [f"{b + ' ms (ratio)':>16}" for b in BACKENDS])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 4096 only, shorter budgets")
    args = parser.parse_args()
    tokens = (128, 4096) if args.quick else (128, 4096, 32768)
    budget, interpret_budget = (0.3, 0.5) if args.quick else (1.0, 2.0)
    print(f"router benchmark on {harness.machine.describe()} ({jax.default_backend()})")
    print(HEADER)
    rows = bench_grid(tokens, (8, 64, 256), (2, 8), budget, interpret_budget)
    print("\nother router settings (T=4096, E=256, k=8):")
    print(HEADER)
    rows += bench_settings(budget, interpret_budget)
    result = {"benchmark": "router", "date": harness.machine.today(), "machine": harness.machine.describe(),
              "platform": jax.default_backend(), "pallas_mode": "compiled" if jax.default_backend() == "gpu"
              else "interpret", "rows": rows}
    if jax.default_backend() == "gpu":
        result["copy_bytes_per_s"] = copy_bandwidth()
        for entry in rows:
            for backend in BACKENDS:
                if f"{backend}_bytes_per_s" in entry:
                    entry[f"{backend}_fraction_of_copy"] = entry[f"{backend}_bytes_per_s"] / result["copy_bytes_per_s"]
        print(f"\ncopy bandwidth {result['copy_bytes_per_s'] / 1e9:.0f} GB/s; pallas fraction of it per row:")
        for entry in rows:
            if "pallas_fraction_of_copy" in entry:
                print(f"  T={entry['T']} E={entry['E']} k={entry['k']}: {entry['pallas_fraction_of_copy']:.2f}")
    print()
    harness.write_json(RESULTS, result)


if __name__ == "__main__":
    main()
