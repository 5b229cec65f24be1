"""How a closed-loop load is cut into engine steps, on the main port and on the native Forward port.

The real server runs in this process (``create_server``: serving.py's ``tiny`` layer, fp32, buckets
1/16/64/256, default batching) with its engine's ``forward`` wrapped to record each step: its valid
rows, its bucket, its seconds and the thread that ran it. The load is python_floor.py's (C callers
on one channel, a raw stub, one single-token request each, in a process of its own). Over the
measured window: requests/s and p50, steps/s, rows per step, the share of one-row steps, the
engine's busy share (step seconds over the window) and the steps run on the event loop (the idle
fast path) or directly (the native port's direct path: a gRPC thread, or its runner thread)
against the device thread. Ports
alternate over ``--rounds``, and within them the batcher's ``--max-queue-delay-ms`` values (a
comma-separated list; default: the server's). ``--step-padding-ms`` makes every step that much
longer (spinning), as a slower device's would be (a single-token step on the H100 took
0.65-0.74 ms against the host CPU's 0.25).

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/batch_shapes.py [--callers 64] [--rounds 3]

JSON in benchmarks/results/batch_shapes.json.
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import threading
import time

import harness

os.environ.setdefault("JAX_PLATFORMS", "cpu")
RESULTS = harness.RESULTS / "batch_shapes.json"
WARMUP_S = 1.0  # harness.measure_load warms up this long before it measures


def measure(port_kind: str, callers: int, duration: float, padding_s: float = 0.0,
            max_queue_delay_ms: float | None = None) -> dict:
    """One server with the load on ``port_kind`` ("main" or "native"), each step ``padding_s`` longer;
    ``max_queue_delay_ms``: the batcher's (None: its default)."""
    port = harness.free_port()
    native = port_kind == "native"
    config = harness.server_config(port=0 if native else port, native_port=port if native else None, batching=dict(
        bucket_sizes=harness.SERVED_BUCKETS,
        **({} if max_queue_delay_ms is None else {"max_queue_delay_ms": max_queue_delay_ms})))
    with harness.running_server(config, harness.tiny_layers(), timeout=600, grace=None) as server:
        engine, steps = server.engine, []
        forward = engine.forward

        def recording(layer, tokens, num_valid, **options):
            start = time.perf_counter()
            try:
                return forward(layer, tokens, num_valid, **options)
            finally:
                padded_until = time.perf_counter() + padding_s
                while time.perf_counter() < padded_until:
                    pass
                steps.append((start, time.perf_counter() - start, num_valid, len(tokens),
                              threading.current_thread().name))

        engine.forward = recording
        launched = time.perf_counter()
        load = harness.measure_load(port, "Forward", callers, duration)
    window = [s for s in steps if s[0] >= launched + WARMUP_S]
    span = max(s[0] + s[1] for s in window) - min(s[0] for s in window)
    return {"port": port_kind, "callers": callers, "requests_per_s": load["requests_per_s"],
            "p50_ms": load["p50_ms"], "steps_per_s": len(window) / span,
            "rows_per_step": sum(s[2] for s in window) / len(window),
            "one_row_steps": sum(s[2] == 1 for s in window) / len(window),
            "engine_busy": sum(s[1] for s in window) / span,
            "on_event_loop": sum(s[4] == "expertd-grpc" for s in window) / len(window),
            # a thread Python did not start: the native port's gRPC thread (its direct path)
            "direct": sum(s[4].startswith("Dummy-") for s in window) / len(window),
            "buckets": dict(collections.Counter(s[3] for s in window))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", default="main,native", help="comma-separated: main, native")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per load (after 1 s warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-padding-ms", type=float, default=0.0, help="make every step this much longer")
    parser.add_argument("--max-queue-delay-ms", default="",
                        help="comma-separated batcher queue delays, alternated within each round (default: "
                             "the server's)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.max_queue_delay_ms.split(",")] if args.max_queue_delay_ms else [None]
    ports = args.ports.split(",")
    if unknown := set(ports) - {"main", "native"}:
        parser.error(f"--ports: unknown {', '.join(sorted(unknown))}; expected main and / or native")
    rows = []
    print(f"{'port':>6} | delay ms | req/s | p50 ms | steps/s | rows/step | one-row steps | engine busy | "
          "on the loop | direct", flush=True)
    for round_index, port, delay in harness.alternate(args.rounds, ports, delays):
        row = measure(port, args.callers, args.duration, args.step_padding_ms / 1e3, delay) | {
            "round": round_index, "max_queue_delay_ms": delay}
        rows.append(row)
        print(f"{port:>6} | {'default' if delay is None else delay:>8} | {row['requests_per_s']:5.0f} | "
              f"{row['p50_ms']:6.2f} | {row['steps_per_s']:7.0f} | {row['rows_per_step']:9.1f} | "
              f"{row['one_row_steps']:13.0%} | {row['engine_busy']:11.0%} | "
              f"{row['on_event_loop']:11.0%} | {row['direct']:.0%}", flush=True)
    harness.write_json(args.out, {
        "benchmark": "batch_shapes", "date": harness.machine.now(), "machine": harness.machine.summary(),
        "duration_s": args.duration, "callers": args.callers, "step_padding_ms": args.step_padding_ms, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
