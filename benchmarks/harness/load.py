"""The raw-stub load: C callers of one unary method on one grpc.aio channel, each sending a prepared
request (a health Check, or a single-token Forward ``[1, H]`` float32 through a raw stub, so no
client library's cost is in it), in processes of their own (their CPU is not the server's).

A load process warms up for ``warmup`` s, then measures ``duration`` s; it reports every call,
the measured calls' latencies, the measured window (from the first measured call) and its own CPU
(in the window, and by thread over the whole load where there is ``/proc``). ``run_callers`` runs
one process and returns that report; ``measure_load`` splits C callers over several processes that
start together and sums them up (python_floor.py's and batch_shapes.py's rows).

A load process runs ``main`` (``start_callers`` gives the command): its one argument is the
spec as JSON, and it prints its report as JSON.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

from harness.cpu_time import spent, thread_cpu_s

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
LOAD_START_S = 3.0
"""Several load processes start their callers together this long after being launched (more than
their imports take)."""


async def callers(target: str, method: str, concurrency: int, warmup: float, duration: float, hidden: int = 64,
                  start_at: float | None = None) -> dict:
    """``concurrency`` callers of ``method`` (from ``start_at``, a ``time.time()``, where given) for
    ``warmup`` then ``duration`` seconds: the report (module docstring)."""
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from expertd.client import codec
    from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        if method == "Check":
            call, request = health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()
        else:
            call = expert_pb2_grpc.ExpertServiceStub(channel).Forward
            request = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(np.ones((1, hidden), np.float32)))
        if start_at is not None:  # several load processes begin together
            await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu_before, start = thread_cpu_s(os.getpid()), time.perf_counter()
        measured_from, stop = start + warmup, start + warmup + duration
        latencies: list[float] = []
        window: dict[str, float] = {}
        calls = 0

        async def caller() -> None:
            nonlocal calls
            while (now := time.perf_counter()) < stop:
                await call(request)
                calls += 1
                if now >= measured_from:
                    if not window:  # the first measured call opens the window
                        window.update(t=now, wall=time.time(), cpu=time.process_time())
                    latencies.append(time.perf_counter() - now)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        if window:
            window.update(seconds=time.perf_counter() - window["t"], unix=[window["wall"], time.time()],
                          cpu_s=time.process_time() - window["cpu"])
    wall = time.perf_counter() - start
    used = spent(cpu_before, thread_cpu_s(os.getpid()))
    result = {"calls": calls, "latencies_ms": [round(t * 1e3, 4) for t in latencies],
              "window_s": window.get("seconds"), "window_unix_s": window.get("unix"),
              "window_cpu_s": window.get("cpu_s")}
    if used:  # the load's own CPU: is the load, not the server, what stops the rate?
        busiest = max(used, key=used.get)
        result |= {"load_cpu_us_per_call": round(sum(used.values()) / calls * 1e6, 1),
                   "load_busiest_thread": {"name": busiest, "busy": round(used[busiest] / wall, 3)}}
    return result


def start_callers(target: str, method: str, concurrency: int, duration: float, *, warmup: float = 1.0,
                  hidden: int = 64, start_at: float | None = None) -> subprocess.Popen:
    """A load process (``callers``), started; ``finish`` reads its report."""
    spec = {"target": target, "method": method, "concurrency": concurrency, "warmup": warmup, "duration": duration,
            "hidden": hidden, "start_at": start_at}
    return subprocess.Popen([sys.executable, "-c", "import sys; from harness.load import main; main(sys.argv[1])",
                             json.dumps(spec)], cwd=BENCHMARKS, stdout=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float, what: str = "a load") -> dict:
    """The report of a load process from ``start_callers``; RuntimeError where it failed."""
    out, _ = process.communicate(timeout=timeout)
    if process.returncode:
        raise RuntimeError(f"{what} process failed ({process.returncode})")
    return json.loads(out)


def run_callers(target: str, method: str, concurrency: int, duration: float, *, warmup: float = 1.0,
                hidden: int = 64) -> dict:
    """One load process's report (module docstring)."""
    process = start_callers(target, method, concurrency, duration, warmup=warmup, hidden=hidden)
    return finish(process, duration + warmup + 120, f"a {method} load")


def measure_load(port: int, method: str, concurrency: int, duration: float, server_pid: int | None = None,
                 processes: int = 1, hidden: int = 64) -> dict:
    """The load on 127.0.0.1:``port`` (1 s of warm-up), the callers split evenly over ``processes``
    load processes (fewer where there are fewer callers) that start together: requests/s and p50
    over all of them, their CPU per call and busiest thread; with ``server_pid``, the server's CPU
    per call meanwhile (in all and by thread, microseconds)."""
    processes = max(1, min(processes, concurrency))
    before = thread_cpu_s(server_pid) if server_pid else {}
    start_at = time.time() + LOAD_START_S if processes > 1 else None
    loads = [start_callers(f"127.0.0.1:{port}", method, concurrency // processes + (i < concurrency % processes),
                           duration, hidden=hidden, start_at=start_at) for i in range(processes)]
    parts = [finish(load, duration + 120, f"a {method} load") for load in loads]
    latencies = sorted(t for part in parts for t in part["latencies_ms"])
    result = {"requests_per_s": len(latencies) / duration, "p50_ms": latencies[len(latencies) // 2],
              "calls": sum(part["calls"] for part in parts), "load_processes": processes}
    if all("load_cpu_us_per_call" in part for part in parts):
        result |= {"load_cpu_us_per_call": round(sum(part["load_cpu_us_per_call"] * part["calls"] for part in parts)
                                                 / result["calls"], 1),
                   "load_busiest_thread": max((part["load_busiest_thread"] for part in parts),
                                              key=lambda thread: thread["busy"])}
    if before:
        used = spent(before, thread_cpu_s(server_pid))
        per_call = {name: round(seconds / result["calls"] * 1e6, 1) for name, seconds in used.items() if seconds > 0}
        result |= {"server_cpu_us_per_call": round(sum(per_call.values()), 1), "server_cpu_by_thread": per_call}
    return result


def main(spec: str) -> None:
    """A load process: ``callers`` as the JSON ``spec`` says; its report printed as JSON."""
    spec = json.loads(spec)
    print(json.dumps(asyncio.run(callers(spec["target"], spec["method"], spec["concurrency"], spec["warmup"],
                                         spec["duration"], spec["hidden"], spec["start_at"]))))
