"""Disaggregated decode: the attention side's decode loop with its MoE layers in-process vs on an
expert server over loopback, and the gain from m = 2, 3 micro-batches in flight.

The model: ``--layers`` MoE layers of one Qwen3-MoE-style shape (``mid``: H=2048, E=64, k=8, I=512,
8 layers, bf16; ``--short``: H=256, E=8, k=2, I=128, 2 layers, fp32), seeded weights. For each T
(tokens a decode step) the synthetic attention before every MoE layer costs ``--attention-ratio``
times the in-process layer step at that T (1.0: the two sides balanced, where overlap can gain most),
or ``--attention-ms`` when given.

- local: one process runs attention then the engine's layer (``Engine.forward``, padded to its
  bucket as the batcher would), layer after layer: tokens/s and the in-process step time.
- remote: a real server (``create_server``, port 0, buckets 1/4/16/64/256, batching delay 0) in
  this process; the decode loop ``examples/decode_loop.py --json`` in a separate process (its CPU
  is not the server's GIL) for each transport of ``expertd.client.pipeline`` and m = 1, 2, 3:
  tokens/s, the expert side's busy fraction, and at m = 1 the per-layer round trip (a step's time
  outside attention / layers) minus the in-process step: what one hop costs. Transport ``native``:
  the pipeline's unary calls to the server's native Forward port (``--native-port``; left out,
  saying why, where it cannot be built); ``shm``: its unary calls over the same-host channel
  (``--shm-channel``, ``shm://``).

Reported per T and transport: remote / local tokens/s at m = 1 and at the best m, the gain of m = 2
and m = 3 over m = 1, busy fractions, round trip and hop. JSON in
``benchmarks/results/disaggregated.json`` (not written by ``--short`` unless ``--out`` is given).

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/disaggregated.py          # full (minutes)
    .venv/bin/python benchmarks/disaggregated.py --short                                # proves it runs
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import harness
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = harness.RESULTS / "disaggregated.json"
EXAMPLE = ROOT / "examples" / "decode_loop.py"
BUCKETS = (1, 4, 16, 64, 256)
SHAPES = {  # (H, E, k, I, MoE layers, dtype)
    "mid": (2048, 64, 8, 512, 8, "bfloat16"),
    "short": (256, 8, 2, 128, 2, "float32"),
}


def build_layers(hidden: int, experts: int, topk: int, inter: int, layers: int, dtype: str):
    return harness.seeded_layers({"model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": 4 * inter,
                                  "moe_intermediate_size": inter, "num_hidden_layers": layers,
                                  "num_experts": experts, "num_experts_per_tok": topk, "norm_topk_prob": True,
                                  "hidden_act": "silu"}, dtype, num_layers=layers)


def in_process_step_ms(engine, layers: list[int], tokens: int, hidden: int, repeats: int) -> float:
    """p50 of one layer's engine step at ``tokens`` rows (padded to the bucket), over every layer."""
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(engine.dtype)
    for layer in layers:  # the first call at a new shape is not timed
        harness.padded_forward(engine, layer, [x])
    times = []
    for _ in range(repeats):
        for layer in layers:
            t0 = time.perf_counter()
            harness.padded_forward(engine, layer, [x])
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def local_decode(engine, layers: list[int], tokens: int, hidden: int, attention_ms: float, steps: int) -> dict:
    """The decode loop of examples/decode_loop.py with the layers in-process (m = 1: nothing to overlap)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    from decode_loop import SyntheticAttention, next_input

    attention = SyntheticAttention(layers, hidden, tokens, attention_ms)
    x = next_input(np.random.default_rng(1).standard_normal((tokens, hidden)).astype(engine.dtype))

    def step(x):
        for layer in layers:
            x = np.asarray(harness.padded_forward(engine, layer, [attention(layer, 0, x)]).output)
        return next_input(x)

    x = step(x)
    attention.busy = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        x = step(x)
    wall = time.perf_counter() - start
    return {"tokens_per_s": steps * tokens / wall, "step_ms": wall / steps * 1e3,
            "attention_busy_fraction": attention.busy / wall, "expert_busy_fraction": 1 - attention.busy / wall}


NATIVE = "native"
"""A transport of this benchmark: the pipeline's unary calls to the native Forward port."""
SHM = "shm"
"""A transport of this benchmark: the pipeline's unary calls over the same-host channel."""


