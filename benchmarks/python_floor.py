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
- ``native-echo``: the native port's C++ (its parse, queue and direct runner) whose direct callable
  parses each call of a batch and answers the batch with its own rows: the GIL and one Python call
  a batch, no checks, no step, no batcher. Not a server: the 64-caller rate the native port would reach if its step and
  bookkeeping cost nothing on this host, so the ceiling of any step-side change.

Load (``harness.measure_load``): one process per measurement, C callers on one channel sending a
prepared request (a raw stub for Forward, so no client library's cost is in it), warm-up then
``--duration`` s; with
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
import os
import pathlib
import struct
import sys
import threading
import time

import harness

RESULTS = harness.RESULTS / "python_floor.json"
BUCKETS = harness.SERVED_BUCKETS
SERVERS = ("expertd", "bare", "bare-batched", "expertd-native", "expertd-native-queued", "native-echo")
NATIVE = ("expertd-native", "expertd-native-queued", "native-echo")
IDLE_GAP_S = 0.0005  # about a lone caller's round trip: the gap before each of its steps
CPU_LATENCY_QOS = pathlib.Path("/dev/cpu_dma_latency")  # PM QoS: what the CPUs' idle states may cost


# ---------------------------------------------------------------------- the servers

def engine_step(engine, parts: list):
    """The layer's float32 output [rows, H] for the rows of ``parts`` (each float32 [T_i, H]), run as
    one step padded to the smallest bucket that holds them."""
    import numpy as np

    rows = sum(len(x) for x in parts)
    return np.asarray(harness.padded_forward(engine, 0, parts).output)[:rows]


async def _serve_bare(port: int, batched: bool) -> None:
    import grpc
    import numpy as np
    from grpc_health.v1 import health, health_pb2_grpc

    from expertd.client import codec
    from expertd.client.pb.v1 import expert_pb2

    engine, hidden = harness.tiny_engine(BUCKETS)
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
    config = harness.server_config(port=0 if native else port, native_port=port if native else None,
                                   native_direct=direct, batching=dict(bucket_sizes=BUCKETS))
    with harness.running_server(config, harness.tiny_layers(), timeout=600) as server:
        print("ready", flush=True)
        server.wait()


def _serve_native_echo(port: int) -> None:
    """``native-echo`` (module docstring): the native port's module with a direct callable that answers
    each batch with its own rows, on the calling gRPC or runner thread."""
    import numpy as np

    from expertd.client import codec
    from expertd.client.pb.v1.expert_pb2 import ForwardRequest, GetModelInfoResponse
    from expertd.server.metrics.families import LATENCY_BUCKETS
    from expertd.server.native_front import load
    from expertd.server.native_front.front import UNDECODABLE
    from expertd.server.transport.auth import UNAUTHENTICATED_MESSAGE

    module = load()
    itemsizes = {dtype: codec.numpy_dtype(dtype).itemsize for dtype in codec.FLOAT_DTYPES}
    handle, _, _ = module.start(f"127.0.0.1:{port}", {0: 64}, itemsizes, 256, 256, 1 << 20, 1 << 16, 64 << 20,
                                GetModelInfoResponse().SerializeToString(), None, None, LATENCY_BUCKETS, "starting",
                                UNAUTHENTICATED_MESSAGE, UNDECODABLE)

    def echo(batch: int, bodies: tuple[bytes, ...], remaining_s) -> None:
        calls = [ForwardRequest.FromString(body).hidden_states for body in bodies]
        rows = b"".join(tensor.data for tensor in calls)
        module.finish(handle, batch, np.frombuffer(rows, codec.numpy_dtype(calls[0].dtype)))

    module.set_direct(handle, echo)
    module.set_accepting(handle, True, "")
    print("ready", flush=True)
    threading.Event().wait()


def serve(kind: str, port: int, cpu_sync_dispatch: bool = False) -> None:
    """Run server ``kind`` on ``port`` until killed (the ``--serve`` entry point), its engine's CPU steps
    on the calling thread where ``cpu_sync_dispatch`` (``expertd serve --cpu-sync-dispatch``)."""
    from expertd.server.host.process import configure_cpu_dispatch

    configure_cpu_dispatch(asynchronous=not cpu_sync_dispatch)
    if kind == "native-echo":
        _serve_native_echo(port)
        return
    if kind in ("expertd", *NATIVE):
        _serve_expertd(port, native=kind in NATIVE, direct=kind != "expertd-native-queued")
        return
    import uvloop

    uvloop.run(_serve_bare(port, batched=kind == "bare-batched"))


def in_process_step_ms(duration: float = 2.0, idle_s: float = 0.0) -> float:
    """The single-token step's p50 in-process: back to back (what the hop subtracts), or each after
    ``idle_s`` of sleep (IDLE_GAP_S: as a lone caller's step follows its last answer)."""
    import numpy as np

    engine, hidden = harness.tiny_engine(BUCKETS)
    x = np.ones((1, hidden), np.float32)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < duration:
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        harness.padded_forward(engine, 0, [x])
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


def run_server(kind: str, duration: float, step_ms: float, idle_step_ms: float, load_processes: int = 1,
               cpu_sync_dispatch: bool = False) -> dict:
    """One round against a fresh server of ``kind``: Check and Forward at 1 and 64 callers (these
    over ``load_processes``); the hop less ``step_ms`` (the goal's) and less ``idle_step_ms``."""
    port = harness.free_port()
    argv = [sys.executable, __file__, "--serve", kind, str(port), *(["sync"] if cpu_sync_dispatch else [])]
    with harness.ready_process(argv, env={**os.environ, "JAX_PLATFORMS": "cpu"}, what=f"{kind} server") as process:
        row = {"server": kind}
        for method in ("Check", "Forward"):
            for concurrency in (1, 64):
                row[f"{method}_{concurrency}"] = harness.measure_load(port, method, concurrency, duration, process.pid,
                                                                      load_processes)
    row["hop_over_check"] = (row["Forward_1"]["p50_ms"] - step_ms) / row["Check_1"]["p50_ms"]
    row["hop_over_check_idle_step"] = (row["Forward_1"]["p50_ms"] - idle_step_ms) / row["Check_1"]["p50_ms"]
    row["throughput_over_check"] = row["Forward_64"]["requests_per_s"] / row["Check_64"]["requests_per_s"]
    return row


def _qos_label(held: bool, settings: tuple) -> str:
    """The row label's suffix for a ``--cpu-latency-qos ab`` run (nothing when every row is alike)."""
    return "" if len(settings) == 1 else " +qos" if held else " -qos"


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
    from expertd.server.host.process import configure_cpu_dispatch

    configure_cpu_dispatch(asynchronous=not args.cpu_sync_dispatch)  # the in-process step's, as the servers'
    steps_ms = {}  # cpu_latency_qos -> (the in-process step back to back, after IDLE_GAP_S idle)
    for held in settings:
        with cpu_latency_qos(held):
            steps_ms[held] = in_process_step_ms(), in_process_step_ms(idle_s=IDLE_GAP_S)
        print(f"in-process single-token step p50 {steps_ms[held][0]:.3f} ms back to back, {steps_ms[held][1]:.3f} ms "
              f"after {IDLE_GAP_S * 1e3:g} ms idle" + _qos_label(held, settings), flush=True)
    rows = []
    for round_index, held, kind in harness.alternate(args.rounds, settings, servers):
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
    span = harness.span
    for held, kind in ((h, k) for h in settings for k in servers):
        mine = [r for r in rows if r["server"] == kind and r["cpu_latency_qos"] == held]
        print(f"{kind + _qos_label(held, settings):>12} | {span([r['Forward_1']['p50_ms'] for r in mine]):>14} | "
              f"{span([r['Check_1']['p50_ms'] for r in mine]):>12} | "
              f"{span([r['hop_over_check'] for r in mine]):>25} | "
              f"{span([r['Forward_64']['requests_per_s'] for r in mine], 0)} / "
              f"{span([r['Check_64']['requests_per_s'] for r in mine], 0)}: "
              f"{span([r['throughput_over_check'] for r in mine])}")
    harness.write_json(args.out, {
        "benchmark": "python_floor", "date": harness.machine.now(),
        "machine": harness.machine.summary(),
        "duration_s": args.duration, "load_processes": args.load_processes,
        "cpu_dispatch": "synchronous" if args.cpu_sync_dispatch else "asynchronous",
        "cpu_latency_qos": args.cpu_latency_qos, "in_process_step_p50_ms": steps_ms[settings[0]][0],
        "in_process_step_after_idle_p50_ms": steps_ms[settings[0]][1], "idle_gap_s": IDLE_GAP_S,
        **({"in_process_step_with_cpu_latency_qos_ms": steps_ms[True]} if len(settings) > 1 else {}),
        "left_out": skipped, "rows": rows})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), cpu_sync_dispatch=sys.argv[4:] == ["sync"])
    else:
        sys.exit(main())
