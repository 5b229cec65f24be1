"""Failover: replicas under closed-loop load, one killed with SIGKILL and later restarted.

Three ``expertd serve`` processes (``tiny`` preset, fp32, loopback), one client target listing all
three (``127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3``): round-robin over the SERVING replicas, with
gRPC's client-side health checking. Two closed loops run in this process, each ``--concurrency``
Forward calls of ``--tokens`` tokens in flight through ``AsyncExpertClient``: one with the client's
default retries (UNAVAILABLE retried on another replica by the service-config retry policy), one
with none (every failure counts). Timeline:

1. all replicas serving, load for ``--before`` s;
2. SIGKILL replica 1 (its calls in flight fail, or are retried elsewhere);
3. ``--down`` s later, start it again on the same port: it warms up (NOT_SERVING, so it gets no
   calls), then serves, and the clients' reconnection finds it;
4. load for ``--after`` s after it answered its first call again.

Every call's start, end, status and message is recorded. Reported: per client, the calls started in
the window (one second before the kill to the end), how many failed and with what messages; the
pre-kill throughput; the recovery time (from the kill until a 0.5 s window reaches 80 % of the
pre-kill throughput); the restarted replica's rejoin time (from its SERVING to its first answered
call); throughput over the run in 100 ms bins as a PNG (matplotlib) and JSON.

    flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/failover.py [--quick]

``tests/server/transport/test_failover.py`` runs the same scenario (``run_chaos``) with short phases and
asserts its bounds. The replicas share this machine's cores with the load generator and with each
other: a restarting replica's start-up (JAX import, compilation) takes CPU from the others.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import pathlib
import sys
import tempfile
import time
import urllib.request

import harness
import numpy as np

RESULTS = harness.RESULTS
RECOVERY_FRACTION = 0.8   # "back": a RECOVERY_WINDOW_S window at this share of the pre-kill throughput
RECOVERY_WINDOW_S = 0.5
CLIENTS = ("retries", "no-retries")


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    replicas: int = 3
    victim: int = 1
    concurrency: int = 8            # calls in flight per client
    tokens: int = 8
    before_s: float = 5.0
    down_s: float = 5.0
    after_s: float = 10.0
    bin_s: float = 0.1
    retries: int = 3                # of the retrying client
    timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    cache_dir: str | None = None    # JAX compilation cache shared by the replicas


class Replica(harness.ServeProcess):
    """One replica: ``expertd serve`` (tiny preset, fp32, one CPU device) on a fixed port; its output
    is collected by a thread."""

    def __init__(self, index: int, port: int, cache_dir: str):
        super().__init__(port, ["--metrics-port", "0", "--preset", "tiny", "--num-layers", "1", "--dtype", "float32",
                                "--num-devices", "1", "--bucket-sizes", "1,8,32", "--max-queue-delay-ms", "1",
                                "--drain-grace-s", "5", "--compile-cache-dir", cache_dir],
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"},
                         name=f"replica {index}")
        self.index, self.cache_dir = index, cache_dir

    def answered(self) -> float:
        """Forward calls this replica answered OK (its own counter)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "grpc_server_handled_total" and sample.labels.get("grpc_method") == "Forward" \
                        and sample.labels.get("grpc_code") == "OK":
                    return sample.value
        return 0.0




