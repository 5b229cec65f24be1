"""Overload: what `expertd serve`'s admission keeps of its capacity when offered more than it can serve.

A real server (``create_server`` on loopback, its own thread and event loop in this process, the
default batching and admission settings) serves one ``mid`` layer (Qwen3-MoE style: H 512, I 256,
E 16, k 4, fp32 compute, as in benchmarks/serving.py); the load comes from a separate process
(``--load``: grpc.aio, pre-serialized bf16 requests, one connection) so the two never share a GIL.

1. capacity: closed loop, ``--concurrency`` requests of ``--tokens`` (512) in flight: answered
   requests per second, measured again before each overload phase (this VM drifts between minutes),
   with the cores the server and the load process use.
2. overload: open loop (Poisson arrivals) at 2x and 4x the capacity just measured, for ``--duration`` s,
   every call with a ``--deadline`` (2 s); each load three times, alternating the client's way of
   sending: ``expertd`` as ExpertClient sends requests this large (the admission metadata, and while
   the server pushes back the body held until the call is admitted: ``expertd.client.admission``;
   client-side throttling: ``expertd.client.throttle``, its refusals counted as THROTTLED), ``eager``
   (the metadata, the body at once: refused before the body is read, after it was sent; no
   throttling) and ``bare`` (neither, as a bare gRPC or KServe client: refused once the body is read).
   Reported: goodput (requests answered OK, all within their deadline, per second, over the
   capacity), the share of sent requests answered, p50 / p99 latency of the answered ones,
   RESOURCE_EXHAUSTED share and its latency p50 / p99 (how fast a refusal comes back),
   DEADLINE_EXCEEDED and other codes, and the server's refusals by reason.
3. fairness: one client sends 1-token requests one after the other, alone and then beside a
   stream of 8,192-token requests (two in flight); its p50 / p99 both ways, and the step time of
   a full step (what one step of the other client's work costs), and each side's answered requests
   per second. ``--fairness-only`` runs this phase alone.
4. refusal cost: a server whose one queue place is held refuses every call; each way of sending
   (never throttled: every call reaches the server), alternating: refusals per second and the CPU
   one refused call costs the server and the client.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/overload.py [--quick]

``--quick`` shortens every phase (a smoke run; its numbers are marked quick in the JSON). Results:
a table on stdout and ``benchmarks/results/overload.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import harness
import numpy as np

RESULTS = harness.RESULTS / "overload.json"
FORWARD = "/expertd.v1.ExpertService/Forward"
CLIENTS = ("expertd", "eager", "bare")  # how the load sends its calls (module docstring)


# ---------------------------------------------------------------------- load (its own process)

def _requests(hidden: int, tokens: int, variants: int, seed: int, hint: bool) -> list[tuple[bytes, tuple]]:
    """Serialized ForwardRequests of ``tokens`` bf16 rows (a few different ones), each with the call
    metadata ExpertClient sends with it (``hint``: its admission metadata; else none)."""
    import ml_dtypes

    from expertd.client import admission, codec
    from expertd.client.pb.v1 import expert_pb2

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(variants):
        request = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(
            rng.standard_normal((tokens, hidden), np.float32).astype(ml_dtypes.bfloat16)))
        out.append((request.SerializeToString(), admission.admission_metadata(request) if hint else ()))
    return out


async def _load(spec: dict) -> dict:
    """Run one load phase against ``spec["target"]``; every call as (send offset s, latency s, code).
    ``spec["client"]``: how calls are sent (``expertd``, ``eager`` or ``bare``: module docstring)."""
    import grpc

    from expertd.client import admission
    from expertd.client.throttle import AdaptiveThrottle

    channel = grpc.aio.insecure_channel(spec["target"], options=[("grpc.max_send_message_length", -1),
                                                                 ("grpc.max_receive_message_length", -1)])
    call = channel.unary_unary(FORWARD)
    held = channel.stream_unary(FORWARD)  # bytes in, bytes out, as `call`
    mode = spec.get("client", "expertd")
    pushback = admission.Pushback() if mode == "expertd" else None
    throttle = AdaptiveThrottle() if mode == "expertd" and spec.get("throttle", True) else None
    rng = np.random.default_rng(spec.get("seed", 0))
    results: dict[str, list] = {}

    async def one(stream: str, payload: tuple[bytes, tuple], started: float, timeout: float | None) -> None:
        sent = time.perf_counter()
        if throttle is not None and not throttle.allow():
            results.setdefault(stream, []).append((sent - started, 0.0, "THROTTLED"))
            return
        try:
            if pushback is not None and payload[1] and pushback.active():
                await admission.call_after_admission(held, payload[0], timeout=timeout, metadata=payload[1])
            else:
                await call(payload[0], timeout=timeout, metadata=payload[1])
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
            if pushback is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                pushback.refused()
        if throttle is not None and code != "RESOURCE_EXHAUSTED":
            throttle.accepted()
        results.setdefault(stream, []).append((sent - started, time.perf_counter() - sent, code))

    async def closed(stream: str, payloads: list, concurrency: int, until: float, started: float,
                     timeout: float | None) -> None:
        async def worker(i: int) -> None:
            n = i
            while time.perf_counter() < until:
                await one(stream, payloads[n % len(payloads)], started, timeout)
                n += concurrency
        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    async def opened(stream: str, payloads: list, rate: float, until: float, started: float,
                     timeout: float | None) -> None:
        tasks, next_send, n = set(), time.perf_counter(), 0
        while next_send < until:
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(one(stream, payloads[n % len(payloads)], started, timeout))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            next_send += rng.exponential(1.0 / rate)
        await asyncio.gather(*tasks)

    await channel.channel_ready()
    started, cpu_started = time.perf_counter(), time.process_time()
    until = started + spec["duration"]
    jobs = []
    for stream in spec["streams"]:
        payloads = _requests(spec["hidden"], stream["tokens"], 4, spec.get("seed", 0),
                             spec.get("client", "expertd") != "bare")
        timeout = stream.get("deadline")
        if stream.get("rate"):
            jobs.append(opened(stream["name"], payloads, stream["rate"], until, started, timeout))
        else:
            jobs.append(closed(stream["name"], payloads, stream["concurrency"], until, started, timeout))
    await asyncio.gather(*jobs)
    await channel.close()
    return {"duration": time.perf_counter() - started, "calls": results, "cpu_s": time.process_time() - cpu_started}


def run_load(spec: dict) -> dict:
    """``_load`` in a fresh process (its own interpreter, GIL and gRPC)."""
    done = subprocess.run([sys.executable, __file__, "--load", json.dumps(spec)], capture_output=True, text=True,
                          timeout=spec["duration"] + 120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"load process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


# ---------------------------------------------------------------------- summaries

def percentiles(values, qs=(50, 99)) -> dict:
    if not len(values):
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(np.asarray(values) * 1e3, q)) for q in qs}


def overload_summary(calls: list, duration: float, capacity: float, rate: float, deadline: float) -> dict:
    codes: dict[str, int] = {}
    for _, _, code in calls:
        codes[code] = codes.get(code, 0) + 1
    ok = [latency for _, latency, code in calls if code == "OK"]
    in_time = [latency for latency in ok if latency <= deadline]
    refused = [latency for _, latency, code in calls if code == "RESOURCE_EXHAUSTED"]
    return {
        "offered_per_s": rate, "sent": len(calls), "codes": dict(sorted(codes.items())),
        "goodput_per_s": len(in_time) / duration, "goodput_of_capacity": len(in_time) / duration / capacity,
        "answered_share": len(in_time) / max(len(calls), 1),
        "answered_ms": percentiles(ok), "resource_exhausted_ms": percentiles(refused),
    }


# ---------------------------------------------------------------------- the server side

@contextlib.contextmanager
def mid_server(**batching):
    """(the server, its hidden size): serving.py's ``mid`` layer behind ``BatchingConfig(**batching)``
    (default: ``expertd serve``'s), stopped when the block ends."""
    layers = harness.benchmark_layers("mid")
    with harness.running_server(harness.server_config(batching=batching), layers) as handle:
        yield handle, layers[0].cfg.hidden_size


def server_counters(handle) -> dict:
    registry = handle.registry
    counts = {}
    for family in ("expertd_rejected_requests", "expertd_dropped_requests"):
        for metric in registry.collect():
            if metric.name != family:
                continue
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[f"{family}{{{sample.labels.get('reason')}}}"] = sample.value
    return counts


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases: a smoke run")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per overload request (default 512)")
    parser.add_argument("--deadline", type=float, default=2.0, help="deadline of each overload call, seconds")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each overload phase")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight when measuring capacity")
    parser.add_argument("--fairness-only", action="store_true",
                        help="only phase 3 (to compare scheduling changes; writes --out all the same)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results path")
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps(asyncio.run(_load(json.loads(args.load)))))
        return 0
    duration = 4.0 if args.quick else args.duration
    with mid_server() as (handle, hidden):
        report = {"quick": args.quick, "tokens": args.tokens, "deadline_s": args.deadline, "duration_s": duration,
                  "date": harness.machine.now(utc=True), "machine": harness.machine.processor(),
                  "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
                  "model": "mid (H 512, I 256, E 16, k 4), fp32, bf16 requests",
                  "batching": {k: v for k, v in vars(handle.config.batching).items()}}
        base = {"target": f"127.0.0.1:{handle.port}", "hidden": hidden}
        if not args.fairness_only:
            overload_phases(report, base, args, duration, handle)
        report["fairness"] = fairness_phase(base, args.quick, handle)
    if not args.fairness_only:
        report["refusal_cost"] = refusal_cost_phase(args)
    report["loadavg_after"] = os.getloadavg()
    print_table(report)
    harness.write_json(args.out, report, announce=False)
    return 0