def remote_decode(server, tokens: int, layers: int, attention_ms: float, steps: int, transport: str,
                  micro_batches: list[int]) -> dict:
    if transport == SHM:
        target, transport = f"shm://{server.config.shm_channel}", "unary"
    else:
        port, transport = (server.native_port, "unary") if transport == NATIVE else (server.port, transport)
        target = f"127.0.0.1:{port}"
    command = [sys.executable, str(EXAMPLE), "--target", target,
               "--metrics", f"http://127.0.0.1:{server.metrics_port}/metrics", "--tokens", str(tokens),
               "--layers", str(layers), "--steps", str(steps), "--warmup", "3", "--attention-ms", f"{attention_ms:.4f}",
               "--micro-batches", ",".join(map(str, micro_batches)), "--transport", transport, "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="a small shape, few steps: proves the script runs")
    parser.add_argument("--tokens", default=None, help="tokens a step, comma-separated (1,16,64,256; short: 1,16)")
    parser.add_argument("--transports", default=None,
                        help="comma-separated: unary, stream, layer-streams, native, shm (the first three; short: "
                        "unary,stream)")
    parser.add_argument("--attention-ratio", type=float, default=1.0,
                        help="attention time per layer / the in-process layer step at the same T (1.0)")
    parser.add_argument("--attention-ms", type=float, default=None,
                        help="attention time per layer in ms, the same for every T (overrides --attention-ratio)")
    parser.add_argument("--steps", type=int, default=None, help="measured decode steps per cell (40; short: 5)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help=f"results JSON (default {RESULTS}; "
                        "short: none)")
    args = parser.parse_args(argv)
    shape = "short" if args.short else "mid"
    hidden, experts, topk, inter, num_layers, dtype = SHAPES[shape]
    tokens_list = [int(t) for t in (args.tokens or ("1,16" if args.short else "1,16,64,256")).split(",")]
    transports = (args.transports or ("unary,stream" if args.short else "unary,stream,layer-streams")).split(",")
    steps = args.steps or (5 if args.short else 40)
    micro = [1, 2] if args.short else [1, 2, 3]
    out = args.out or (None if args.short else RESULTS)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if NATIVE in transports:
        from expertd.server.native_front import NativeUnavailable, load

        try:
            load()
        except (NativeUnavailable, ImportError) as exc:
            print(f"transport {NATIVE}: left out: {exc}", flush=True)
            transports.remove(NATIVE)
    channel = f"/tmp/expertd-disaggregated-{os.getpid()}.sock" if SHM in transports else None
    config = harness.server_config(dtype, native_port=0 if NATIVE in transports else None, shm_channel=channel,
                                   batching=dict(bucket_sizes=BUCKETS, max_queue_delay_ms=0.0))
    print(f"{shape}: H={hidden} E={experts} k={topk} I={inter}, {num_layers} MoE layers, {dtype}; "
          f"attention = "
          + (f"{args.attention_ms} ms" if args.attention_ms is not None else f"{args.attention_ratio} x the in-process "
             "layer step") + "; hop = round trip - the lower in-process step (before, after)", flush=True)
    rows = []
    with harness.running_server(config, build_layers(hidden, experts, topk, inter, num_layers, dtype),
                                timeout=1800) as server:
        layers = list(range(num_layers))
        print("   T transport     | layer ms attn ms | local tok/s | remote tok/s m=" + "/".join(map(str, micro))
              + " | remote/local m=1 best | gain m=" + ",".join(map(str, micro[1:]))
              + " | expert busy m=" + "/".join(map(str, micro)) + " | rtt ms hop ms", flush=True)
        for tokens in tokens_list:
            step_ms = in_process_step_ms(server.engine, layers, tokens, hidden, repeats=10 if args.short else 30)
            attention_ms = args.attention_ms if args.attention_ms is not None else args.attention_ratio * step_ms
            local = local_decode(server.engine, layers, tokens, hidden, attention_ms, steps)
            cells = []
            for transport in transports:
                remote = remote_decode(server, tokens, num_layers, attention_ms, steps, transport, micro)
                runs = {r["micro_batches"]: r for r in remote["runs"]}
                best = max(runs.values(), key=lambda r: r["tokens_per_s"])
                row = {"tokens": tokens, "transport": transport, "layer_step_ms": step_ms,
                       "attention_ms": attention_ms, "local": local, "remote": runs,
                       "remote_over_local_m1": runs[1]["tokens_per_s"] / local["tokens_per_s"],
                       "remote_over_local_best": best["tokens_per_s"] / local["tokens_per_s"],
                       "best_m": best["micro_batches"],
                       "gain_over_m1": {m: r["tokens_per_s"] / runs[1]["tokens_per_s"] for m, r in runs.items()},
                       "round_trip_ms": runs[1]["layer_round_trip_ms"]}
                cells.append(row)
            # The step again after the remote runs: the hop is taken against the lower of the two, as
            # load from elsewhere only ever adds time.
            step_after = in_process_step_ms(server.engine, layers, tokens, hidden, repeats=10 if args.short else 30)
            for row in cells:
                row["layer_step_ms_after"] = step_after
                row["hop_ms"] = row["round_trip_ms"] - min(step_ms, step_after)
                print_row(row, micro)
            rows += cells
    if out is not None:
        harness.write_json(out, {
            "benchmark": "disaggregated", "date": harness.machine.today(),
            "machine": {**harness.machine.platform_facts(with_jax=True), "load_average": os.getloadavg()},
            "shape": {"H": hidden, "E": experts, "k": topk, "I": inter, "layers": num_layers, "dtype": dtype},
            "buckets": list(BUCKETS), "max_queue_delay_ms": 0.0, "attention_ratio": args.attention_ratio,
            "steps": steps, "rows": rows}, indent=2)
    return 0


def print_row(row: dict, micro: list[int]) -> None:
    runs = row["remote"]  # m above T is not run
    remote = "/".join(f"{runs[m]['tokens_per_s']:.0f}" if m in runs else "-" for m in micro)
    gains = " ".join(f"{row['gain_over_m1'][m]:.2f}" if m in runs else "-" for m in micro[1:])
    busy = "/".join(f"{runs[m]['expert_busy_fraction']:.0%}" if m in runs else "-" for m in micro)
    step = min(row["layer_step_ms"], row["layer_step_ms_after"])
    print(f"{row['tokens']:>4} {row['transport']:<13} | {step:>8.2f} {row['attention_ms']:>7.2f} | "
          f"{row['local']['tokens_per_s']:>11.0f} | {remote:>20} | {row['remote_over_local_m1']:>8.2f} "
          f"{row['remote_over_local_best']:>5.2f} (m={row['best_m']}) | {gains:>10} | {busy:>17} | "
          f"{row['round_trip_ms']:>6.2f} {row['hop_ms']:>6.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
