"""``expertd loadtest``: closed-loop (concurrency sweep) and open-loop (Poisson rate) load generation.

Each step of a sweep drives one load level against one target for a warm-up phase (not counted)
and then a measured phase bounded by ``duration`` seconds or ``requests`` requests, and never
longer than ``max_seconds`` (requests still in flight then are counted as CANCELLED). Every
request carries a deadline, so a hung server shows up as DEADLINE_EXCEEDED, not as a hung test.

Per step it reports requests/s, tokens/s, latency p50/p90/p95/p99/max of successful requests and
errors by gRPC status code; ``sent == ok + sum(errors)`` always holds for the measured phase.
Either protocol: ``expertd`` (expertd.v1 Forward through :class:`AsyncExpertClient`) or ``kserve``
(inference.GRPCInferenceService/ModelInfer on model ``moe-layer-<layer>``). The target takes every
form the client does (one server or replicas: ``expertd.client.channel``), balanced the same way;
``retries`` (default 0: every failure counts) turns on the client's retries; no client-side throttling.

Shapes: every request is ``x [T, H]``, T drawn from the token distribution, H the server's.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable

import grpc
import ml_dtypes
import numpy as np

from expertd.client import errors
from expertd.client.aio import AsyncExpertClient
from expertd.client.channel import TlsOptions, auth_metadata, normalize_tls, open_channel
from expertd.client.kserve_protos import service_grpc, service_pb2

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}
KSERVE_DATATYPES = {"bfloat16": "BF16", "float32": "FP32", "float16": "FP16"}
PERCENTILES = (50, 90, 95, 99)
INPUT_OFFSETS = 1024  # distinct inputs of each size T the load test sends


def kserve_model_name(layer: int) -> str:
    """The KServe / Triton model that serves MoE layer ``layer``."""
    return f"moe-layer-{layer}"


@dataclasses.dataclass(frozen=True)
class TokenDistribution:
    """Tokens per request: ``"16"`` (fixed), ``"8-64"`` (uniform integers, both ends included) or
    ``"1,8,64"`` (uniform choice among the values)."""

    values: tuple[int, ...] = ()
    low: int = 0
    high: int = 0
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> TokenDistribution:
        text = spec.strip()
        try:
            if "-" in text:
                low, high = (int(part) for part in text.split("-", 1))
                if not 1 <= low <= high:
                    raise ValueError
                return cls(low=low, high=high, spec=text)
            values = tuple(int(part) for part in text.split(","))
            if not values or min(values) < 1:
                raise ValueError
            return cls(values=values, spec=text)
        except ValueError:
            raise ValueError(f"tokens: expected N, LOW-HIGH or N1,N2,... of positive integers, got {spec!r}") from None

    @property
    def maximum(self) -> int:
        return max(self.values) if self.values else self.high

    def sample(self, rng: np.random.Generator) -> int:
        if self.values:
            return self.values[0] if len(self.values) == 1 else int(rng.choice(self.values))
        return int(rng.integers(self.low, self.high + 1))


@dataclasses.dataclass(frozen=True)
class LoadTestConfig:
    """One sweep. Exactly one of ``concurrency`` (closed loop) and ``rates`` (open loop, req/s)
    is non-empty; at least one of ``duration`` and ``requests`` bounds each measured phase."""

    target: str
    layer: int = 0
    protocol: str = "expertd"
    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    duration: float | None = 5.0
    requests: int | None = None
    warmup: float = 1.0
    tokens: TokenDistribution = TokenDistribution(values=(16,), spec="16")
    dtype: str = "bfloat16"
    timeout: float = 10.0
    max_seconds: float = 600.0
    max_inflight: int = 1024
    seed: int = 0
    tls: bool | TlsOptions = False
    token: str | None = None
    retries: int = 0

    def __post_init__(self):
        if self.protocol not in ("expertd", "kserve"):
            raise ValueError(f"protocol: expected 'expertd' or 'kserve', got {self.protocol!r}")
        if bool(self.concurrency) == bool(self.rates):
            raise ValueError("give either concurrency levels (closed loop) or request rates (open loop), not both")
        if any(c < 1 for c in self.concurrency) or any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ValueError("concurrency levels must be >= 1 and request rates > 0")
        if self.duration is None and self.requests is None:
            raise ValueError("give duration or requests (or both) to bound each step")
        if (self.duration is not None and self.duration <= 0) or (self.requests is not None and self.requests < 1):
            raise ValueError("duration must be > 0 seconds and requests >= 1")
        if self.warmup < 0 or self.timeout <= 0 or self.max_seconds <= 0 or self.max_inflight < 1:
            raise ValueError("warmup must be >= 0; timeout, max_seconds and max_inflight > 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


@dataclasses.dataclass
class StepStats:
    """What one step measured (the warm-up phase excluded)."""

    mode: str  # "concurrency" | "rate"
    load: float
    sent: int = 0
    ok: int = 0
    tokens_ok: int = 0
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    latencies: list[float] = dataclasses.field(default_factory=list)
    first_send: float | None = None
    last_done: float | None = None
    # (wall, CPU) clocks at the first measured send; the wall clock at the last answer, the CPU clock
    # at the step's end (twice a step, not per answer: beside gRPC's threads it is a costly syscall)
    window_open: tuple[float, float] | None = None
    window_close_wall: float | None = None
    window_close_cpu: float | None = None

    def record(self, code: str, tokens: int, latency: float, done: float) -> None:
        if code == "OK":
            self.ok += 1
            self.tokens_ok += tokens
            self.latencies.append(latency)
        else:
            self.errors[code] += 1
        if self.last_done is None or done >= self.last_done:
            self.last_done = done
            self.window_close_wall = time.time()

    @property
    def completed(self) -> int:
        return self.ok + sum(self.errors.values())

    @property
    def elapsed(self) -> float:
        if self.first_send is None or self.last_done is None:
            return 0.0
        return max(self.last_done - self.first_send, 1e-9)

    def summary(self) -> dict:
        elapsed = self.elapsed
        lat = np.asarray(self.latencies) * 1e3
        latency_ms = {f"p{p}": float(np.percentile(lat, p)) for p in PERCENTILES} if lat.size else {}
        if lat.size:
            latency_ms.update(max=float(lat.max()), mean=float(lat.mean()))
        return {
            self.mode: int(self.load) if self.mode == "concurrency" else self.load,
            "sent": self.sent,
            "completed": self.completed,
            "ok": self.ok,
            "errors": dict(sorted(self.errors.items())),
            "elapsed_s": elapsed,
            "requests_per_s": self.ok / elapsed if elapsed else 0.0,
            "tokens_per_s": self.tokens_ok / elapsed if elapsed else 0.0,
            "latency_ms": latency_ms,
            **self._window_summary(),
        }

    def _window_summary(self) -> dict:
        """The measured window on the wall clock and the client's own CPU per answered request
        (a load generator near one core per process is itself the bottleneck)."""
        (wall0, cpu0), wall1, cpu1 = self.window_open or (None, None), self.window_close_wall, self.window_close_cpu
        if None in (wall0, wall1, cpu1) or not self.completed:
            return {}
        return {"window_unix_s": [wall0, wall1], "client_cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / self.completed}


class _Window:
    """Decides, per send, whether a request is warm-up, measured, or not sent at all. The window
    opens with the first send after the warm-up and lasts ``duration`` from there: a warm-up request
    still in flight (a first compile) delays the window instead of eating into it."""

    def __init__(self, stats: StepStats, start: float, config: LoadTestConfig):
        self.stats = stats
        self.measure_from = start + config.warmup
        self.duration = config.duration if config.duration is not None else math.inf
        self.stop_at = math.inf  # set when the window opens
        self.max_requests = config.requests if config.requests is not None else math.inf
        self.stopped = False

    def claim(self, now: float) -> str:
        if now < self.measure_from:
            return "warmup"
        if self.stopped or now >= self.stop_at or self.stats.sent >= self.max_requests:
            self.stopped = True
            return "stop"
        self.stats.sent += 1
        if self.stats.first_send is None:
            self.stats.first_send = now
            self.stats.window_open = (time.time(), time.process_time())
            self.stop_at = now + self.duration
        return "measure"


Call = Callable[[int], Awaitable[None]]


def status_name(error: BaseException) -> str:
    """The gRPC status code name of a failed call (``RESOURCE_EXHAUSTED``)."""
    if isinstance(error, errors.ExpertError):
        return error.code.name
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error.code().name
    return "CLIENT_" + type(error).__name__


async def _timed(call: Call, tokens: int, phase: str, stats: StepStats) -> None:
    started = time.perf_counter()
    code = "OK"
    try:
        await call(tokens)
    except asyncio.CancelledError:
        code = "CANCELLED"  # the step ran past max_seconds
        raise
    except (errors.ExpertError, grpc.RpcError) as error:
        code = status_name(error)
    finally:
        if phase == "measure":
            now = time.perf_counter()
            stats.record(code, tokens, now - started, now)


async def _closed_loop(call: Call, window: _Window, concurrency: int, config: LoadTestConfig, rng) -> None:
    async def worker() -> None:
        while (phase := window.claim(time.perf_counter())) != "stop":
            await _timed(call, config.tokens.sample(rng), phase, window.stats)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(call: Call, window: _Window, rate: float, config: LoadTestConfig, rng) -> None:
    slots = asyncio.Semaphore(config.max_inflight)
    tasks: set[asyncio.Task] = set()

    async def one(tokens: int, phase: str) -> None:
        try:
            await _timed(call, tokens, phase, window.stats)
        finally:
            slots.release()

    next_send = time.perf_counter()
    try:
        while True:
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            phase = window.claim(next_send)  # Poisson schedule time, not the (later) wake-up time
            if phase == "stop":
                break
            await slots.acquire()
            task = asyncio.ensure_future(one(config.tokens.sample(rng), phase))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_send += rng.exponential(1.0 / rate)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_step(call: Call, config: LoadTestConfig, mode: str, load: float, progress=None) -> StepStats:
    """Drive one load level; returns the measured phase's stats."""
    stats = StepStats(mode=mode, load=load)
    window = _Window(stats, time.perf_counter(), config)
    rng = np.random.default_rng([config.seed, int(load * 1000)])
    limit = config.max_seconds
    if config.duration is not None:
        # a warm-up request may delay the window by up to one timeout, a measured one end it by another
        limit = min(limit, config.warmup + config.duration + 2 * config.timeout + 5.0)
    if mode == "concurrency":
        loop = _closed_loop(call, window, int(load), config, rng)
    else:
        loop = _open_loop(call, window, load, config, rng)
    ticker = asyncio.ensure_future(progress.run(stats, window)) if progress is not None else None
    try:
        await asyncio.wait_for(loop, timeout=limit)
    except TimeoutError:
        window.stopped = True
    finally:
        stats.window_close_cpu = time.process_time()
        if ticker is not None:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            progress.finish(stats, window)
    return stats


