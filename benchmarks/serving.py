"""Serving overhead: the in-process engine vs the same work over gRPC on loopback.

For each model (``tiny``, and ``mid``: one Qwen3-MoE-style layer with H=512, I=256, E=16, k=4),
tokens per request T in {1, 16, 256} and concurrent clients C in {1, 64}:

- rpc: a real server (``create_server``, port 0, fp32, buckets 1/16/64/256, default batching) and
  a closed-loop load generator in a separate process (``expertd loadtest``: C requests in flight,
  each ``[T, H]`` fp32 through ``AsyncExpertClient.forward``). Throughput in tokens/s and request
  latency p50 / p99. The measured window is at least 3 rounds of C requests (capped at 60 s).
- in-process: the same engine called directly, one step after the other, with the rows the
  batcher would merge for that load: ``min(C * T, 256)``. Throughput in tokens/s, step time p50 / p99.
- the engine runs where ``JAX_PLATFORMS`` says, on the CPU where it is unset (so a GPU host measures
  its cores unless told ``JAX_PLATFORMS=cuda``); the JSON's ``machine.device`` names it.

- CPU per request in the measured window: the server process's (sampled here) and the load
  generator's (it reports its own), so a run shows which side is the bottleneck.
- the gRPC floor: the same concurrency of ``grpc.health.v1`` Check calls (no model, no batcher)
  against the same server, with the same CPU accounting: what grpc.aio itself costs per call. Its
  load is a raw stub sending a prepared request; single-token Forwards from the same load program
  (a raw Forward stub, one prepared ``[1, H]`` float32 request) run beside it, so the thin-hop
  ratios compare the server's two methods, not two clients.

Reported: rpc / in-process throughput, and the speed-up of 64 single-token clients over one
(goals: >= 0.9 at saturation, i.e. C=64 with T=256; >= 10x for C=64, T=1). The thin hop
(``hop_summary``): single-token Forward p50 minus the in-process step p50 against the Check p50
(goal <= 1.3x), 64 single-token clients' requests/s against 64 Check callers' (goal >= 0.85), both
from the raw-stub load and, beside them, with ``expertd loadtest``'s Forwards (the client library
and the load harness: on a box where the load shares the cores, their CPU per call counts), and
ForwardStream's per-message cost (lock-step round trip; pipelined, 64 in flight on one stream). Beside
it, where one client's single-token call goes, from the server's own histograms read around each
load (means): Forward's handling time and its step in the server, and the Check's handling time.
Both sides share the box, so the client's own CPU time counts against the server: on a 2-core
machine that is a real handicap for the RPC side.

``--native``: the server also serves its native Forward port (``--native-port``), and every
Forward load and Check floor goes to that port (gRPC C++; its Check is gRPC C++'s health service);
ForwardStream, which only the main port serves, is measured there.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/serving.py [--duration 3] [--native]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import harness
import numpy as np

from expertd.server.config import BatchingConfig

RESULTS = harness.RESULTS / "serving.json"
BUCKETS = harness.SERVED_BUCKETS
TOKENS = (1, 16, 256)
CONCURRENCY = (1, 64)


def in_process(engine, layer: int, rows: int, hidden: int, duration: float) -> dict:
    """Steps of ``rows`` tokens back to back on the engine, as the batcher would run them (padded to
    the smallest bucket that fits, then the step)."""
    x = np.random.default_rng(0).standard_normal((rows, hidden), dtype=np.float32).astype(engine.dtype)
    harness.padded_forward(engine, layer, [x])
    steps = []
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        t0 = time.perf_counter()
        harness.padded_forward(engine, layer, [x])
        steps.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    ms = np.asarray(steps) * 1e3
    return {"rows_per_step": rows, "steps": len(steps), "tokens_per_s": rows * len(steps) / elapsed,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


# ForwardStream with single-token messages on one stream: lock-step (send one, read its answer:
# the per-message round trip) and pipelined (up to 64 messages in flight: the per-message cost).
STREAM_SCRIPT = """
import asyncio, json, sys, time
import grpc
import numpy as np
from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

