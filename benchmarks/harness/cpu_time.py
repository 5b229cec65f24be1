"""CPU time while a load runs: a process's threads by name (from ``/proc``), and this process's CPU
sampled on a thread so any window a client reports can be read off it."""
from __future__ import annotations

import os
import pathlib
import threading
import time


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


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds by thread name between two ``thread_cpu_s`` readings."""
    return {name: seconds - before.get(name, 0.0) for name, seconds in after.items()}


class CpuSampler:
    """Samples (wall clock, this process's CPU seconds) every ``interval`` s on a thread, so the
    server's CPU can be read over any window a client reports."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), time.process_time()))
            self._stop.wait(self.interval)
        self.samples.append((time.time(), time.process_time()))

    def cpu_between(self, wall_from: float, wall_to: float) -> float:
        """CPU seconds this process used between two wall-clock instants (linear between samples)."""
        import numpy as np

        walls, cpus = np.asarray(self.samples).T
        return float(np.interp(wall_to, walls, cpus) - np.interp(wall_from, walls, cpus))