class _Target:
    """One connection to the server under test, speaking one protocol."""

    def __init__(self, config: LoadTestConfig):
        self.config = config
        self.hidden_size = 0
        self._inputs: np.ndarray | None = None
        if config.protocol == "expertd":
            self._client = AsyncExpertClient(config.target, timeout=config.timeout, retries=config.retries,
                                             tls=config.tls, token=config.token, throttle=None)
        else:
            self._channel = open_channel(config.target, aio=True, tls=normalize_tls(config.tls),
                                         retries=config.retries)
            self._stub = service_grpc.GRPCInferenceServiceStub(self._channel)
            self._metadata = auth_metadata(config.token)

    async def open(self) -> None:
        """Ask the server for the layer's hidden size and prepare the random inputs."""
        layer = self.config.layer
        if self.config.protocol == "expertd":
            info = await self._client.model_info()
            sizes = {int(item.index): int(item.hidden_size) for item in info.layers}
            if layer not in sizes:
                raise ValueError(f"layer: the server holds layers {sorted(sizes)}, not {layer}")
            self.hidden_size = sizes[layer]
        else:
            try:
                metadata = await self._stub.ModelMetadata(
                    service_pb2.ModelMetadataRequest(name=kserve_model_name(layer)),
                    timeout=self.config.timeout,
                    metadata=self._metadata,
                )
            except grpc.RpcError as error:
                raise errors.from_rpc_error(error) from None
            self.hidden_size = int(metadata.inputs[0].shape[-1])
        # A pool of rows; each request takes T consecutive rows at a random offset, so requests
        # differ and the router spreads them over the experts as real traffic would.
        self._rng = np.random.default_rng([self.config.seed, 1])
        shape = (self.config.tokens.maximum + INPUT_OFFSETS - 1, self.hidden_size)
        self._inputs = self._rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[self.config.dtype])

    async def call(self, tokens: int) -> None:
        offset = int(self._rng.integers(0, len(self._inputs) - tokens + 1))
        x = self._inputs[offset:offset + tokens]
        if self.config.protocol == "expertd":
            await self._client.forward(x, layer=self.config.layer)
            return
        request = service_pb2.ModelInferRequest(model_name=kserve_model_name(self.config.layer))
        request.inputs.add(name="hidden_states", datatype=KSERVE_DATATYPES[self.config.dtype], shape=x.shape)
        request.raw_input_contents.append(x.tobytes())
        await self._stub.ModelInfer(request, timeout=self.config.timeout, metadata=self._metadata)

    async def close(self) -> None:
        await (self._client.close() if self.config.protocol == "expertd" else self._channel.close())


async def run_loadtest(config: LoadTestConfig, progress=None) -> dict:
    """Run the whole sweep; returns the report (the ``--json`` document)."""
    target = _Target(config)
    steps = []
    try:
        await target.open()
        mode, levels = ("concurrency", config.concurrency) if config.concurrency else ("rate", config.rates)
        for index, load in enumerate(levels):
            if progress is not None:
                progress.start_step(index, len(levels), mode, load)
            steps.append((await run_step(target.call, config, mode, load, progress)).summary())
    finally:
        await target.close()
    return {
        "target": config.target,
        "protocol": config.protocol,
        "layer": config.layer,
        "model": kserve_model_name(config.layer) if config.protocol == "kserve" else None,
        "mode": mode,
        "hidden_size": target.hidden_size,
        "dtype": config.dtype,
        "tokens": config.tokens.spec,
        "warmup_s": config.warmup,
        "duration_s": config.duration,
        "requests": config.requests,
        "timeout_s": config.timeout,
        "retries": config.retries,
        "steps": steps,
    }

