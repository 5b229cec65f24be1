"""INT8 expert weights against bf16 on CPU: the layer on each, against its own read floor measured in
the same run, and the error of INT8 against bf16 (issue 50, items 2 and 3).

For each shape and T: the layer (`moe.moe_layer`, backend auto = the native CPU kernel) on the
seeded bf16 weights as the engine prepares them (`moe.prepare_params`: bf16 panels) and on the same
weights quantised (`expert_weights="int8"`: int8 panels + fp32 scales per output column), each timed
in alternation with the copy and read probes (`harness.paired_floors`: every round's burst against
that round's bandwidth). Columns:

  bf16 ms / int8 ms    the layer's median call
  x read               that median over the read floor of the bytes it must read: the touched
                       experts' weights (bf16: 3 H I x 2 B each; int8: 3 H I x 1 B + (2 I + H) x 4 B
                       of scales), at the read probes' rate (the median of the rounds' ratios)
  int8 / bf16          int8's time in units of bf16's (the issue's goal: about 0.55 at T <= 64)
  max rel err          max |y_int8 - y_bf16| / max |y_bf16| of the layer's output on these tokens

Shapes: Qwen3-30B-A3B's layer (E 128, k 8, H 2048, I 768) and gpt-oss-20b's sizes (E 32, k 4,
H = I = 2880, run as a SwiGLU layer of the qwen3_moe family: the bytes and FLOPs, not gpt-oss's
clamped activation and biases); `--shapes small` is a quick check (E 16, k 2, H 512, I 256).

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/moe_layer_int8.py \\
        [--shapes qwen3,gptoss] [--tokens 1,16,64,256,1024] [--rounds 9]

Writes benchmarks/results/moe_layer_int8.json. Timings on a shared machine are noisy: compare the
ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import os

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu, moe
from expertd.server.host import memory

SHAPES = {"qwen3": (128, 8, 2048, 768), "gptoss": (32, 4, 2880, 2880), "small": (16, 2, 512, 256)}
TOKENS = (1, 16, 64, 256, 1024)


def run_shape(name: str, tokens, rounds: int) -> list[dict]:
    e, k, h, i = SHAPES[name]
    cfg = harness.layer_config(e, k, h, i, "qwen3_moe")
    params = moe.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    served = {"bf16": moe.prepare_params(params, cfg), "int8": moe.prepare_params(params, cfg, expert_weights="int8")}
    for held in served.values():
        memory.advise_huge_pages(jax.tree.leaves(held))
    expert_bytes = {"bf16": 3 * h * i * 2, "int8": 3 * h * i + (2 * i + h) * 4}
    layer = jax.jit(lambda p, v: moe.moe_layer(p, v, cfg, return_routing=True))
    rows = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32).astype(jnp.bfloat16)
        outs, row = {}, {"shape": name, "E": e, "k": k, "H": h, "I": i, "T": t}
        for kind, p in served.items():
            out, routing = layer(p, x)
            outs[kind] = np.asarray(out, np.float32)
            touched = int(np.sum(np.asarray(routing["tokens_per_expert"]) > 0))
            floors = harness.paired_floors(lambda p=p, x=x: jax.block_until_ready(layer(p, x)),
                                           touched * expert_bytes[kind], rounds=rounds)
            row.update({f"{kind}_ms": floors["auto"] * 1e3, f"{kind}_x_read_floor": floors["x_read_floor"],
                        f"{kind}_read_floor_ms": floors["read_floor_s"] * 1e3, "touched_experts": touched,
                        f"{kind}_read_gb_per_s": floors["read_bytes_per_s"] / 1e9})
        row["int8_over_bf16"] = row["int8_ms"] / row["bf16_ms"]
        row["max_rel_err"] = float(np.abs(outs["int8"] - outs["bf16"]).max() / np.abs(outs["bf16"]).max())
        rows.append(row)
        print(f"{name:>6} T={t:<5} bf16 {row['bf16_ms']:8.3f} ms (x read {row['bf16_x_read_floor']:.2f})  "
              f"int8 {row['int8_ms']:8.3f} ms (x read {row['int8_x_read_floor']:.2f})  int8/bf16 "
              f"{row['int8_over_bf16']:.2f}  touched {row['touched_experts']}  max rel err {row['max_rel_err']:.4f}",
              flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,gptoss", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of paired_floors per layer and T")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe_layer_int8.json"))
    args = parser.parse_args(argv)
    if not cpu.available():
        raise SystemExit(f"the native CPU kernel is unavailable: {cpu.unavailable_reason()}")
    print(f"native CPU kernel: {cpu.isa()}; {jax.device_count()} device(s), {os.cpu_count()} CPUs", flush=True)
    tokens = [int(v) for v in args.tokens.split(",") if v]
    rows = [row for name in args.shapes.split(",") if name for row in run_shape(name, tokens, args.rounds)]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"isa": cpu.isa(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
