"""A decode loop on the attention side of a disaggregated MoE model: each step runs a synthetic
attention before every MoE layer and sends the layer's hidden states to an expert server, with
m = 1, 2, 3 micro-batches in flight (``expertd.client.pipeline``), and reports what each m gives.

    python examples/decode_loop.py                          # starts `expertd serve --preset tiny` itself
    python examples/decode_loop.py --target localhost:8001 --metrics http://localhost:8002/metrics \\
        --tokens 64 --attention-ms 4 --micro-batches 1,2,3

Per m (values above --tokens are skipped) it prints: tokens/s, the step time (p50), the expert
side's busy fraction (the server's engine step time, ``expertd_compute_duration_seconds_sum`` from
its /metrics, over the wall time of the measured steps) and the attention side's (the synthetic
attention time over the same wall time).
With m = 1 each side waits while the other works; with m >= 2 micro-batch i's attention overlaps
micro-batch j's expert call, so both fractions rise and so does tokens/s, until one side is busy
all the time or the per-call cost of more, smaller calls eats the gain.

The synthetic attention, before MoE layer l of every step: a fixed per-layer map of each token
(tanh(x * a_l + b_l), so the outputs depend on it) and ``--attention-ms`` of blocking time per
layer for the whole step, shared among the micro-batches by their tokens (the total attention work
is the same for every m). It blocks the event loop, as one accelerator runs one micro-batch's
attention at a time; the expert calls in flight go on meanwhile. The hidden states of the next
step are the last layer's output, RMS-normalised (a stand-in for sampling and embedding).

``--json`` prints one JSON object (``benchmarks/disaggregated.py`` reads it). For a server of your
own, run it with ``--max-queue-delay-ms 0``: a lone decode client gains nothing from the batching
delay.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from expertd.client import AsyncExpertClient, ExpertClient
from expertd.client.pb.v1 import expert_pb2
from expertd.client.pipeline import DEFAULT_TRANSPORT, TRANSPORTS, Pipeline, split_micro_batches

_BUSY = re.compile(r"^expertd_compute_duration_seconds_sum(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def expert_busy_seconds(metrics_url: str) -> float:
    """The server's engine step time so far (``expertd_compute_duration_seconds_sum``, every kind)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = _BUSY.findall(text)
    if not found:
        raise RuntimeError(f"{metrics_url} has no expertd_compute_duration_seconds_sum: is it an expertd server?")
    return sum(float(value) for value in found)