async def _closed_loop(client, name: str, concurrency: int, x: np.ndarray, stop: asyncio.Event,
                       calls: list) -> None:
    from expertd.client import ExpertError

    async def worker() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await client.forward(x, layer=0)
                code, message = "OK", ""
            except ExpertError as error:
                code, message = error.code.name, error.message
            calls.append((name, started, time.monotonic(), code, message))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _scenario(config: ChaosConfig, replicas: list[Replica], target: str) -> tuple[list, dict]:
    from expertd.client import AsyncExpertClient

    clients = {"retries": AsyncExpertClient(target, retries=config.retries, timeout=config.timeout_s),
               "no-retries": AsyncExpertClient(target, retries=0, timeout=config.timeout_s)}
    calls: list = []
    events: dict[str, float] = {}
    try:
        hidden = (await clients["retries"].model_info()).layers[0].hidden_size
        x = np.random.default_rng(0).standard_normal((config.tokens, hidden), dtype=np.float32)
        stop = asyncio.Event()
        events["start"] = time.monotonic()
        load = asyncio.gather(*(_closed_loop(client, name, config.concurrency, x, stop, calls)
                                for name, client in clients.items()))
        victim = replicas[config.victim]
        try:
            await asyncio.sleep(config.before_s)
            events["kill"] = time.monotonic()
            await asyncio.to_thread(victim.kill)
            await asyncio.sleep(config.down_s)
            events["restart"] = time.monotonic()
            victim.start()
            events["ready"] = await asyncio.to_thread(victim.wait_ready, config.startup_timeout_s)
            while await asyncio.to_thread(victim.answered) == 0:
                if time.monotonic() - events["ready"] > 30:
                    raise RuntimeError("the restarted replica got no call within 30 s of serving")
                await asyncio.sleep(0.05)
            events["rejoined"] = time.monotonic()
            await asyncio.sleep(config.after_s)
        finally:
            stop.set()
            await load
            events["end"] = time.monotonic()
    finally:
        for client in clients.values():
            await client.close()
    return calls, events


def run_chaos(config: ChaosConfig, log=print) -> dict:
    """Start the replicas, run the scenario (module docstring), stop everything; the summary (``summarize``)."""
    cache_dir = config.cache_dir or os.path.join(tempfile.gettempdir(), "expertd-failover-jax-cache")
    replicas = [Replica(i, port, cache_dir) for i, port in enumerate(harness.free_ports(config.replicas))]
    with harness.serving(replicas, config.startup_timeout_s):
        target = ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
        log(f"{config.replicas} replicas ready: {target}")
        calls, events = asyncio.run(_scenario(config, replicas, target))
        answered = [replica.answered() for replica in replicas]
    result = summarize(calls, events, config)
    result["target"] = target
    result["answered_by_replica"] = answered
    return result


def summarize(calls: list, events: dict[str, float], config: ChaosConfig) -> dict:
    """Failures in the window, throughput bins (OK answers per second, by client), recovery and rejoin times."""
    t0 = events["start"]
    kill = events["kill"]
    window = (kill - 1.0, events["end"])
    clients = {}
    for name in CLIENTS:
        mine = [c for c in calls if c[0] == name and window[0] <= c[1] < window[1]]
        codes = collections.Counter(c[3] for c in mine)
        failed = len(mine) - codes["OK"]
        messages = collections.Counter(f"{c[3]}: {c[4]}" for c in mine if c[3] != "OK")
        clients[name] = {"sent_in_window": len(mine), "failed": failed,
                         "failed_ratio": failed / len(mine) if mine else 0.0, "codes": dict(sorted(codes.items())),
                         "failures": dict(messages.most_common())}
    edges = np.arange(int((events["end"] - t0) / config.bin_s) + 1) * config.bin_s  # whole bins only
    ok = {name: np.histogram([c[2] - t0 for c in calls if c[0] == name and c[3] == "OK"], edges)[0]
          for name in CLIENTS}
    failures = np.histogram([c[2] - t0 for c in calls if c[3] != "OK"], edges)[0]
    total = sum(ok.values()) / config.bin_s  # OK answers per second, per bin
    times = edges[:-1]

    def rate(start: float, stop: float) -> float:
        chosen = (times >= start - t0 - 1e-9) & (times + config.bin_s <= stop - t0 + 1e-9)
        return float(total[chosen].mean()) if chosen.any() else 0.0

    baseline = rate(max(t0 + 1.0, kill - 3.0), kill)
    recovered_after = None
    offset = 0.0
    while kill + offset + RECOVERY_WINDOW_S <= events["end"]:
        if rate(kill + offset, kill + offset + RECOVERY_WINDOW_S) >= RECOVERY_FRACTION * baseline:
            recovered_after = offset
            break
        offset += config.bin_s
    return {
        "config": dataclasses.asdict(config),
        "events_s": {name: moment - t0 for name, moment in events.items()},
        "clients": clients,
        "calls_per_s_before_kill": baseline,
        "calls_per_s_first_second_after_kill": rate(kill, kill + 1.0),
        "calls_per_s_after_rejoin": rate(events["rejoined"], events["end"]),
        "recovered_after_kill_s": recovered_after,
        "restart_to_ready_s": events["ready"] - events["restart"],
        "rejoin_after_ready_s": events["rejoined"] - events["ready"],
        "bins": {"bin_s": config.bin_s, "start_s": times.tolist(),
                 **{f"ok_per_s_{name}": (ok[name] / config.bin_s).tolist() for name in CLIENTS},
                 "failed": failures.tolist()},
    }


