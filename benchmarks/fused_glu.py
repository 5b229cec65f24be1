"""The native CPU kernel's expert FFN with gate, up and the gated activation fused into one call
(`cpu.grouped_glu`, what `cpu.grouped_ffn` runs) against the unfused composition of the same
kernels (gate and up as two `cpu.grouped_matmul` calls, the activation and the bf16 cast in XLA),
both followed by the same down projection (issue 50, item 1).

For each shape, weight format and T: routed rows as the layer makes them (`cpu.layout` of seeded
top-k ids; gate / up read the token rows by index), the two sides jitted and timed in alternating
rounds (`harness.order`: a burst of calls of each a round, the order reversed every other round).
Columns: each side's median ms; fused / unfused per round (the range over rounds); the gate / up
`[N, I]` fp32 pair the fused call does not write and read back (MB); max |fused - unfused| over max
|unfused| (h rounded to bf16 apart: the activation's polynomials differ from XLA's in the last fp32
bits).

Shapes: Qwen3-30B-A3B's layer (E 128, k 8, H 2048, I 768, SwiGLU) and gpt-oss-20b's (E 32, k 4,
H = I = 2880, its clamped swiglu with expert biases); `--shapes small` is a quick check.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/fused_glu.py \\
        [--shapes qwen3,gptoss] [--weights bf16,int8] [--tokens 1,16,64,256,1024] [--rounds 5]

Writes benchmarks/results/fused_glu.json.
"""
from __future__ import annotations

import argparse
import os
import statistics

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu, ffn
from expertd.server.host import memory

SHAPES = {"qwen3": (128, 8, 2048, 768, ffn.GatedActivation(), False),
          "gptoss": (32, 4, 2880, 2880, ffn.GatedActivation("swiglu_oai", 7.0), True),
          "small": (16, 2, 512, 256, ffn.GatedActivation(), False)}
TOKENS = (1, 16, 64, 256, 1024)
RESULTS = os.path.join(harness.RESULTS, "fused_glu.json")


def unfused_ffn(xs, group_sizes, w_gate, w_up, w_down, activation, source, biases):
    """The layer's expert FFN as it ran before the fused call: the same kernels, the activation in XLA."""
    x32 = xs.astype(jnp.float32)
    g = cpu.grouped_matmul(x32, group_sizes, w_gate, source=source)
    u = cpu.grouped_matmul(x32, group_sizes, w_up, source=source)
    if biases is not None:
        rb = ffn.row_biases(biases, *ffn.row_experts(group_sizes, g.shape[0]))
        g, u = g + rb.gate, u + rb.up
    y = cpu.grouped_matmul(activation(g, u).astype(xs.dtype).astype(jnp.float32), group_sizes, w_down)
    return (y if biases is None else y + rb.down).astype(xs.dtype)


def prepared_weights(e, h, i, weights: str, seed: int = 0):
    """(w_gate, w_up, w_down) as the engine serves them: bf16 panels, or INT8 panels."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((e, h, i), (e, h, i), (e, i, h)):
        w = jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[1]), jnp.bfloat16)
        out.append(cpu.int8.to_int8_panels(w) if weights == "int8" else cpu.to_panels(w))
    memory.advise_huge_pages(jax.tree.leaves(out))
    return out


def run_case(name, weights, tokens, rounds, burst):
    e, k, h, i, activation, with_biases = SHAPES[name]
    w = prepared_weights(e, h, i, weights)
    rng = np.random.default_rng(1)
    biases = ffn.ExpertBiases(*(jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
                                for s in ((e, i), (e, i), (e, h)))) if with_biases else None
    sides = {"fused": jax.jit(lambda x, s, g: cpu.grouped_ffn(x, g, *w, activation=activation, source=s,
                                                              biases=biases)),
             "unfused": jax.jit(lambda x, s, g: unfused_ffn(x, g, *w, activation, s, biases))}
    rows = []
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
        perm = cpu.layout(ids, e)
        args = (x, perm.token_of_row, perm.group_sizes)
        outs = {side: np.asarray(jax.block_until_ready(fn(*args)), np.float32) for side, fn in sides.items()}
        times = {side: [] for side in sides}
        for r in range(rounds):
            for side in harness.order(list(sides), r):
                call = (lambda f, a: lambda: jax.block_until_ready(f(*a)))(sides[side], args)
                times[side].append(statistics.median(harness.timed(call) for _ in range(burst)))
        ratios = harness.ratios(times["fused"], times["unfused"])
        row = {"shape": name, "weights": weights, "E": e, "k": k, "H": h, "I": i, "T": t,
               "activation": activation.name, "biases": with_biases,
               "fused_ms": statistics.median(times["fused"]) * 1e3,
               "unfused_ms": statistics.median(times["unfused"]) * 1e3,
               "fused_over_unfused": ratios, "pair_mb": 2 * t * k * i * 4 / 1e6,
               "max_rel_diff": float(np.abs(outs["fused"] - outs["unfused"]).max()
                                     / max(np.abs(outs["unfused"]).max(), 1e-30))}
        rows.append(row)
        print(f"{name:>6} {weights:>4} T={t:<5} fused {row['fused_ms']:9.3f} ms  unfused {row['unfused_ms']:9.3f} ms  "
              f"fused/unfused {harness.span(ratios)}  pair {row['pair_mb']:.1f} MB  diff {row['max_rel_diff']:.4f}",
              flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,gptoss", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--weights", default="bf16,int8", help="comma-separated, of bf16, int8")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=3, help="calls a side makes per round (their median counts)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if not cpu.available():
        raise SystemExit(f"the native CPU kernel is unavailable: {cpu.unavailable_reason()}")
    print(f"native CPU kernel: {cpu.isa()}; {harness.machine.summary(with_processor=True)}", flush=True)
    tokens = [int(v) for v in args.tokens.split(",") if v]
    rows = [row for name in args.shapes.split(",") if name for weights in args.weights.split(",") if weights
            for row in run_case(name, weights, tokens, args.rounds, args.burst)]
    harness.write_results(args.out, "fused_glu", rows, isa=cpu.isa(), rounds=args.rounds, burst=args.burst)


if __name__ == "__main__":
    main()
