"""Servers for a benchmark: free ports; the real server in this process (``running_server``) or as an
``expertd serve`` subprocess (``ServeProcess``); a child process that prints "ready" when it serves
(``ready_process``). Each is stopped when its block ends, however it ends."""
from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the system's pick)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free when asked (held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_config(dtype: str = "float32", *, batching: dict | None = None, **fields):
    """The ServerConfig a benchmark serves with: loopback, port and metrics port 0 (the system picks)
    unless ``fields`` name them, one device computing in ``dtype``, ``BatchingConfig(**batching)``
    (default: ``expertd serve``'s batching); ``fields``: any other ServerConfig field."""
    from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig

    return ServerConfig(**{"host": HOST, "port": 0, "metrics_port": 0, **fields},
                        model=ModelConfig(dtype=dtype, num_devices=1), batching=BatchingConfig(**(batching or {})))


@contextlib.contextmanager
def running_server(config, layers, *, registry=None, timeout: float = 900.0, grace: float | None = 5.0):
    """The real server (``create_server``) in this process serving ``layers``, yielded once ready
    (``wait_ready(timeout)``); stopped (``grace`` seconds for calls in flight) when the block ends.
    ``registry``: the Prometheus registry for its metrics (default: a fresh one, ``handle.registry``)."""
    from expertd.server.app import create_server

    server = create_server(config, registry=registry, layers=layers)
    try:
        server.wait_ready(timeout=timeout)
        yield server
    finally:
        server.stop(grace=grace)


@contextlib.contextmanager
def ready_process(argv: list[str], *, env: dict | None = None, what: str = "server"):
    """A child process (``argv``) that prints "ready" as its first line once it serves; yielded
    then, killed when the block ends. RuntimeError naming ``what`` where it says anything else."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {what} did not start")
        yield process
    finally:
        process.kill()
        process.wait(30)


class ServeProcess:
    """One ``expertd serve --host 127.0.0.1 --port PORT ARGS`` subprocess; a thread collects its
    output (``lines``). ``start`` may be called again after ``kill`` or ``stop`` (a restart, on
    ``port`` as it is then)."""

    def __init__(self, port: int, args: list[str], *, env: dict | None = None, name: str = "server"):
        self.port, self.args, self.env, self.name = port, list(args), env, name
        self.popen: subprocess.Popen | None = None
        self.lines: list[str] = []

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "expertd.server.cli", "serve", "--host", HOST, "--port", str(self.port),
                *self.args]

    def start(self) -> None:
        self.lines = []
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=self.env)
        threading.Thread(target=self._read, args=(self.popen, self.lines), daemon=True).start()

    @staticmethod
    def _read(popen: subprocess.Popen, lines: list[str]) -> None:
        for line in popen.stdout:
            lines.append(line)

    def wait_ready(self, timeout: float) -> float:
        """Block until the server printed ``ready:``; returns that moment (monotonic). RuntimeError
        with its output where it exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("ready:" in line for line in list(self.lines)):
                return time.monotonic()
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready:\n{''.join(self.lines)}")

    @property
    def metrics_port(self) -> int:
        """The metrics port the server printed."""
        for line in list(self.lines):
            if match := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line):
                return int(match.group(1))
        raise RuntimeError(f"{self.name} printed no metrics port")

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after 15 s; nothing where it is not running."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def start_serving(processes: list[ServeProcess], timeout: float, attempts: int = 3) -> None:
    """Start every process and wait until each is ready. ``free_ports`` hands out ports that were
    free when asked: one that finds its port taken since (``expertd serve`` says "cannot listen
    on") starts again on another, up to ``attempts`` times."""
    for process in processes:
        process.start()
    for process in processes:
        for attempt in range(attempts):
            try:
                process.wait_ready(timeout)
                break
            except RuntimeError:
                if attempt == attempts - 1 or not any("cannot listen on" in line for line in process.lines):
                    raise
                process.port = free_port()
                process.start()


@contextlib.contextmanager
def serving(processes: list[ServeProcess], timeout: float):
    """``start_serving`` for the block; every process stopped when it ends."""
    try:
        start_serving(processes, timeout)
        yield processes
    finally:
        for process in processes:
            process.stop()