def measure_capacity(base: dict, args) -> dict:
    """Phase 1: answered requests per second of a closed loop of ``--concurrency`` calls in flight,
    and the cores the server (this process's threads; run_load waits on its child) and the load used."""
    server_cpu = time.process_time()
    run = run_load({**base, "duration": 2.0 if args.quick else 5.0, "streams": [
        {"name": "capacity", "tokens": args.tokens, "concurrency": args.concurrency, "deadline": 30.0}]})
    answered = sum(code == "OK" for _, _, code in run["calls"]["capacity"])
    seconds = run["duration"]
    return {"per_s": answered / seconds,
            "cores": {"server": (time.process_time() - server_cpu) / seconds, "load": run["cpu_s"] / seconds}}


def overload_phases(report: dict, base: dict, args, duration: float, handle) -> None:
    """Phases 1 and 2: each overload phase (2x, 4x) at a multiple of the capacity measured just
    before it (this VM's speed drifts between minutes), each load sent the three ways, alternating."""
    report["overload"], capacities = [], []
    for factor, client in ((2, "expertd"), (2, "eager"), (2, "bare"), (4, "bare"), (4, "eager"), (4, "expertd")):
        capacity = measure_capacity(base, args)
        capacities.append(capacity["per_s"])
        before, server_cpu = server_counters(handle), time.process_time()
        run = run_load({**base, "duration": duration, "client": client, "streams": [
            {"name": "open", "tokens": args.tokens, "rate": factor * capacity["per_s"], "deadline": args.deadline}]})
        row = overload_summary(run["calls"]["open"], run["duration"], capacity["per_s"], factor * capacity["per_s"],
                               args.deadline)
        row.update(factor=factor, client=client, capacity=capacity, server=delta(server_counters(handle), before),
                   cores={"server": (time.process_time() - server_cpu) / run["duration"],
                          "load": run["cpu_s"] / run["duration"]})
        report["overload"].append(row)
        time.sleep(args.deadline)  # let the last admitted calls finish
    report["capacity_per_s"] = {"min": min(capacities), "max": max(capacities)}


