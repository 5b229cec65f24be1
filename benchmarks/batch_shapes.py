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
import datetime
import itertools
import json
import os
import pathlib
import platform
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_floor  # noqa: E402  (the load)

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "batch_shapes.json"
WARMUP_S = 1.0  # python_floor's load warms up this long before it measures


def measure(port_kind: str, callers: int, duration: float, padding_s: float = 0.0,
            max_queue_delay_ms: float | None = None) -> dict:
    """One server with the load on ``port_kind`` ("main" or "native"), each step ``padding_s`` longer;
    ``max_queue_delay_ms``: the batcher's (None: its default)."""
    from prometheus_client import CollectorRegistry

    from expertd.server.app import create_server
    from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig
    from expertd.server.model import load_preset

    port = python_floor.free_port()
    native = port_kind == "native"
    config = ServerConfig(host="127.0.0.1", port=0 if native else port, metrics_port=0,
                          native_port=port if native else None, model=ModelConfig(dtype="float32", num_devices=1),
                          batching=BatchingConfig(bucket_sizes=(1, 16, 64, 256),
                                                  **({} if max_queue_delay_ms is None else
                                                     {"max_queue_delay_ms": max_queue_delay_ms})))
    server = create_server(config, registry=CollectorRegistry(),
                           layers=load_preset("tiny", num_layers=1, dtype="float32"))
    try:
        server.wait_ready(timeout=600)
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
        load = python_floor.measure(port, "Forward", callers, duration)
    finally:
        server.stop()
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
    for round_index in range(args.rounds):
        for port, delay in itertools.product(ports, delays):
            row = measure(port, args.callers, args.duration, args.step_padding_ms / 1e3, delay) | {
                "round": round_index, "max_queue_delay_ms": delay}
            rows.append(row)
            print(f"{port:>6} | {'default' if delay is None else delay:>8} | {row['requests_per_s']:5.0f} | "
                  f"{row['p50_ms']:6.2f} | {row['steps_per_s']:7.0f} | {row['rows_per_step']:9.1f} | "
                  f"{row['one_row_steps']:13.0%} | {row['engine_busy']:11.0%} | "
                  f"{row['on_event_loop']:11.0%} | {row['direct']:.0%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "batch_shapes", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}",
        "duration_s": args.duration, "callers": args.callers, "step_padding_ms": args.step_padding_ms, "rows": rows},
        indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
