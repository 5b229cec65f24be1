"""The thin hop's floor in Python: expertd's server against the least a Python gRPC tensor handler does,
and against its native Forward port.

Issue 26's thin-hop goals compare a single-token Forward with a bare ``grpc.health.v1`` Check on
the same server: Forward p50 minus the step's over the Check p50 (goal <= 1.3) and 64 callers'
Forward requests/s over their Check requests/s (goal >= 0.85). This runs the same two ratios
against three servers, each in its own process, all on grpc.aio with uvloop and the same engine
(serving.py's ``tiny`` layer, fp32, buckets 1/16/64/256):

- ``expertd``: the real server (``create_server``, default settings).
- ``bare``: a Forward handler that only decodes the tensor, checks it for NaN / Inf, runs the
  engine step inline on the event loop and encodes the answer: no admission, batching, metrics,
  interceptors, auth or error mapping.
- ``bare-batched``: the same, with the requests of one loop turn merged into one inline step.
- ``expertd-native``: the real server's native Forward port (``--native-port``; the load, Check
  included, goes to that port): gRPC C++ checks and queues each Forward, Python runs once per batch
  through the same batcher (``expertd.server.native_front``; built on first use with the system's
  libgrpc++, left out with the reason where it cannot be built); a lone call that finds the
  server idle is computed on its gRPC thread (``--native-direct``).
- ``expertd-native-queued``: the same with ``--no-native-direct``: every call goes through the
  event loop.
- ``native-echo``: the native port's C++ (the same checks, queue and direct runner) whose direct
  callable answers each batch with its own rows: the GIL and one Python call a batch, no step, no
  batcher. Not a server: the 64-caller rate the native port would reach if its step and
  bookkeeping cost nothing on this host, so the ceiling of any step-side change.

Load: one process per measurement, C callers on one channel sending a prepared request (a raw stub
for Forward, so no client library's cost is in it), warm-up then ``--duration`` s; with
``--load-processes`` P, the 64 callers are split over P such processes that start together. Servers and
rounds alternate; the table gives each server's range over ``--rounds``. Each load also records
the server's CPU per call (``server_cpu_us_per_call``, and by thread name, from ``/proc`` where
there is one): the whole load's, warm-up included, over all its calls; and the load's own
(``load_cpu_us_per_call``, and ``load_busiest_thread``: its name and the share of the load's wall
time it ran), which says whether the load itself is the ceiling. The in-process step is timed back
to back (what the hop subtracts) and after IDLE_GAP_S of sleep, as a lone caller's step follows its
last answer (``hop_over_check_idle_step`` subtracts that one instead): on the 2-vCPU VM the second
is the slower. ``--cpu-sync-dispatch``: the servers and the in-process step run their CPU steps on
the calling thread, as ``expertd serve --cpu-sync-dispatch``. ``--cpu-latency-qos on`` holds a
PM QoS request of 0 us on ``/dev/cpu_dma_latency`` (root) while it measures, so the kernel keeps
idle CPUs polling instead of halting them (what tuned's ``latency-performance`` profile does);
``ab`` measures each round both ways, idle states allowed first; rows say which
(``cpu_latency_qos``). It covers the whole machine: servers, load and the in-process step alike.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/python_floor.py [--rounds 3] [--duration 4]

JSON in benchmarks/results/python_floor.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import pathlib
import platform
import socket
import struct
import subprocess
import sys
import threading
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "python_floor.json"
BUCKETS = (1, 16, 64, 256)
SERVERS = ("expertd", "bare", "bare-batched", "expertd-native", "expertd-native-queued", "native-echo")
NATIVE = ("expertd-native", "expertd-native-queued", "native-echo")
LOAD_START_S = 3.0
"""Several load processes start their callers together this long after being launched (more than
their imports take)."""
IDLE_GAP_S = 0.0005  # about a lone caller's round trip: the gap before each of its steps
CPU_LATENCY_QOS = pathlib.Path("/dev/cpu_dma_latency")  # PM QoS: what the CPUs' idle states may cost


# ---------------------------------------------------------------------- the servers

def _engine():
    """serving.py's ``tiny`` layer on one CPU device, every bucket compiled."""
    import numpy as np

    from expertd.server.model import load_preset
    from expertd.server.startup import build_engine

    engine = build_engine(load_preset("tiny", num_layers=1, dtype="float32"), buckets=BUCKETS, dtype="float32",
                          devices=1).engine
    hidden = engine.layers[0].cfg.hidden_size
    for bucket in BUCKETS:
        engine.forward(0, np.zeros((bucket, hidden), np.float32), 1)
    return engine, hidden


