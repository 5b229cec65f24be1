"""The engine's step cycle around the compiled layer: handing inputs over and reading results back.

One forward step (the batcher's `api.pad_rows`, then `Engine.forward`) is: pad the tokens to the
bucket, hand tokens and `num_valid` to the compiled step, run it, read its four results (output,
ids, weights, tokens per expert) on the host. This times that cycle on the benchmark's ``mid``
layer (the one `serving.py` serves: Qwen3-MoE style, H=512, I=256, E=16, k=4) for a few bucket
sizes, four ways, interleaved in one process so the machine's drift hits all of them alike:

  inputs      host:        the host arrays straight to the compiled step (the engine's way in one
                           process: `MeshPlacement.step_input`; the step places them in C++)
              device_put:  `jax.device_put` of each onto the replicated sharding first
  results     asarray:     `np.asarray` of each result (the engine's way on CPU, where results
                           already sit in host memory)
              device_get:  `jax.device_get` of the results (the engine's way on other platforms)

Also timed alone, on results that are ready: each way of reading results back. Reports the median
per step (us) and the ratio of each way to ``device_put + device_get`` (the engine's cycle before
2026-11-25). Writes benchmarks/results/engine_step.json.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/engine_step.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import harness
import jax
import numpy as np

from expertd.server.engine import api
from expertd.server.engine.build import build_engine
from expertd.server.engine.engine import Engine
from expertd.server.engine.warmup import warm_up

RESULTS = os.path.join(harness.RESULTS, "engine_step.json")
INPUTS = ("host", "device_put")
READS = ("asarray", "device_get")
BASELINE = ("device_put", "device_get")


def forward_executable(engine: Engine, rows: int):
    """Layer 0's compiled forward step for `rows` tokens (warmed up)."""
    return engine.executable(0, harness.bucket_for(engine.buckets, rows), api.FORWARD)


def step_cycle(engine: Engine, rows: int, inputs: str, read: str):
    """A function running one forward step of `rows` tokens the given way; returns its output."""
    step, params = forward_executable(engine, rows), engine.step_params(0)

    def run(x: np.ndarray) -> np.ndarray:
        padded = api.pad_rows([x.astype(engine.dtype)], harness.bucket_for(engine.buckets, rows))
        args = [padded, np.asarray(rows, np.int32)]
        if inputs == "device_put":
            args = [jax.device_put(a, engine.placement.replicated) for a in args]
        results = step(params, *args)
        fetched = [np.asarray(r) for r in results] if read == "asarray" else jax.device_get(tuple(results))
        return fetched[0][:rows]
    return run


@jax.jit
def _packed(results):
    """The step's results as one uint8 buffer (each viewed as bytes, concatenated)."""
    return jax.numpy.concatenate([jax.lax.bitcast_convert_type(r.reshape(-1), jax.numpy.uint8).reshape(-1)
                                  if r.dtype.itemsize > 1 else r.reshape(-1).view(jax.numpy.uint8)
                                  for r in results])


def read_only(engine: Engine, rows: int, read: str, calls: int) -> float:
    """Mean time (us) to read back ready results, over `calls` steps. READS, and "packed": one
    device_get of a single buffer holding the same bytes (what one transfer a step would cost)."""
    step = forward_executable(engine, rows)
    x = api.pad_rows([np.ones((rows, engine.layers[0].cfg.hidden_size), engine.dtype)],
                       harness.bucket_for(engine.buckets, rows))
    total = 0.0
    for _ in range(calls):
        results = jax.block_until_ready(step(engine.step_params(0), x, np.asarray(rows, np.int32)))
        if read == "packed":
            results = jax.block_until_ready(_packed(tuple(results)))
        start = time.perf_counter()
        if read == "asarray":
            [np.asarray(r) for r in results]
        elif read == "packed":
            jax.device_get(results)
        else:
            jax.device_get(tuple(results))
        total += time.perf_counter() - start
    return total / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,256", help="tokens per step (each is a bucket)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default float32, as serving.py)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--calls", type=int, default=20, help="steps per way per round (default 20)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    engine = build_engine(harness.benchmark_layers("mid"), buckets=rows_list, dtype=args.dtype).engine
    warm_up(engine)
    ways = list(itertools.product(INPUTS, READS))
    rng = np.random.default_rng(0)
    table = []
    print(f"{'rows':>5} " + " ".join(f"{i + '+' + r:>22}" for i, r in ways)
          + "   read alone: asarray / device_get / packed")
    for rows in rows_list:
        x = rng.standard_normal((rows, engine.layers[0].cfg.hidden_size), dtype=np.float32)
        runs = {way: step_cycle(engine, rows, *way) for way in ways}
        padded = api.pad_rows([x.astype(engine.dtype)], harness.bucket_for(engine.buckets, rows))
        served = engine.forward(0, padded, rows).output
        for way, run in runs.items():  # every way computes the engine's answer
            np.testing.assert_array_equal(run(x).astype(np.float32), served.astype(np.float32), err_msg=str(way))
        samples = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, run in runs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    run(x)
                samples[way].append((time.perf_counter() - start) / args.calls * 1e6)
        medians = {way: float(np.median(s)) for way, s in samples.items()}
        reads = {read: read_only(engine, rows, read, args.rounds * 5) for read in READS + ("packed",)}
        base = medians[BASELINE]
        table.append({"rows": rows, "step_us": {f"{i}+{r}": m for (i, r), m in medians.items()},
                      "ratio_to_device_put_device_get": {f"{i}+{r}": m / base for (i, r), m in medians.items()},
                      "read_alone_us": reads})
        print(f"{rows:>5} " + " ".join(f"{medians[w]:>9.0f} us ({medians[w] / base:4.2f}x)" for w in ways)
              + f"   {reads['asarray']:.1f} / {reads['device_get']:.1f} / {reads['packed']:.1f} us", flush=True)
    harness.write_results(args.out, "engine_step", table, model="mid (serving.py)", dtype=args.dtype,
                            rounds=args.rounds, calls_per_round=args.calls)


if __name__ == "__main__":
    main()
