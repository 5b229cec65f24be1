"""Shared by the service tests: server configs on loopback port 0, references, metrics scraping.

Every server in a test session shares one JAX persistent compilation cache (under pytest's base
temp dir), so only the first server that compiles a (layer shape, bucket) pays for it; the
subprocess servers of the drain test use the same cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu
from expertd.kernels import router as router_ops
from expertd.kernels.moe import MoEParams, moe_layer
from expertd.server.app import create_server
from expertd.server.config import BatchingConfig, ModelConfig, SecurityConfig, ServerConfig

BUCKETS = (1, 8)  # few and small: every bucket is compiled at start-up


def cache_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.getbasetemp() / "expertd-jax-cache"


def server_config(tmp_path_factory, *, model: ModelConfig | None = None, security: SecurityConfig | None = None,
                  **batching) -> ServerConfig:
    """Loopback, port 0 for gRPC and metrics, one device, float32 tiny unless told otherwise."""
    return ServerConfig(
        host="127.0.0.1", port=0, metrics_port=0, compile_cache_dir=str(cache_dir(tmp_path_factory)),
        drain_grace_s=10.0,
        model=model or ModelConfig(preset="tiny", dtype="float32", num_devices=1),
        batching=BatchingConfig(**{"bucket_sizes": BUCKETS, **batching}),
        security=security or SecurityConfig(),
    )


@contextlib.contextmanager
def server_with_runner(tmp_path_factory, wrap, *, model: ModelConfig | None = None, native_port: int | None = None,
                       **batching):
    """A started server (``server_config``; ``native_port``: with the native Forward port) whose
    engine steps go through ``wrap(engine)``, the step runner, kept as the handle's ``runner``;
    stopped on exit."""
    runners = []
    config = dataclasses.replace(server_config(tmp_path_factory, model=model, **batching), native_port=native_port)
    handle = create_server(config, step_runner=lambda engine: runners.append(wrap(engine)) or runners[-1])
    try:
        handle.wait_ready(timeout=300)
        handle.runner = runners[0]
        yield handle
    finally:
        handle.stop(grace=5)


def host_params(layer, dtype) -> dict[str, np.ndarray]:
    """A LoadedLayer's params as the engine holds them: router tensors fp32, the rest in ``dtype``
    (expert weights the engine prepared for the native CPU kernel read back as arrays)."""
    router = {"router_weight", "expert_bias"}
    return {name: np.asarray(cpu.dense_weights(value)).astype(np.float32 if name in router else dtype)
            for name, value in layer.params.items()}


REFERENCE_ROWS = 32  # references run padded to this many rows: one compilation per layer config


@functools.partial(jax.jit, static_argnames=("cfg",))
def _moe_layer_padded(params, x, num_valid, cfg):
    return moe_layer(params, x, cfg, valid_tokens=num_valid, return_routing=True)


def reference_forward(params: dict, cfg, x: np.ndarray, dtype) -> tuple[np.ndarray, dict]:
    """In-process moe_layer on the same weights: (output [T, H] in x's dtype, routing).

    x is padded to REFERENCE_ROWS rows marked invalid (tokens are independent, and padding rows
    are not routed), so every call with the same layer config reuses one compilation.
    """
    n = len(x)
    padded = np.zeros((REFERENCE_ROWS, x.shape[1]), dtype)
    padded[:n] = x.astype(dtype)
    placed = MoEParams.from_dict({k: jnp.asarray(v) for k, v in params.items()})
    out, routing = _moe_layer_padded(placed, jnp.asarray(padded), n, cfg)
    routing = {k: np.asarray(v) for k, v in routing.items()}
    routing["topk_ids"], routing["topk_weights"] = routing["topk_ids"][:n], routing["topk_weights"][:n]
    return np.asarray(out)[:n].astype(x.dtype), routing


@functools.partial(jax.jit, static_argnames=("cfg", "coeff"))
def _aux_loss_padded(logits, counts, num_valid, coeff, cfg):
    scores, _ = router_ops.fused_topk_with_score_function(logits, cfg.topk, score_function=cfg.score_function,
                                                          compute_aux_scores=True)
    scores = jnp.where((jnp.arange(logits.shape[0]) < num_valid)[:, None], scores, 0.0)
    return router_ops.fused_moe_aux_loss(scores, counts, cfg.topk, coeff, total_num_tokens=num_valid)


def reference_aux_loss(params: dict, cfg, x: np.ndarray, ids: np.ndarray, coeff: float, *, logits=None) -> float:
    """The router's load-balancing loss over x's tokens (TE ``fused_moe_aux_loss`` on the aux scores)."""
    if logits is None:
        logits = x.astype(np.float32) @ params["router_weight"].astype(np.float32)
    padded = np.zeros((REFERENCE_ROWS, cfg.num_experts), np.float32)
    padded[:len(logits)] = logits
    counts = np.bincount(ids.reshape(-1), minlength=cfg.num_experts).astype(np.int32)
    return float(_aux_loss_padded(jnp.asarray(padded), jnp.asarray(counts), len(logits), float(coeff), cfg))


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0.0 when absent); labels must match exactly."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if found == {k: str(v) for k, v in labels.items()}:
            return float(match.group(3))
    return 0.0


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1", family=socket.AF_INET):
    """Another process's listener, as far as a server can tell: a listening socket on a free port
    (yields the port)."""
    with socket.socket(family, socket.SOCK_STREAM) as held:
        held.bind((host, 0))
        held.listen()
        yield held.getsockname()[1]


def poll(condition, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds (AssertionError after ``timeout`` s): never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.01)


@contextlib.contextmanager
def queue_full(target: str, registry, hidden: int = 64, layer: int = 1):
    """A server started with ``max_queue_size=1`` and a long gather (``max_queue_delay_ms``, no
    idle fast path) has its one place held by a waiting 2-token call until the block ends: every
    other request is refused meanwhile. The waiting call is cancelled (dropped at once) at the end."""
    import grpc

    from expertd.client.messages import forward_request
    from expertd.client.pb.v1 import expert_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        waiting = expert_pb2_grpc.ExpertServiceStub(channel).Forward.future(
            forward_request(np.ones((2, hidden), np.float32), layer, False), timeout=60)
        poll(lambda: registry.get_sample_value("expertd_pending_requests") == 1)
        try:
            yield
        finally:
            waiting.cancel()
            poll(lambda: registry.get_sample_value("expertd_pending_requests") == 0)


@contextlib.contextmanager
def one_place_server(tmp_path_factory):
    """(handle, registry) of a started server with one queue place (``max_queue_size=1``) and a
    30 s gather for a step less than full (no idle fast path): while ``queue_full`` holds the
    place every other request is refused; a full step (the largest bucket's rows) runs at once."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    config = server_config(tmp_path_factory, max_queue_size=1, max_queue_delay_ms=30000, inline_step_max_ms=0)
    handle = create_server(config, registry=registry)
    try:
        handle.wait_ready(timeout=300)
        yield handle, registry
    finally:
        handle.stop(grace=5)


class Gate:
    """The step runner: the real engine; while ``hold`` is set, forward steps wait for it to clear;
    while ``widen`` is set, they answer one column too many (a server bug the front ends survive)."""

    def __init__(self, engine):
        self.engine = engine
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.widen = False

    def forward(self, layer, tokens, num_valid, token_ids=None):
        if self.hold is not None:
            self.entered.set()
            assert self.hold.wait(60)
        result = self.engine.forward(layer, tokens, num_valid, token_ids=token_ids)
        if self.widen:
            return result._replace(output=np.pad(result.output, ((0, 0), (0, 1))))
        return result

    def route(self, layer, tokens, num_valid, **options):
        return self.engine.route(layer, tokens, num_valid, **options)


class ServeProcess:
    """An ``expertd serve`` subprocess: its ``process``, gRPC ``target``, metrics port and the file
    its output goes to."""

    def __init__(self, process: subprocess.Popen, target: str, metrics_port: int, log: pathlib.Path):
        self.process, self.target, self.metrics_port, self.log = process, target, metrics_port, log

    def memory_kib(self, field: str) -> int:
        status = pathlib.Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


@contextlib.contextmanager
def serve_process(tmp_path_factory, *flags: str, env: dict | None = None):
    """``expertd serve`` (tiny, one layer, fp32, buckets 1/8, loopback, free ports) with ``flags``
    added, in its own process; stopped (SIGTERM, then SIGKILL) on exit."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", "--preset", "tiny", "--num-layers", "1", "--dtype", "float32",
               "--num-devices", "1", "--bucket-sizes", "1,8", "--drain-grace-s", "2",
               "--compile-cache-dir", str(cache_dir(tmp_path_factory)), *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    try:
        deadline = time.monotonic() + 300
        while "ready:" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("server did not start:\n" + log.read_text())
            time.sleep(0.2)
        text = log.read_text()
        port = int(re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", text).group(1))
        metrics = int(re.search(r"metrics on https?://[^:]+:(\d+)", text).group(1))
        yield ServeProcess(process, f"127.0.0.1:{port}", metrics, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