def engine_step(engine, parts: list):
    """The layer's float32 output [rows, H] for the rows of ``parts`` (each float32 [T_i, H]), run as
    one step padded to the smallest bucket that holds them."""
    import numpy as np

    from expertd.server.steps import pad_rows

    rows = sum(len(x) for x in parts)
    bucket = next(b for b in BUCKETS if b >= rows)
    return np.asarray(engine.forward(0, pad_rows(parts, bucket), rows).output)[:rows]


async def _serve_bare(port: int, batched: bool) -> None:
    import grpc
    import numpy as np
    from grpc_health.v1 import health, health_pb2_grpc

    from expertd.client import codec
    from expertd.client.pb.v1 import expert_pb2

    engine, hidden = _engine()
    pending: list[tuple[np.ndarray, asyncio.Future]] = []
    wakeup = asyncio.Event()

    async def merge() -> None:  # bare-batched: one inline step for the requests of one loop turn
        while True:
            await wakeup.wait()
            wakeup.clear()
            await asyncio.sleep(0)
            while pending:
                batch, rows = [], 0
                while pending and rows + len(pending[0][0]) <= BUCKETS[-1]:
                    batch.append(pending.pop(0))
                    rows += len(batch[-1][0])
                output, start = engine_step(engine, [x for x, _ in batch]), 0
                for x, future in batch:
                    future.set_result(output[start:start + len(x)])
                    start += len(x)

    async def forward(request, context):
        x = np.frombuffer(request.hidden_states.data, np.float32).reshape(-1, hidden)
        if not np.isfinite(x).all():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hidden_states contains NaN or Inf")
        if batched:
            future = asyncio.get_running_loop().create_future()
            pending.append((x, future))
            wakeup.set()
            y = await future
        else:
            y = engine_step(engine, [x])
        return expert_pb2.ForwardResponse(request_id=request.request_id, output=codec.encode(y))

    merger = asyncio.ensure_future(merge()) if batched else None
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("expertd.v1.ExpertService", {
        "Forward": grpc.unary_unary_rpc_method_handler(
            forward, request_deserializer=expert_pb2.ForwardRequest.FromString,
            response_serializer=expert_pb2.ForwardResponse.SerializeToString)}),))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        if merger is not None:
            merger.cancel()


def _serve_expertd(port: int, native: bool = False, direct: bool = True) -> None:
    """The real server; ``native``: its native Forward port on ``port`` (the main port on a free one),
    ``direct``: with ``--native-direct``."""
    from prometheus_client import CollectorRegistry

    from expertd.server.app import create_server
    from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig
    from expertd.server.model import load_preset

    config = ServerConfig(host="127.0.0.1", port=0 if native else port, metrics_port=0,
                          native_port=port if native else None, native_direct=direct,
                          model=ModelConfig(dtype="float32", num_devices=1),
                          batching=BatchingConfig(bucket_sizes=BUCKETS))
    server = create_server(config, registry=CollectorRegistry(), layers=load_preset("tiny", num_layers=1,
                                                                                    dtype="float32"))
    server.wait_ready(timeout=600)
    print("ready", flush=True)
    server.wait()


def _serve_native_echo(port: int) -> None:
    """``native-echo`` (module docstring): the native port's module with a direct callable that answers
    each batch with its own rows, on the calling gRPC or runner thread."""
    import numpy as np

    from expertd.client import codec
    from expertd.client.pb.v1.expert_pb2 import GetModelInfoResponse
    from expertd.server.metrics import LATENCY_BUCKETS
    from expertd.server.native_front import load

    module = load()
    handle, _, _ = module.start(f"127.0.0.1:{port}", {0: 64}, 256, 256, 1 << 20, 1 << 16, 64 << 20,
                                GetModelInfoResponse().SerializeToString(), None, None, LATENCY_BUCKETS, "starting")

    def echo(batch: int, layer: int, dtype: int, rows: bytes, token_ids, remaining_s) -> None:
        module.finish(handle, batch, np.frombuffer(rows, codec.numpy_dtype(dtype)))

    module.set_direct(handle, echo)
    module.set_accepting(handle, True, "")
    print("ready", flush=True)
    threading.Event().wait()