async def main(target, hidden, duration):
    message = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(np.ones((1, hidden), np.float32)))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        call = stub.ForwardStream()
        for _ in range(20):  # warm-up
            await call.write(message)
            await call.read()
        latencies, start = [], time.perf_counter()
        while time.perf_counter() - start < duration:
            t0 = time.perf_counter()
            await call.write(message)
            await call.read()
            latencies.append(time.perf_counter() - t0)
        window = asyncio.Semaphore(64)
        answered = 0
        stop = time.perf_counter() + duration

        async def write():
            while time.perf_counter() < stop:
                await window.acquire()
                await call.write(message)
            await call.done_writing()

        writer = asyncio.ensure_future(write())
        start = time.perf_counter()
        while (response := await call.read()) is not grpc.aio.EOF:
            answered += 1
            window.release()
        elapsed = time.perf_counter() - start
        await writer
        latencies.sort()
        return {"lockstep_p50_ms": latencies[len(latencies) // 2] * 1e3, "lockstep_messages": len(latencies),
                "pipelined_messages_per_s": answered / elapsed, "pipelined_us_per_message": elapsed / answered * 1e6}

print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))))
"""


def with_server_cpu(result: dict, sampler: harness.CpuSampler) -> dict:
    """Adds ``server_cpu_ms_per_request`` over the client's measured window."""
    if result.get("window_unix_s") and result["requests"]:
        seconds = sampler.cpu_between(*result["window_unix_s"])
        result["server_cpu_ms_per_request"] = seconds * 1e3 / result["requests"]
    return result


