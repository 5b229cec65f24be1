"""The same-host channel against gRPC: what a call costs beyond the step it asks for (issue 49).

One real server (``create_server`` in this process: port 0, fp32, buckets 1/16/64/256, the
default batching) serves ``tiny`` or ``mid`` (benchmarks/harness/layers.py) on its main port, its
native Forward port (``--native-port``, where it builds) and the same-host channel
(``--shm-channel``); the callers are separate processes (this script with ``--caller``), each a
blocking ``ExpertClient`` in a closed loop.

- echo: one caller's health Checks, p50: the transport's bare round trip, the floor under a call.
- lone: one caller, ``--lone-calls`` Forwards of [T, H] fp32 (T = 1 on tiny, 16 on mid): its p50
  against the server's own step time for the same calls (``expertd_compute_duration_seconds``
  sum / count, read around the load): the ratio the goal bounds (<= 1.25 tiny, <= 1.1 mid).
- saturation: 4 callers x 16 tokens for ``--duration`` s: Forwards/s and the engine's busy
  fraction (step seconds / wall seconds, from the same histogram; goal >= 0.8).

Transports alternate within each round (``--rounds``), so each range spans the box's swings.
JSON in ``benchmarks/results/same_host.json``.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/same_host.py [--models tiny,mid] [--rounds 3]
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

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "same_host.json"
LONE_TOKENS = {"tiny": 1, "mid": 16}
SATURATION_CALLERS, SATURATION_TOKENS = 4, 16


def caller(target: str, hidden: int, tokens: int, calls: int, duration: float) -> None:
    """One closed-loop caller (a process of its own): prints {"latencies_s": [...], "calls": n}.
    ``tokens`` 0: health Checks, the transport's bare round trip (the floor), not Forwards."""
    from expertd.client import ExpertClient

    x = np.random.default_rng(os.getpid()).standard_normal((max(tokens, 1), hidden)).astype(np.float32)
    latencies = []
    with ExpertClient(target, timeout=60) as client:
        call = (lambda: client.forward(x, layer=0)) if tokens else client.health
        for _ in range(20):  # connect, warm the path
            call()
        print("ready", flush=True)
        sys.stdin.readline()  # the benchmark starts every caller at once
        end = time.monotonic() + duration if duration else None
        while (end is None and len(latencies) < calls) or (end is not None and time.monotonic() < end):
            start = time.perf_counter()
            call()
            latencies.append(time.perf_counter() - start)
    print(json.dumps({"latencies_s": latencies if not duration else [], "calls": len(latencies)}), flush=True)


def steps(metrics_port: int) -> tuple[float, float]:
    """(step seconds, steps) of Forward so far, from ``expertd_compute_duration_seconds``."""
    text = _scrape(metrics_port)
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("expertd_compute_duration_seconds_sum") and 'kind="forward"' in line:
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("expertd_compute_duration_seconds_count") and 'kind="forward"' in line:
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def load(server, target: str, hidden: int, tokens: int, callers: int, *, calls: int = 0, duration: float = 0.0):
    """Run ``callers`` caller processes at once; (their results, step seconds, steps, wall seconds)."""
    command = [sys.executable, __file__, "--caller", target, str(hidden), str(tokens), str(calls), str(duration)]
    processes = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for _ in range(callers)]
    try:
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a caller of {target} did not start")
        before, started = steps(server.metrics_port), time.monotonic()
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        results = [json.loads(process.stdout.readline()) for process in processes]
        wall, after = time.monotonic() - started, steps(server.metrics_port)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return results, after[0] - before[0], after[1] - before[1], wall


def targets(server) -> dict[str, str]:
    found = {"grpc": f"127.0.0.1:{server.port}", "shm": f"shm://{server.config.shm_channel}"}
    if server.native_port:
        found["native"] = f"127.0.0.1:{server.native_port}"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lone-calls", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of each saturation load")
    parser.add_argument("--no-native", action="store_true", help="leave the native Forward port out")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    native = not args.no_native
    if native:
        from expertd.server.native_front import NativeUnavailable
        from expertd.server.native_front import load as load_native

        try:
            load_native()
        except (NativeUnavailable, ImportError) as exc:
            print(f"native port: left out: {exc}", flush=True)
            native = False
    rows = []
    for model in args.models.split(","):
        layers = harness.benchmark_layers(model)
        hidden = layers[0].cfg.hidden_size
        config = harness.server_config("float32", native_port=0 if native else None,
                                       shm_channel=f"/tmp/expertd-same-host-{os.getpid()}.sock",
                                       batching=dict(bucket_sizes=harness.SERVED_BUCKETS))
        with harness.running_server(config, layers) as server:
            names = list(targets(server))
            for round_index in range(args.rounds):
                for name in harness.order(names, round_index):
                    target = targets(server)[name]
                    results, _, _, _ = load(server, target, hidden, 0, 1, calls=args.lone_calls)
                    echo = float(np.median(results[0]["latencies_s"]))
                    results, step_s, step_n, _ = load(server, target, hidden, LONE_TOKENS[model], 1,
                                                      calls=args.lone_calls)
                    p50 = float(np.median(results[0]["latencies_s"]))
                    step = step_s / max(step_n, 1)
                    results, step_s, _, wall = load(server, target, hidden, SATURATION_TOKENS, SATURATION_CALLERS,
                                                    duration=args.duration)
                    row = {"model": model, "round": round_index, "transport": name, "echo_p50_ms": echo * 1e3,
                           "lone_tokens": LONE_TOKENS[model],
                           "lone_p50_ms": p50 * 1e3, "lone_step_ms": step * 1e3, "lone_ratio": p50 / step,
                           "saturation_calls_per_s": sum(r["calls"] for r in results) / wall,
                           "saturation_busy": step_s / wall}
                    rows.append(row)
                    print(f"{model:<5} round {round_index} {name:<7} echo {row['echo_p50_ms']:.3f} ms; "
                          f"lone T={row['lone_tokens']}: p50 "
                          f"{row['lone_p50_ms']:.3f} ms, step {row['lone_step_ms']:.3f} ms, ratio "
                          f"{row['lone_ratio']:.2f} | 4x16: {row['saturation_calls_per_s']:.0f} calls/s, engine busy "
                          f"{row['saturation_busy']:.2f}", flush=True)
    summary = []
    for model in args.models.split(","):
        for name in ("grpc", "native", "shm"):
            mine = [r for r in rows if r["model"] == model and r["transport"] == name]
            if mine:
                summary.append({"model": model, "transport": name,
                                 "echo_p50_ms": harness.span(r["echo_p50_ms"] for r in mine),
                                 "lone_p50_ms": harness.span(r["lone_p50_ms"] for r in mine),
                                 "lone_step_ms": harness.span(r["lone_step_ms"] for r in mine),
                                 "lone_ratio": harness.span(r["lone_ratio"] for r in mine),
                                 "saturation_calls_per_s": harness.span((r["saturation_calls_per_s"] for r in mine), 0),
                                 "saturation_busy": harness.span(r["saturation_busy"] for r in mine)})
    harness.print_table("same-host channel vs gRPC (ranges over rounds)", summary, list(summary[0]))
    harness.write_results(args.out, "same_host", rows, summary=summary, rounds=args.rounds,
                          lone_calls=args.lone_calls, duration_s=args.duration)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--caller":
        target, hidden, tokens, calls, duration = sys.argv[2:7]
        caller(target, int(hidden), int(tokens), int(calls), float(duration))
    else:
        sys.exit(main())
