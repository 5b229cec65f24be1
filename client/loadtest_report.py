"""How ``expertd loadtest`` shows its results: progress bar, perf_analyzer-style table, PNG plot."""
from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from expertd.client.cli_output import import_pyplot

LATENCY_COLUMNS = (("p50", "p50 latency"), ("p90", "p90 latency"), ("p95", "p95 latency"), ("p99", "p99 latency"),
                   ("max", "Max latency"))


class Progress:
    """A one-line progress bar on a terminal (``\\r``-redrawn), one finished line per step."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 24, interval: float = 0.2):
        self.stream = stream
        self.width = width
        self.interval = interval
        self._label = ""

    def start_step(self, index: int, total: int, mode: str, load: float) -> None:
        level = f"concurrency {int(load)}" if mode == "concurrency" else f"{load:g} req/s"
        self._label = f"[{index + 1}/{total}] {level}"

    def line(self, stats, window) -> str:
        now = time.perf_counter()
        if now < window.measure_from:
            return f"{self._label} warm-up {window.measure_from - now:4.1f}s"
        fractions = []
        if window.stop_at != float("inf"):
            span = window.stop_at - window.measure_from
            fractions.append((now - window.measure_from) / span)
        if window.max_requests != float("inf"):
            fractions.append(stats.completed / window.max_requests)
        done = min(1.0, max(fractions) if fractions else 0.0)
        filled = int(done * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = max(now - (stats.first_send or now), 1e-9)
        failed = sum(stats.errors.values())
        return f"{self._label} [{bar}] {done:4.0%} {stats.ok} ok {failed} err {stats.ok / elapsed:8.1f} req/s"

    async def run(self, stats, window) -> None:
        while True:
            self.stream.write("\r" + self.line(stats, window).ljust(100))
            self.stream.flush()
            await asyncio.sleep(self.interval)

    def finish(self, stats, window) -> None:
        self.stream.write("\r" + self.line(stats, window).ljust(100) + "\n")
        self.stream.flush()


def _errors_text(errors: dict) -> str:
    return ",".join(f"{code}={count}" for code, count in errors.items()) or "0"


def format_table(report: dict) -> str:
    """The sweep as a table in perf_analyzer's column style (latencies in microseconds)."""
    mode = report["mode"]
    first = "Concurrency" if mode == "concurrency" else "Request Rate"
    header = [first, "Inferences/Second", "Tokens/Second", *(title for _, title in LATENCY_COLUMNS), "Errors",
              "Client CPU usec/req"]
    rows = []
    for step in report["steps"]:
        latency = step["latency_ms"]
        rows.append([
            f"{step[mode]:g}",
            f"{step['requests_per_s']:.1f}",
            f"{step['tokens_per_s']:.0f}",
            *(f"{latency[key] * 1e3:.0f}" if key in latency else "-" for key, _ in LATENCY_COLUMNS),
            _errors_text(step["errors"]),
            f"{step['client_cpu_ms_per_request'] * 1e3:.0f}" if "client_cpu_ms_per_request" in step else "-",
        ])
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = [
        f"*** {report['protocol']} load test: {report['target']} layer {report['layer']}, "
        f"{report['tokens']} tokens x {report['hidden_size']} {report['dtype']} per request ***",
        "  ".join(h.rjust(w) for h, w in zip(header, widths)),
        *("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows),
        "Latencies in usec, successful requests only; Inferences/Second counts successful requests.",
    ]
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """Latency (p50/p90/p99, ms) against throughput (successful req/s), one point per step."""
    plt = import_pyplot()
    steps = [s for s in report["steps"] if s["latency_ms"]]
    mode = report["mode"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    throughput = [s["requests_per_s"] for s in steps]
    for key in ("p50", "p90", "p99"):
        axes.plot(throughput, [s["latency_ms"][key] for s in steps], marker="o", label=key)
    for step, x in zip(steps, throughput):
        label = f"c={step[mode]:g}" if mode == "concurrency" else f"{step[mode]:g}/s"
        axes.annotate(label, (x, step["latency_ms"]["p50"]), textcoords="offset points", xytext=(4, -12), fontsize=8)
    axes.set_xlabel("throughput (successful requests/s)")
    axes.set_ylabel("latency (ms)")
    axes.set_title(f"expertd load test ({report['protocol']} protocol), layer {report['layer']}, "
                   f"{report['tokens']} tokens/request")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
