"""Same-host zero copy: Forward with hidden states and output in shared memory vs the copy path.

One layer with H = 7168 (DeepSeek-V3's hidden size) in bfloat16 and a deliberately small expert
(E = 8, k = 2, I = 64), so that the transport, not the experts, dominates; tokens per request T in
{16, 256, 4096}. A real server (``create_server``, loopback, buckets = the T values) and, in a
separate process, one blocking ``ExpertClient`` calling back to back:

- copy: ``client.forward(x, layer=0)`` (x travels in the request, y in the response);
- shm: x written into a registered region (timed: the caller must put its activations there),
  ``client.forward(inp, layer=0, out=out)``; the output is read in place.
- in-process: the engine step alone for the same T (what neither path can save).

Reported per T: p50 / p99 ms of each, the copy path's overhead over the step and the shm path's,
and shm / copy. Results go to benchmarks/results/shm.json (full mode only).

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/shm.py [--iterations 50]
    .venv/bin/python benchmarks/shm.py --short      # proves it runs: T in {16, 256}, 3 calls each
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import harness
import numpy as np

RESULTS = harness.RESULTS / "shm.json"
HIDDEN = 7168
TOKENS = (16, 256, 4096)
HF_CONFIG = {  # one MoE layer with DeepSeek-V3's H and a tiny expert: the hop, not the FLOPs
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": HIDDEN,
    "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 1, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu",
}


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "calls": len(seconds)}


def client_main(port: int, tokens: list[int], iterations: int) -> dict:
    """The client process: each T over the copy path, then over shared memory."""
    import ml_dtypes

    from expertd.client import ExpertClient
    from expertd.client.shared_memory import SharedMemoryRegion

    results = {}
    with ExpertClient(f"127.0.0.1:{port}", timeout=120) as client:
        for t in tokens:
            x = np.random.default_rng(t).standard_normal((t, HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16)
            copy, shm = [], []
            expected = client.forward(x, layer=0)  # warm-up
            for _ in range(iterations):
                start = time.perf_counter()
                client.forward(x, layer=0)
                copy.append(time.perf_counter() - start)
            with SharedMemoryRegion(f"bench-{t}", 2 * x.nbytes) as region:
                client.register_shared_memory(region)
                inp, out = region.tensor(0, x.dtype, x.shape), region.tensor(x.nbytes, x.dtype, x.shape)
                inp.array[...] = x
                np.testing.assert_array_equal(client.forward(inp, layer=0, out=out), expected)
                for _ in range(iterations):
                    start = time.perf_counter()
                    inp.array[...] = x
                    client.forward(inp, layer=0, out=out)
                    shm.append(time.perf_counter() - start)
                client.unregister_shared_memory(region.name)
                del inp, out
            results[str(t)] = {"copy": percentiles(copy), "shm": percentiles(shm)}
    return results


def in_process(engine, tokens: int, iterations: int) -> dict:
    import ml_dtypes

    x = np.random.default_rng(tokens).standard_normal((tokens, HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16)
    engine.forward(0, x, tokens)
    steps = []
    for _ in range(iterations):
        start = time.perf_counter()
        engine.forward(0, x, tokens)
        steps.append(time.perf_counter() - start)
    return percentiles(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=50, help="calls per path and T (default 50)")
    parser.add_argument("--short", action="store_true", help="T in {16, 256}, 3 calls each; nothing recorded")
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens = [16, 256] if args.short else [int(t) for t in args.tokens.split(",")]
    iterations = 3 if args.short else args.iterations
    if args.client:
        print(json.dumps(client_main(args.client, tokens, iterations)))
        return 0

    config = harness.server_config("bfloat16", batching=dict(bucket_sizes=tuple(tokens), max_queue_delay_ms=0.0,
                                                             max_request_tokens=max(tokens)))
    with harness.running_server(config, harness.seeded_layers(HF_CONFIG, "bfloat16")) as server:
        command = [sys.executable, __file__, "--client", str(server.port), "--tokens", ",".join(map(str, tokens)),
                   "--iterations", str(iterations)]
        remote = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        rows = []
        print(f"{'T':>5} | {'step p50':>9} | {'copy p50':>9} {'p99':>8} | {'shm p50':>9} {'p99':>8} | "
              f"{'copy-step':>9} {'shm-step':>9} | shm/copy")
        for t in tokens:
            step = in_process(server.engine, t, iterations)
            copy, shm = remote[str(t)]["copy"], remote[str(t)]["shm"]
            row = {"T": t, "H": HIDDEN, "dtype": "bfloat16", "request_mb": t * HIDDEN * 2 / 1e6, "step": step,
                   "copy": copy, "shm": shm, "shm_over_copy": shm["p50_ms"] / copy["p50_ms"]}
            rows.append(row)
            print(f"{t:>5} | {step['p50_ms']:>9.3f} | {copy['p50_ms']:>9.3f} {copy['p99_ms']:>8.3f} | "
                  f"{shm['p50_ms']:>9.3f} {shm['p99_ms']:>8.3f} | {copy['p50_ms'] - step['p50_ms']:>9.3f} "
                  f"{shm['p50_ms'] - step['p50_ms']:>9.3f} | {row['shm_over_copy']:.2f}", flush=True)
    if not args.short:
        harness.write_json(RESULTS, {
            "when": harness.machine.now(utc=True),
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
            "iterations": iterations, "rows": rows}, indent=2, announce=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