class SyntheticAttention:
    """``attention(layer, micro_batch, x [T_i, H]) -> [T_i, H]`` (module docstring), x's dtype."""

    def __init__(self, layers: list[int], hidden: int, tokens: int, cost_ms: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.scale = {layer: rng.uniform(0.5, 1.5, hidden).astype(np.float32) for layer in layers}
        self.shift = {layer: rng.uniform(-0.1, 0.1, hidden).astype(np.float32) for layer in layers}
        self.seconds_per_token = cost_ms / 1e3 / tokens
        self.busy = 0.0  # seconds spent in calls so far

    def __call__(self, layer: int, micro_batch: int, x: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        out = np.tanh(x.astype(np.float32) * self.scale[layer] + self.shift[layer]).astype(x.dtype)
        left = self.seconds_per_token * len(x) - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        self.busy += time.perf_counter() - start
        return out


def next_input(y: np.ndarray) -> np.ndarray:
    """The next step's hidden states from this step's output ``y [T, H]``: RMS-normalised rows."""
    y32 = y.astype(np.float32)
    return (y32 / np.sqrt(np.mean(y32 * y32, axis=1, keepdims=True) + 1e-6)).astype(y.dtype)


async def decode(target: str, metrics_url: str, *, micro_batches: int, tokens: int, steps: int, warmup: int,
                 attention_ms: float, transport: str, layers: list[int], hidden: int, dtype) -> dict:
    """``warmup`` + ``steps`` decode steps of ``tokens`` tokens with ``micro_batches`` in flight."""
    attention = SyntheticAttention(layers, hidden, tokens, attention_ms)
    x = next_input(np.random.default_rng(1).standard_normal((tokens, hidden)).astype(dtype))
    async with AsyncExpertClient(target, timeout=60) as client, \
            Pipeline(client, layers, transport=transport, timeout=60) as pipeline:
        for _ in range(warmup):
            x = next_input(np.concatenate(await pipeline.run_step(split_micro_batches(x, micro_batches), attention)))
        busy_before, attention.busy = expert_busy_seconds(metrics_url), 0.0
        step_seconds = []
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            x = next_input(np.concatenate(await pipeline.run_step(split_micro_batches(x, micro_batches), attention)))
            step_seconds.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
        expert_busy = expert_busy_seconds(metrics_url) - busy_before
    step_ms = float(np.median(step_seconds) * 1e3)
    return {"micro_batches": micro_batches, "tokens": tokens, "steps": steps, "transport": transport,
            "tokens_per_s": steps * tokens / wall, "step_ms_p50": step_ms,
            "expert_busy_fraction": expert_busy / wall, "attention_busy_fraction": attention.busy / wall,
            # m = 1: what a step spends outside attention, per MoE layer (the layer's whole round trip)
            "layer_round_trip_ms": (wall - attention.busy) / steps / len(layers) * 1e3}


@contextlib.contextmanager
def tiny_server():
    """``expertd serve --preset tiny`` (fp32) on loopback; yields (target, metrics URL); stopped on exit."""
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--preset", "tiny", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--max-queue-delay-ms", "0",
               "--bucket-sizes", "1,4,16,64", "--drain-grace-s", "5"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True)
    reader.start()
    try:
        output, found = [], {}
        while "ready" not in found:
            try:
                line = lines.get(timeout=300)
            except queue.Empty:
                raise TimeoutError("expertd serve not ready after 300 s:\n" + "".join(output)) from None
            output.append(line)
            if match := re.search(r"gRPC listening on (\S+)", line):
                found["target"] = match.group(1)
            if match := re.search(r"metrics on (\S+)", line):
                found["metrics"] = match.group(1)
            if "ready:" in line:
                found["ready"] = True
            if line.startswith("expertd: error") or server.poll() is not None:
                raise RuntimeError("expertd serve failed:\n" + "".join(output))
        yield found["target"], found["metrics"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=5)


def run(target: str, metrics_url: str, args) -> dict:
    with ExpertClient(target, timeout=60) as client:
        info = client.model_info()
    layers = [layer.index for layer in info.layers]
    if args.layers:
        layers = [layers[i % len(layers)] for i in range(args.layers)]  # a deeper model: visit them again
    hidden = info.layers[0].hidden_size
    served = "bfloat16" if info.dtype == expert_pb2.DTYPE_BFLOAT16 else "float32"
    dtype = np.dtype(served if args.dtype == "server" else args.dtype)
    runs = [asyncio.run(decode(target, metrics_url, micro_batches=m, tokens=args.tokens, steps=args.steps,
                               warmup=args.warmup, attention_ms=args.attention_ms, transport=args.transport,
                               layers=layers, hidden=hidden, dtype=dtype))
            for m in args.micro_batches if m <= args.tokens]  # a micro-batch holds one token at least
    return {"target": target, "layers": layers, "hidden": hidden, "dtype": str(dtype),
            "attention_ms_per_layer": args.attention_ms, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="host:port of an expert server (default: start `expertd serve --preset "
                        "tiny` on loopback)")
    parser.add_argument("--metrics", help="the server's /metrics URL (needed with --target)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per decode step, all micro-batches (48)")
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps per m (30)")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before measuring (3)")
    parser.add_argument("--attention-ms", type=float, default=2.0,
                        help="synthetic attention time per MoE layer per step, all micro-batches (2.0)")
    parser.add_argument("--micro-batches", type=lambda s: [int(m) for m in s.split(",")], default=[1, 2, 3],
                        help="values of m, comma-separated (1,2,3)")
    parser.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT)
    parser.add_argument("--layers", type=int, default=0,
                        help="MoE layers per step, cycling through the server's (default: the server's own)")
    parser.add_argument("--dtype", default="server", help="dtype sent: server (its weights' dtype), float32, "
                        "bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if not any(1 <= m <= args.tokens for m in args.micro_batches):
        parser.error(f"--micro-batches needs a value between 1 and --tokens ({args.tokens})")
    if args.target and not args.metrics:
        parser.error("--metrics is needed with --target (the server's /metrics URL)")
    if args.target:
        result = run(args.target, args.metrics, args)
    else:
        with tiny_server() as (target, metrics_url):
            result = run(target, metrics_url, args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{len(result['layers'])} MoE layers, H={result['hidden']}, {result['dtype']}, {args.tokens} tokens a step, "
          f"attention {args.attention_ms} ms per layer, transport {args.transport}")
    print("  m   tokens/s   step ms   expert busy   attention busy   ms/layer outside attention")
    for r in result["runs"]:
        print(f"{r['micro_batches']:>3} {r['tokens_per_s']:>10.0f} {r['step_ms_p50']:>9.2f} "
              f"{r['expert_busy_fraction']:>13.0%} {r['attention_busy_fraction']:>16.0%} "
              f"{r['layer_round_trip_ms']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