def server_totals(registry, native: bool = False) -> dict[str, tuple[float, float]]:
    """``{"step": (seconds, steps), method: (seconds, calls)}`` so far, from the server's own
    histograms: its Forward engine steps (``expertd_compute_duration_seconds``) and each gRPC
    method's handling time (``grpc_server_handling_seconds``, e.g. "Forward", "Check"; ``native``:
    Forward's from ``expertd_native_forward_handling_seconds``, the native port's)."""
    totals: dict[str, tuple[float, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if family.name == "expertd_compute_duration_seconds" and sample.labels.get("kind") == "forward":
                key = "step"
            elif native and family.name == "expertd_native_forward_handling_seconds":
                key = "Forward"
            elif family.name == "grpc_server_handling_seconds" and not (native and sample.labels["grpc_method"]
                                                                        == "Forward"):
                key = sample.labels["grpc_method"]
            else:
                continue
            seconds, count = totals.get(key, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                totals[key] = (seconds + sample.value, count)
            elif sample.name.endswith("_count"):
                totals[key] = (seconds, count + sample.value)
    return totals


def server_means(before: dict, after: dict, method: str) -> dict:
    """Mean in-server milliseconds between two ``server_totals``: ``method``'s handling (from its
    request read to its answer) and, for Forward, its engine step."""
    def mean_ms(key: str) -> float | None:
        (s0, c0), (s1, c1) = before.get(key, (0.0, 0.0)), after.get(key, (0.0, 0.0))
        return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
    means = {"server_handling_ms_mean": mean_ms(method)}
    if method == "Forward":
        means["server_step_ms_mean"] = mean_ms("step")
    return means


def unary_load(port: int, method: str, concurrency: int, duration: float, hidden: int = 0, totals=None) -> dict:
    """``method`` ("Check", or "Forward" with single-token ``[1, hidden]`` requests) at ``concurrency``
    against the server from a raw stub (``harness.run_callers``: 1 s of warm-up, then ``duration``),
    in its own process; ``totals``: the server's ``server_totals`` (a zero-argument callable), for
    its in-server means. Requests/s and p50 over the load's window (from its first measured call)."""
    sampler = harness.CpuSampler()
    before = totals() if totals else {}
    with sampler:
        load = harness.run_callers(f"127.0.0.1:{port}", method, concurrency, round(duration, 1), hidden=hidden)
    latencies = sorted(load["latencies_ms"])
    report = {"requests": len(latencies), "requests_per_s": len(latencies) / load["window_s"],
              "p50_ms": latencies[len(latencies) // 2], "window_unix_s": load["window_unix_s"],
              "client_cpu_ms_per_request": load["window_cpu_s"] * 1e3 / len(latencies)}
    if totals:
        report.update(server_means(before, totals(), method))
    return with_server_cpu(report, sampler)


def stream_cost(port: int, hidden: int, duration: float) -> dict:
    """ForwardStream's per-message cost with single-token messages, in its own process."""
    out = subprocess.run([sys.executable, "-c", STREAM_SCRIPT, f"127.0.0.1:{port}", str(hidden), f"{duration:.1f}"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def hop_summary(model: str, rows: list[dict], floor: list[dict], stream: dict) -> dict:
    """The thin-hop ratios (issue 26 item 3), from the raw-stub load (``floor``: Check and Forward
    rows): single-token Forward p50 minus the in-process step p50 over the health Check p50 (goal
    <= 1.3); 64-client single-token Forward requests/s over 64-client Check requests/s (goal >=
    0.85); the same two with ``expertd loadtest``'s Forwards (``rows``) under ``loadtest``;
    ForwardStream's per-message cost beside unary."""
    one = next(r for r in rows if r["model"] == model and r["tokens_per_request"] == 1 and r["clients"] == 1)
    many = next(r for r in rows if r["model"] == model and r["tokens_per_request"] == 1 and r["clients"] == 64)
    check = {f["clients"]: f for f in floor if f["model"] == model and f["method"] == "Check"}
    raw = {f["clients"]: f for f in floor if f["model"] == model and f["method"] == "Forward"}
    step_ms = one["in_process"]["p50_ms"]

    def ratios(forward_1: dict, forward_64: dict) -> dict:
        return {"forward_p50_ms": forward_1["p50_ms"],
                "hop_over_check": (forward_1["p50_ms"] - step_ms) / check[1]["p50_ms"],
                "forward_64_requests_per_s": forward_64["requests_per_s"],
                "throughput_over_check": forward_64["requests_per_s"] / check[64]["requests_per_s"]}

    return {"model": model, "step_p50_ms": step_ms, "check_p50_ms": check[1]["p50_ms"],
            "check_64_requests_per_s": check[64]["requests_per_s"], **ratios(raw[1], raw[64]),
            "loadtest": ratios(one["rpc"], many["rpc"]), "stream": stream,
            # where the single-token call's time goes, from the server's own histograms (means)
            "in_server": {"forward_handling_ms": raw[1].get("server_handling_ms_mean"),
                          "forward_step_ms": raw[1].get("server_step_ms_mean"),
                          "check_handling_ms": check[1].get("server_handling_ms_mean")}}


def print_hop(summary: dict) -> None:
    stream, by_loadtest = summary["stream"], summary["loadtest"]
    print(f"{summary['model']}: hop = Forward p50 {summary['forward_p50_ms']:.3f} - step p50 "
          f"{summary['step_p50_ms']:.3f} = {summary['forward_p50_ms'] - summary['step_p50_ms']:.3f} ms vs Check p50 "
          f"{summary['check_p50_ms']:.3f} ms: {summary['hop_over_check']:.2f}x (goal <= 1.3); 64 clients "
          f"{summary['forward_64_requests_per_s']:.0f} vs Check {summary['check_64_requests_per_s']:.0f} req/s: "
          f"{summary['throughput_over_check']:.2f} (goal >= 0.85); both loads a raw stub", flush=True)
    print(f"{summary['model']}: with expertd loadtest's Forwards: hop {by_loadtest['hop_over_check']:.2f}x, 64 clients "
          f"{by_loadtest['forward_64_requests_per_s']:.0f} req/s: {by_loadtest['throughput_over_check']:.2f}; "
          f"ForwardStream lock-step p50 {stream['lockstep_p50_ms']:.3f} ms, pipelined "
          f"{stream['pipelined_us_per_message']:.0f} us/message", flush=True)
    inside = summary["in_server"]
    if inside["forward_handling_ms"] is not None and inside["forward_step_ms"] is not None:
        check = inside["check_handling_ms"]  # None on the native port: gRPC C++'s health service keeps no histogram
        print(f"{summary['model']}: in the server (one client, means): Forward handled in "
              f"{inside['forward_handling_ms']:.3f} ms, its step {inside['forward_step_ms']:.3f} ms (in-process "
              f"back to back {summary['step_p50_ms']:.3f} ms p50)"
              + ("" if check is None else f"; Check handled in {check:.3f} ms"), flush=True)


def over_rpc(port: int, tokens: int, concurrency: int, duration: float, warmup: float, totals=None) -> dict:
    """``expertd loadtest`` in its own process (its CPU time is not the server's GIL); ``totals``
    as for ``unary_load``."""
    command = [sys.executable, "-c", "import sys; from expertd.client.cli import main; sys.exit(main(sys.argv[1:]))",
               "loadtest", "--target", f"127.0.0.1:{port}", "--layer", "0", "--concurrency", str(concurrency),
               "--tokens", str(tokens), "--dtype", "float32", "--duration", f"{duration:.1f}",
               "--warmup", f"{warmup:.1f}",
               "--timeout", "60", "--json", "--no-progress"]
    sampler = harness.CpuSampler()
    before = totals() if totals else {}
    with sampler:
        report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    step = report["steps"][0]
    means = server_means(before, totals(), "Forward") if totals else {}
    return with_server_cpu({**means,
        "requests": step["ok"], "errors": step["errors"], "tokens_per_s": step["tokens_per_s"],
        "requests_per_s": step["requests_per_s"], "p50_ms": step["latency_ms"]["p50"],
        "p99_ms": step["latency_ms"]["p99"], "window_unix_s": step.get("window_unix_s"),
        "client_cpu_ms_per_request": step.get("client_cpu_ms_per_request")}, sampler)


def run_model(model: str, duration: float, queue_delay_ms: float,
              inline_step_max_ms: float = BatchingConfig.inline_step_max_ms,
              event_loop: str = "auto", native: bool = False) -> tuple[list[dict], list[dict], dict]:
    """(rows, gRPC-floor rows, the thin-hop summary) for one model; ``native``: Forward and Check
    on the native Forward port."""
    config = harness.server_config(event_loop=event_loop, native_port=0 if native else None, batching=dict(
        bucket_sizes=BUCKETS, max_queue_delay_ms=queue_delay_ms, inline_step_max_ms=inline_step_max_ms))
    rows, floor = [], []
    with harness.running_server(config, harness.benchmark_layers(model)) as server:
        totals = functools.partial(server_totals, server.registry, native)
        port = server.native_port if native else server.port
        print(f"{model}: event loop {server.event_loop}" + (f", load on the native port {port}" if native else ""),
              flush=True)
        cfg = server.engine.layers[0].cfg
        stream = stream_cost(server.port, cfg.hidden_size, duration)
        for method in ("Check", "Forward"):  # the raw-stub load: the thin hop's like-for-like pair
            for concurrency in CONCURRENCY:
                floor.append({"model": model, "method": method, "clients": concurrency,
                              **unary_load(port, method, concurrency, duration, cfg.hidden_size, totals)})
                print_floor(floor[-1])
        for tokens in TOKENS:
            for concurrency in CONCURRENCY:
                batch = min(concurrency * tokens, BUCKETS[-1]) if tokens <= BUCKETS[-1] else BUCKETS[-1]
                local = in_process(server.engine, 0, batch, cfg.hidden_size, duration)
                # A closed loop needs a few full rounds of C requests in the window to mean anything.
                round_s = concurrency * tokens / local["tokens_per_s"]
                remote = over_rpc(port, tokens, concurrency, min(max(duration, 3 * round_s), 60.0),
                                  warmup=min(max(1.0, round_s), 20.0), totals=totals)
                rows.append({"model": model, "H": cfg.hidden_size, "E": cfg.num_experts, "k": cfg.topk,
                             "tokens_per_request": tokens, "clients": concurrency, "in_process": local, "rpc": remote,
                             "rpc_over_in_process": remote["tokens_per_s"] / local["tokens_per_s"]})
                print_row(rows[-1])
        hop = hop_summary(model, rows, floor, stream)
        print_hop(hop)
    return rows, floor, hop


def print_row(row: dict) -> None:
    local, remote = row["in_process"], row["rpc"]
    print(f"{row['model']:>5} {row['tokens_per_request']:>4} {row['clients']:>3} | {local['tokens_per_s']:>10.0f} "
          f"{local['p50_ms']:>8.2f} {local['p99_ms']:>8.2f} | {remote['tokens_per_s']:>10.0f} {remote['p50_ms']:>8.2f} "
          f"{remote['p99_ms']:>8.2f} | {row['rpc_over_in_process']:>6.2f} | {_cpu(remote)}", flush=True)


def _cpu(result: dict) -> str:
    server, client = result.get("server_cpu_ms_per_request"), result.get("client_cpu_ms_per_request")
    server, client = (float("nan") if v is None else v for v in (server, client))
    return f"{server:>7.3f} {client:>7.3f}"


def print_floor(row: dict) -> None:
    what = "health Check (gRPC floor)" if row["method"] == "Check" else "Forward T=1 (raw stub)  "
    print(f"{row['model']:>5} {what} {row['clients']:>3} clients: {row['requests_per_s']:>8.0f} req/s, p50 "
          f"{row['p50_ms']:.3f} ms | CPU ms/request server client {_cpu(row)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per cell (default 3)")
    parser.add_argument("--models", default="tiny,mid", help="comma-separated: tiny, mid")
    parser.add_argument("--inline-step-max-ms", type=float, default=BatchingConfig.inline_step_max_ms,
                        help="the server's idle fast path (default: expertd serve's default; 0: off)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results JSON (default: %(default)s)")
    parser.add_argument("--max-queue-delay-ms", type=float, default=BatchingConfig.max_queue_delay_ms,
                        help="the server's batching delay (default: expertd serve's default)")
    parser.add_argument("--event-loop", default="auto", help="the server's event loop (default: expertd serve's)")
    parser.add_argument("--native", action="store_true", help="Forward and Check on the native Forward port")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print("model    T   C |  in-proc tok/s  p50 ms  p99 ms |  rpc tok/s   p50 ms   p99 ms | rpc/in "
          "| CPU ms/req srv cli")
    rows, floor, hops = [], [], []
    for model in args.models.split(","):
        model_rows, model_floor, hop = run_model(model, args.duration, args.max_queue_delay_ms,
                                                 args.inline_step_max_ms, args.event_loop, args.native)
        rows += model_rows
        floor += model_floor
        hops.append(hop)
    speedups = {}
    for model in args.models.split(","):
        single = {r["clients"]: r["rpc"]["tokens_per_s"] for r in rows
                  if r["model"] == model and r["tokens_per_request"] == 1}
        speedups[model] = single[64] / single[1]
        saturated = next(r for r in rows
                         if r["model"] == model and r["tokens_per_request"] == 256 and r["clients"] == 64)
        print(f"{model}: 64 single-token clients = {speedups[model]:.1f}x one client (goal >= 10x); "
              f"at saturation rpc/in-process = {saturated['rpc_over_in_process']:.2f} (goal >= 0.9)")
    harness.write_json(args.out, {
        "benchmark": "serving", "date": harness.machine.today(),
        "machine": {**harness.machine.platform_facts(with_jax=True),
                    "note": "shared development box; compare ratios only"},
        "buckets": list(BUCKETS), "max_queue_delay_ms": args.max_queue_delay_ms, "duration_s": args.duration,
        "inline_step_max_ms": args.inline_step_max_ms, "event_loop": args.event_loop, "native_port": args.native,
        "rows": rows,
        "raw_stub_load": floor,
        "thin_hop": hops,
        "single_token_speedup_64_over_1": speedups,
    }, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