def serve(kind: str, port: int, cpu_sync_dispatch: bool = False) -> None:
    """Run server ``kind`` on ``port`` until killed (the ``--serve`` entry point), its engine's CPU steps
    on the calling thread where ``cpu_sync_dispatch`` (``expertd serve --cpu-sync-dispatch``)."""
    from expertd.server.process import configure_cpu_dispatch

    configure_cpu_dispatch(asynchronous=not cpu_sync_dispatch)
    if kind == "native-echo":
        _serve_native_echo(port)
        return
    if kind in ("expertd", *NATIVE):
        _serve_expertd(port, native=kind in NATIVE, direct=kind != "expertd-native-queued")
        return
    import uvloop

    uvloop.run(_serve_bare(port, batched=kind == "bare-batched"))


# ---------------------------------------------------------------------- the load

async def _load(target: str, method: str, concurrency: int, warmup: float, duration: float,
                start_at: float | None = None) -> dict:
    """``concurrency`` callers of ``method`` (from ``start_at``, a ``time.time()``, where given) for
    ``warmup`` then ``duration`` seconds: {calls, latencies_ms of the measured ones, the load's CPU}."""
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
            request = expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(np.ones((1, 64), np.float32)))
        if start_at is not None:  # several load processes begin together
            await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu_before, start = thread_cpu_s(os.getpid()), time.perf_counter()
        measured_from, stop = start + warmup, start + warmup + duration
        latencies: list[float] = []

        calls = 0

        async def caller() -> None:
            nonlocal calls
            while (now := time.perf_counter()) < stop:
                await call(request)
                calls += 1
                if now >= measured_from:
                    latencies.append(time.perf_counter() - now)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    spent = {name: seconds - cpu_before.get(name, 0.0) for name, seconds in thread_cpu_s(os.getpid()).items()}
    result = {"calls": calls, "latencies_ms": [round(t * 1e3, 4) for t in latencies]}
    if spent:  # the load's own CPU: is the load, not the server, what stops the rate?
        busiest = max(spent, key=spent.get)
        result |= {"load_cpu_us_per_call": round(sum(spent.values()) / calls * 1e6, 1),
                   "load_busiest_thread": {"name": busiest, "busy": round(spent[busiest] / wall, 3)}}
    return result


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process ``pid``'s threads, summed by thread name with digits
    dropped (pool threads share one name); empty where there is no ``/proc``."""
    tasks, tick, cpu = pathlib.Path(f"/proc/{pid}/task"), os.sysconf("SC_CLK_TCK"), {}
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = "".join(c for c in stat[stat.index("(") + 1:stat.rindex(")")] if not c.isdigit()).strip("-_ ")
        fields = stat[stat.rindex(")") + 2:].split()
        cpu[name] = cpu.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return cpu


def measure(port: int, method: str, concurrency: int, duration: float, server_pid: int | None = None,
            processes: int = 1) -> dict:
    """``_load`` in processes of its own (their CPU is not the server's), the callers split evenly
    over ``processes`` of them (fewer where there are fewer callers); with ``server_pid``, the
    server's CPU per call meanwhile (in all and by thread, microseconds)."""
    processes = max(1, min(processes, concurrency))
    before = thread_cpu_s(server_pid) if server_pid else {}
    start_at = [str(time.time() + LOAD_START_S)] if processes > 1 else []
    loads = [subprocess.Popen([sys.executable, __file__, "--load", f"127.0.0.1:{port}", method,
                               str(concurrency // processes + (i < concurrency % processes)), str(duration),
                               *start_at], stdout=subprocess.PIPE, text=True) for i in range(processes)]
    parts = []
    for load in loads:
        out, _ = load.communicate(timeout=duration + 120)
        if load.returncode:
            raise RuntimeError(f"a {method} load process failed ({load.returncode})")
        parts.append(json.loads(out))
    latencies = sorted(t for part in parts for t in part["latencies_ms"])
    result = {"requests_per_s": len(latencies) / duration, "p50_ms": latencies[len(latencies) // 2],
              "calls": sum(part["calls"] for part in parts), "load_processes": processes}
    if all("load_cpu_us_per_call" in part for part in parts):
        result |= {"load_cpu_us_per_call": round(sum(part["load_cpu_us_per_call"] * part["calls"] for part in parts)
                                                 / result["calls"], 1),
                   "load_busiest_thread": max((part["load_busiest_thread"] for part in parts),
                                              key=lambda thread: thread["busy"])}
    if before:
        spent = {name: seconds - before.get(name, 0.0) for name, seconds in thread_cpu_s(server_pid).items()}
        per_call = {name: round(seconds / result["calls"] * 1e6, 1) for name, seconds in spent.items() if seconds > 0}
        result |= {"server_cpu_us_per_call": round(sum(per_call.values()), 1), "server_cpu_by_thread": per_call}
    return result


def in_process_step_ms(duration: float = 2.0, idle_s: float = 0.0) -> float:
    """The single-token step's p50 in-process: back to back (what the hop subtracts), or each after
    ``idle_s`` of sleep (IDLE_GAP_S: as a lone caller's step follows its last answer)."""
    import numpy as np

    from expertd.server.steps import pad_rows

    engine, hidden = _engine()
    x = np.ones((1, hidden), np.float32)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < duration:
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        engine.forward(0, pad_rows([x], 1), 1)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


# ---------------------------------------------------------------------- the run

@contextlib.contextmanager
def cpu_latency_qos(held: bool):
    """Where ``held``, a PM QoS request of 0 us on CPU_LATENCY_QOS for the block: while its file is
    open the kernel picks no idle state with any exit latency, so idle CPUs poll (a VM's vCPUs stay
    running) instead of halting. OSError naming the file where it cannot be opened (root only)."""
    if not held:
        yield
        return
    try:
        request = os.open(CPU_LATENCY_QOS, os.O_WRONLY)
    except OSError as exc:
        raise OSError(f"cannot open {CPU_LATENCY_QOS} ({exc.strerror}): it needs Linux and root") from exc
    try:
        os.write(request, struct.pack("i", 0))
        yield
    finally:
        os.close(request)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_server(kind: str, duration: float, step_ms: float, idle_step_ms: float, load_processes: int = 1,
               cpu_sync_dispatch: bool = False) -> dict:
    """One round against a fresh server of ``kind``: Check and Forward at 1 and 64 callers (these
    over ``load_processes``); the hop less ``step_ms`` (the goal's) and less ``idle_step_ms``."""
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port),
                                *(["sync"] if cpu_sync_dispatch else [])], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} server did not start")
        row = {"server": kind}
        for method in ("Check", "Forward"):
            for concurrency in (1, 64):
                row[f"{method}_{concurrency}"] = measure(port, method, concurrency, duration, process.pid,
                                                         load_processes)
    finally:
        process.kill()
        process.wait(30)
    row["hop_over_check"] = (row["Forward_1"]["p50_ms"] - step_ms) / row["Check_1"]["p50_ms"]
    row["hop_over_check_idle_step"] = (row["Forward_1"]["p50_ms"] - idle_step_ms) / row["Check_1"]["p50_ms"]
    row["throughput_over_check"] = row["Forward_64"]["requests_per_s"] / row["Check_64"]["requests_per_s"]
    return row