def fairness_phase(base: dict, quick: bool, handle) -> dict:
    """Phase 3: a closed loop of 1-token requests alone, then beside two 8,192-token requests in
    flight; both sides' latency and answered requests per second (what the small side gains, the
    big side pays)."""
    probes = 50 if quick else 300
    small = {"name": "small", "tokens": 1, "concurrency": 1, "deadline": 30.0}
    alone = run_load({**base, "duration": probes * 0.004 + 1.0, "streams": [small]})["calls"]["small"]
    run = run_load({**base, "duration": probes * 0.02 + 2.0, "streams": [
        small, {"name": "big", "tokens": 8192, "concurrency": 2, "deadline": 60.0}]})
    beside = run["calls"]
    ok_small = [lat for _, lat, code in beside["small"] if code == "OK"]
    ok_big = [lat for _, lat, code in beside.get("big", []) if code == "OK"]
    key = handle.batcher.step_key(handle.model.layers[0], "forward")
    full_bucket = handle.model.bucket_for(handle.model.max_batch_tokens)
    return {
        "alone_ms": percentiles([lat for _, lat, code in alone if code == "OK"]),
        "beside_8192_ms": percentiles(ok_small), "big_ms": percentiles(ok_big),
        "small_per_s": len(ok_small) / run["duration"], "big_per_s": len(ok_big) / run["duration"],
        "full_step_ms": handle.batcher.times.estimate(key, full_bucket) * 1e3,
    }