def write_plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = result["bins"]
    times = np.asarray(bins["start_s"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name in CLIENTS:
        ax.step(times, bins[f"ok_per_s_{name}"], where="post", label=f"OK calls/s, client with {name}")
    failed = np.asarray(bins["failed"])
    if failed.any():
        ax.scatter(times[failed > 0], np.zeros(int((failed > 0).sum())), color="red", marker="x", zorder=3,
                   label="failed calls (bin)")
    events = result["events_s"]
    for name, color, style in (("kill", "red", "--"), ("restart", "black", ":"), ("ready", "green", ":"),
                               ("rejoined", "green", "--")):
        ax.axvline(events[name], color=color, linestyle=style, linewidth=1)
        ax.annotate(name, (events[name], ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8)
    config = result["config"]
    ax.set_title(f"{config['replicas']} replicas, {config['concurrency']} calls in flight per client, "
                 f"{config['tokens']} tokens per call; replica {config['victim']} SIGKILLed, then restarted")
    ax.set_xlabel(f"seconds ({bins['bin_s'] * 1000:.0f} ms bins)")
    ax.set_ylabel("answered calls / s")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> str:
    lines = [f"target {result['target']}"]
    for name, stats in result["clients"].items():
        lines.append(f"client with {name}: {stats['failed']} of {stats['sent_in_window']} calls failed in the window "
                     f"({100 * stats['failed_ratio']:.2f} %) {stats['codes']}")
        lines += [f"  {count} x {message}" for message, count in stats["failures"].items()]
    recovered = result["recovered_after_kill_s"]
    lines += [
        f"calls/s before the kill {result['calls_per_s_before_kill']:.0f}, first second after it "
        f"{result['calls_per_s_first_second_after_kill']:.0f}, "
        f"after the rejoin {result['calls_per_s_after_rejoin']:.0f}",
        "back to {:.0f} % of it {}".format(100 * RECOVERY_FRACTION, "never" if recovered is None
                                           else f"{recovered:.1f} s after the kill"),
        f"restart -> ready {result['restart_to_ready_s']:.1f} s; ready -> first call answered "
        f"{result['rejoin_after_ready_s']:.2f} s; calls answered per replica {result['answered_by_replica']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases, 4 calls in flight (proves it runs)")
    parser.add_argument("--concurrency", type=int, help="calls in flight per client (default 8; quick 4)")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--before", type=float, help="seconds of load before the kill (default 5; quick 2)")
    parser.add_argument("--down", type=float, help="seconds the replica stays dead (default 5; quick 1)")
    parser.add_argument("--after", type=float, help="seconds of load after it rejoined (default 10; quick 2)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="where failover.json / .png go (default benchmarks/results; quick: a temp dir)")
    args = parser.parse_args(argv)
    quick = args.quick
    config = ChaosConfig(concurrency=args.concurrency or (4 if quick else 8), tokens=args.tokens,
                         before_s=args.before or (2.0 if quick else 5.0), down_s=args.down or (1.0 if quick else 5.0),
                         after_s=args.after or (2.0 if quick else 10.0))
    out = args.out or (pathlib.Path(tempfile.gettempdir()) / "expertd-failover" if quick else RESULTS)
    result = run_chaos(config)
    print(report(result))
    result.update(benchmark="failover", date=harness.machine.now("minutes", utc=True), quick=quick,
                  machine={**harness.machine.platform_facts(),
                           "note": "replicas, load generator and restarts share this machine's cores"})
    harness.write_json(out / "failover.json", result, indent=2, announce=False)
    write_plot(result, out / "failover.png")
    print(f"wrote {out / 'failover.json'} and {out / 'failover.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