def _qos_label(held: bool, settings: tuple) -> str:
    """The row label's suffix for a ``--cpu-latency-qos ab`` run (nothing when every row is alike)."""
    return "" if len(settings) == 1 else " +qos" if held else " -qos"


def _range(values, digits: int = 2) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per load (after 1 s warm-up)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    parser.add_argument("--load-processes", type=int, default=1,
                        help="processes the 64 callers are split over (default 1), so the load is not the ceiling")
    parser.add_argument("--cpu-sync-dispatch", action="store_true",
                        help="the servers' and the in-process steps on the calling thread, as expertd serve "
                        "--cpu-sync-dispatch (default: JAX's asynchronous dispatch, as expertd serve)")
    parser.add_argument("--cpu-latency-qos", choices=("off", "on", "ab"), default="off",
                        help="on: idle CPUs poll instead of halting while measuring (a PM QoS request of 0 us on "
                        f"{CPU_LATENCY_QOS}, root); ab: each round both ways (default off)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    servers = args.servers.split(",")
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"--servers: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(SERVERS)}")
    settings = {"off": (False,), "on": (True,), "ab": (False, True)}[args.cpu_latency_qos]
    try:
        with cpu_latency_qos(True in settings):
            pass
    except OSError as exc:
        parser.error(f"--cpu-latency-qos: {exc}")
    skipped = {}
    if native := [kind for kind in servers if kind in NATIVE]:
        from expertd.server.native_front import NativeUnavailable, load

        try:
            load()  # built (or found built), and its libraries found
        except (NativeUnavailable, ImportError) as exc:
            for kind in native:
                skipped[kind] = str(exc)
                servers.remove(kind)
            print(f"{', '.join(native)}: left out: {exc}", flush=True)
    from expertd.server.process import configure_cpu_dispatch

    configure_cpu_dispatch(asynchronous=not args.cpu_sync_dispatch)  # the in-process step's, as the servers'
    steps_ms = {}  # cpu_latency_qos -> (the in-process step back to back, after IDLE_GAP_S idle)
    for held in settings:
        with cpu_latency_qos(held):
            steps_ms[held] = in_process_step_ms(), in_process_step_ms(idle_s=IDLE_GAP_S)
        print(f"in-process single-token step p50 {steps_ms[held][0]:.3f} ms back to back, {steps_ms[held][1]:.3f} ms "
              f"after {IDLE_GAP_S * 1e3:g} ms idle" + _qos_label(held, settings), flush=True)
    rows = []
    for round_index, held, kind in ((r, h, k) for r in range(args.rounds) for h in settings for k in servers):
        with cpu_latency_qos(held):
            row = run_server(kind, args.duration, *steps_ms[held], args.load_processes,
                             args.cpu_sync_dispatch) | {"round": round_index, "cpu_latency_qos": held}
        rows.append(row)
        print(f"round {round_index} {kind + _qos_label(held, settings):>12}: Check p50 "
              f"{row['Check_1']['p50_ms']:.3f} ms, Forward p50 {row['Forward_1']['p50_ms']:.3f} ms: hop / Check "
              f"{row['hop_over_check']:.2f} ({row['hop_over_check_idle_step']:.2f} less the step after idle); 64 "
              f"callers {row['Forward_64']['requests_per_s']:.0f} / {row['Check_64']['requests_per_s']:.0f} req/s: "
              f"{row['throughput_over_check']:.2f}", flush=True)
        for load in ("Check_1", "Forward_1", "Check_64", "Forward_64"):
            if "server_cpu_by_thread" in row[load]:
                threads = ", ".join(f"{name} {us:.0f}" for name, us in sorted(
                    row[load]["server_cpu_by_thread"].items(), key=lambda item: -item[1]))
                busiest = row[load].get("load_busiest_thread")
                print(f"    {load}: server CPU {row[load]['server_cpu_us_per_call']:.0f} us a call ({threads})"
                      + (f"; the load's {busiest['name']} thread {busiest['busy']:.0%} busy, "
                         f"{row[load]['load_cpu_us_per_call']:.0f} us a call in all" if busiest else ""),
                      flush=True)
    print(f"\n{'server':>12} | Forward p50 ms | Check p50 ms | hop / Check (goal <= 1.3) | 64 callers: Forward / "
          "Check req/s (goal >= 0.85)")
    for held, kind in ((h, k) for h in settings for k in servers):
        mine = [r for r in rows if r["server"] == kind and r["cpu_latency_qos"] == held]
        print(f"{kind + _qos_label(held, settings):>12} | {_range([r['Forward_1']['p50_ms'] for r in mine]):>14} | "
              f"{_range([r['Check_1']['p50_ms'] for r in mine]):>12} | "
              f"{_range([r['hop_over_check'] for r in mine]):>25} | "
              f"{_range([r['Forward_64']['requests_per_s'] for r in mine], 0)} / "
              f"{_range([r['Check_64']['requests_per_s'] for r in mine], 0)}: "
              f"{_range([r['throughput_over_check'] for r in mine])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "python_floor", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}",
        "duration_s": args.duration, "load_processes": args.load_processes,
        "cpu_dispatch": "synchronous" if args.cpu_sync_dispatch else "asynchronous",
        "cpu_latency_qos": args.cpu_latency_qos, "in_process_step_p50_ms": steps_ms[settings[0]][0],
        "in_process_step_after_idle_p50_ms": steps_ms[settings[0]][1], "idle_gap_s": IDLE_GAP_S,
        **({"in_process_step_with_cpu_latency_qos_ms": steps_ms[True]} if len(settings) > 1 else {}),
        "left_out": skipped, "rows": rows},
        indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), cpu_sync_dispatch=sys.argv[4:] == ["sync"])
    elif len(sys.argv) > 1 and sys.argv[1] == "--load":
        target, method, concurrency, duration = sys.argv[2:6]
        start_at = float(sys.argv[6]) if len(sys.argv) > 6 else None
        print(json.dumps(asyncio.run(_load(target, method, int(concurrency), 1.0, float(duration), start_at))))
    else:
        sys.exit(main())