def refusal_cost_phase(args) -> list[dict]:
    """Phase 4: what one refused call costs each side. A server whose only queue place is held (no
    step runs) refuses every call; a closed loop of 8 calls in flight sends ``--tokens``-row
    requests each of the three ways, alternating, twice: refusals per second, CPU microseconds per
    refused call of the server (this process) and of the load process, refusal latency."""
    import grpc

    from expertd.client import messages
    from expertd.client.pb.v1 import expert_pb2_grpc

    rows = []
    with mid_server(max_queue_size=1, max_queue_delay_ms=600000, inline_step_max_ms=0) as (handle, hidden):
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            holder = expert_pb2_grpc.ExpertServiceStub(channel).Forward.future(
                messages.forward_request(np.ones((2, hidden), np.float32), 0, False), timeout=600)
            while handle.registry.get_sample_value("expertd_pending_requests") != 1:
                time.sleep(0.01)
            for client in CLIENTS * 2:
                server_cpu = time.process_time()
                run = run_load({"target": f"127.0.0.1:{handle.port}", "hidden": hidden, "client": client,
                                "throttle": False,  # every call reaches the server: its cost is measured
                                "duration": 1.0 if args.quick else 3.0, "streams": [
                                    {"name": "refused", "tokens": args.tokens, "concurrency": 8, "deadline": 30.0}]})
                calls = run["calls"]["refused"]
                refused = sum(code == "RESOURCE_EXHAUSTED" for _, _, code in calls)
                rows.append({"client": client, "calls": len(calls), "refused": refused,
                             "per_s": len(calls) / run["duration"],
                             "server_cpu_us": (time.process_time() - server_cpu) / len(calls) * 1e6,
                             "load_cpu_us": run["cpu_s"] / len(calls) * 1e6,
                             "latency_ms": percentiles([lat for _, lat, _ in calls])})
            holder.cancel()
    return rows


def print_table(report: dict) -> None:
    if "capacity_per_s" in report:
        print_overload(report)
    if report.get("refusal_cost"):
        print("refusal cost (every call refused; two rounds each way):")
        print("| client | refused per s | server CPU us / call | load CPU us / call | latency p50 / p99 ms |")
        print("|---|---|---|---|---|")
        for row in sorted(report["refusal_cost"], key=lambda r: CLIENTS.index(r["client"])):
            print(f"| {row['client']} | {row['per_s']:.0f} | {row['server_cpu_us']:.0f} | {row['load_cpu_us']:.0f} | "
                  f"{_ms(row['latency_ms']['p50'])} / {_ms(row['latency_ms']['p99'])} |")
    fair = report["fairness"]
    print(f"fairness: 1-token p50 / p99 alone {_ms(fair['alone_ms']['p50'])} / {_ms(fair['alone_ms']['p99'])} ms, "
          f"beside 8192-token requests {_ms(fair['beside_8192_ms']['p50'])} / {_ms(fair['beside_8192_ms']['p99'])} "
          f"ms; one full step {fair['full_step_ms']:.2f} ms; 8192-token p50 {_ms(fair['big_ms']['p50'])} ms; "
          f"answered per s: 1-token {fair['small_per_s']:.0f}, 8192-token {fair['big_per_s']:.2f}")


def print_overload(report: dict) -> None:
    span = report["capacity_per_s"]
    print(f"capacity: {span['min']:.1f}-{span['max']:.1f} req/s of {report['tokens']} tokens, measured before each "
          "phase" + (" (quick)" if report["quick"] else ""))
    print("| load | client | capacity req/s | sent | goodput / capacity | answered | answered p50 / p99 ms | "
          "RESOURCE_EXHAUSTED | its p50 / p99 ms | THROTTLED | DEADLINE_EXCEEDED | "
          "cores: server / load (at capacity) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in sorted(report["overload"], key=lambda r: (r["factor"], CLIENTS.index(r["client"]))):
        codes, cores, at_capacity = row["codes"], row["cores"], row["capacity"]["cores"]
        ans, ref = row["answered_ms"], row["resource_exhausted_ms"]
        print(f"| {row['factor']}x | {row['client']} | {row['capacity']['per_s']:.1f} | {row['sent']} | "
              f"{row['goodput_of_capacity']:.2f} | {row['answered_share']:.2f} | "
              f"{_ms(ans['p50'])} / {_ms(ans['p99'])} | {codes.get('RESOURCE_EXHAUSTED', 0)} | "
              f"{_ms(ref['p50'])} / {_ms(ref['p99'])} | {codes.get('THROTTLED', 0)} | "
              f"{codes.get('DEADLINE_EXCEEDED', 0)} | "
              f"{cores['server']:.2f} / {cores['load']:.2f} "
              f"({at_capacity['server']:.2f} / {at_capacity['load']:.2f}) |")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    sys.exit(main())
