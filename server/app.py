"""Server assembly and lifecycle: ``create_server(config)`` -> a running server handle.

Start-up, in order:
1. ``expertd.server.engine.build.build_served``: load the model (preset or checkpoint; ValueError on bad
   input), place and prepare the weights once, build the Engine; its ModelDescription is what the
   front ends see.
2. Start a grpc.aio server on its own thread and event loop: ``expertd.v1.ExpertService`` and the
   KServe v2 service (both over the Batcher and the ModelDescription, never the engine),
   ``grpc.health.v1`` (services "", each served service, "liveness", "readiness";
   ``expertd.server.transport.drain.HealthServicer``), reflection (optional), the metrics and bearer-token
   wrappers (applied once per method: ``expertd.server.transport.interceptors``) and the drain's
   stream-input wrapper (``expertd.server.transport.drain.StreamInputs``), TLS / mutual TLS from the
   credentials read and checked at start (``SecurityConfig.credentials``: fail closed), message
   limits sized from the request limit. ``GET /metrics`` is served on the same event loop
   (``expertd.server.metrics.http``) at ``config.metrics_bind_host`` (loopback by default when auth
   is on), optionally behind TLS and the token. With ``--native-port``, the native Forward port
   (``expertd.server.native_front``: gRPC C++, the same token and TLS, the same batcher; built in
   ``create_server`` before the model loads), not accepting until SERVING. With ``--shm-channel``, the
   same-host channel (``expertd.server.shm_channel``: the unary handlers, token and limit of the
   gRPC port). The start-up log states TLS, mTLS, auth and metrics (``security_summary``).
3. Warm up (``expertd.server.engine.warmup``: compile every bucket) on the device-worker thread while
   health says NOT_SERVING ("liveness" is SERVING from the start); then SERVING and
   ``expertd_model_ready`` 1, and (expert-parallel mesh) the expert load balancer starts
   (``expertd.server.engine.rebalancer``; it stops first when draining).

Drain (``handle.stop()``, SIGTERM in ``expertd serve``), all within the grace:
1. ``expertd_model_ready`` 0; the native Forward port refuses new calls and the calls queued on it
   are handed to the batcher and answered; the batcher stops accepting (new Forward / Route / ModelInfer calls
   get UNAVAILABLE "draining", retryable on another replica); health NOT_SERVING for every service
   (open Watches receive it at once, so balancing clients stop picking this server); the input of
   every request stream is closed (ForwardStream answers what it has read, then ends UNAVAILABLE).
2. Accepted requests, queued ones included, finish.
3. The port stays open, answering UNAVAILABLE, while calls still arrive (another within
   ``LINGER_QUIET_S``), up to ``--drain-linger-s`` after the drain began: clients move to other
   replicas before the port closes. (Why: calls that reach grpc's server core after ``stop`` began
   are cancelled by it, CANCELLED, before any handler sees them.)
4. Watches end; the native port, the channel (its clients get UNAVAILABLE at once) and the gRPC
   server stop (nothing is left to wait for); the metrics endpoint closes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable

import grpc
import jax
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, disable_created_metrics

from expertd.server import frontends
from expertd.server.batching.batcher import DRAINING, Batcher
from expertd.server.config import ServerConfig
from expertd.server.config.credentials import Credentials
from expertd.server.engine import build, rebalancer, warmup
from expertd.server.frontends import ExpertServicer, SharedMemoryRegistry
from expertd.server.metrics import http, shm_channel
from expertd.server.metrics.families import Metrics
from expertd.server.metrics.http import MetricsEndpoint
from expertd.server.native_front import NativeFront, NativeUnavailable
from expertd.server.native_front import build_module as build_native_front
from expertd.server.shm_channel import ShmChannel
from expertd.server.transport import event_loop, listen
from expertd.server.transport.drain import HealthServicer, StreamInputs
from expertd.server.transport.reflection import enable_reflection
from expertd.server.transport.registration import WrappingServer, wrapping
from expertd.server.version import VERSION

log = logging.getLogger(__name__)

PROBE_SERVICES = ("liveness", "readiness")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
LINGER_QUIET_S = 0.2  # drain step 3: no new call for this long means clients have moved on


@dataclasses.dataclass
class _Parts:
    """What the server thread builds and the handle's methods use."""

    loop: asyncio.AbstractEventLoop
    server: grpc.aio.Server
    health: HealthServicer
    streams: StreamInputs
    batcher: Batcher
    services: tuple[str, ...]
    metrics_endpoint: MetricsEndpoint
    native: NativeFront | None = None
    channel: ShmChannel | None = None


class ServerHandle:
    """A running server (see module docstring). Thread-safe; every test and ``expertd serve`` use it.

    Attributes: ``port``, ``metrics_port`` and ``native_port`` (the bound ports; ``native_port`` 0
    without ``--native-port``), ``metrics_url``, ``config``,
    ``credentials`` (what start-up read: token, TLS material), ``served`` (what start-up built:
    ``served.info()``, ``served.notes()``), ``engine`` (its Engine), ``model`` (the
    ModelDescription the front ends see), ``metrics`` (the Metrics on ``registry``), ``registry``,
    ``event_loop`` (which loop serves: "uvloop 0.23.0", "asyncio"; ``expertd.server.transport.event_loop``).
    """

    def __init__(self, config: ServerConfig, served: build.Served, registry: CollectorRegistry,
                 progress: Callable | None, step_runner, on_warm: Callable[[], None] | None,
                 loop: tuple[Callable, str]):
        self.config = config
        self.served = served
        self.engine = served.engine
        self.model = served.describe(config.model.name, config.batching)
        self.registry = registry
        self.metrics = Metrics(registry, token_buckets=self.model.buckets)
        self.metrics.set_build_info(version=VERSION, jax_version=jax.__version__, grpc_version=grpc.__version__,
                                    platform=self.model.mesh.platform)
        self.metrics.set_ready(False)
        self.engine.add_compile_listener(lambda event: self.metrics.observe_compile(event.seconds))
        self.rebalancer = rebalancer.Rebalancer(self.engine, self.metrics, interval_s=config.model.eplb_interval_s)
        self.port = self.metrics_port = self.native_port = 0
        self.metrics_url = ""
        self.credentials = Credentials()
        self._step_runner = step_runner or self.engine
        self._on_warm = on_warm
        self._progress = progress
        self._started = threading.Event()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._parts: _Parts | None = None
        self._stop_requested: asyncio.Event | None = None
        self._grace = config.drain_grace_s
        self._linger = config.drain_linger_s
        self._loop_factory, self.event_loop = loop  # event_loop.loop_factory's (factory, description)
        self._thread = threading.Thread(target=self._run, name="expertd-grpc", daemon=True)

    # -- control (any thread) -----------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until warm-up is done (health SERVING); raises the warm-up failure, or TimeoutError."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server not ready after {timeout}s")
        if self._failure is not None:
            raise RuntimeError(f"server failed to start: {self._failure}") from self._failure

    def stop(self, grace: float | None = None) -> None:
        """Drain and stop (see module docstring); returns when stopped."""
        self.request_stop(grace)
        self._stopped.wait()

    def request_stop(self, grace: float | None = None) -> None:
        """Begin the drain without waiting (safe from a signal handler)."""
        if self._stopped.is_set():
            return
        if grace is not None:
            self._grace = grace
        parts = self._parts
        if parts is not None and self._stop_requested is not None:
            parts.loop.call_soon_threadsafe(self._stop_requested.set)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped; False on timeout."""
        return self._stopped.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._failure is None

    @property
    def batcher(self) -> Batcher:
        return self._parts.batcher

    def security_summary(self) -> str:
        """What the start-up log states of security (``transport.listen.security_summary``)."""
        return listen.security_summary(self.config, self.credentials, self.metrics_url)

    def listening_summary(self) -> str:
        """``gRPC listening on 127.0.0.1:8001 (TLS), event loop uvloop 0.23.0``: what ``expertd serve`` says."""
        tls = " (TLS)" if self.credentials.tls else ""
        native = f", native Forward port {self.native_port}{tls}" if self.native_port else ""
        channel = f", same-host channel shm://{self.config.shm_channel}" if self.config.shm_channel else ""
        return f"gRPC listening on {self.config.host}:{self.port}{tls}{native}{channel}, event loop {self.event_loop}"

    # -- server thread --------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the threads waiting on the handle
            self._failure = self._failure or exc
            self._started.set()
            self._ready.set()
        finally:
            self._stopped.set()

    async def _main(self) -> None:
        self._stop_requested = asyncio.Event()
        self._parts = await self._build()
        log.info("%s", self.security_summary())
        self._started.set()
        try:
            await self._warm_up()
            await self._stop_requested.wait()
            await self._drain()
        finally:
            await self._parts.metrics_endpoint.close()
            if self._parts.native is not None:  # stopped by the drain; here when start-up failed
                await self._parts.native.stop(0.0)
            if self._parts.channel is not None:
                await self._parts.channel.stop(0.0)

    async def _build(self) -> _Parts:
        config, model = self.config, self.model
        self.credentials = credentials = config.security.credentials()  # ValueError naming a bad option
        limit = model.max_message_bytes()
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)])
        # Every service registers through this stand-in: auth, limits and metrics wrap each method once,
        # and request streams read through inputs the drain can close.
        streams = StreamInputs()
        registrar = WrappingServer(wrapping(server, self.metrics, credentials.token, max_request_bytes=limit),
                                   [streams.wrap])
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expertd-device")
        batcher = Batcher(self._step_runner, model, config.batching, self.metrics, executor)
        shm = SharedMemoryRegistry(max_regions=config.shared_memory_regions) if config.shared_memory_regions else None
        servicer, services = frontends.add_services(
            registrar, model=model, batcher=batcher, metrics=self.metrics, batching=config.batching, version=VERSION,
            aux_loss_coeff=config.aux_loss_coeff, placements=self.rebalancer, shared_memory=shm)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, registrar)
        for name in ("", *services, "readiness"):
            await health.set(name, NOT_SERVING)
        await health.set("liveness", SERVING)
        if config.reflection:
            enable_reflection(registrar, (*services, HEALTH_SERVICE))
        channel = self._start_channel(servicer, health, credentials, limit) if config.shm_channel else None
        address = f"{config.host}:{config.port}"
        try:
            if credentials.tls:
                self.port = server.add_secure_port(address, listen.grpc_server_credentials(credentials.tls))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind", without the reason
            raise listen.bind_error(address, "--host, --port", "the address is in use or not on this host") from None
        await server.start()
        endpoint = http.metrics_endpoint(config, credentials, self.registry)
        try:
            self.metrics_port = await endpoint.start(config.metrics_bind_host, config.metrics_port)
        except OSError as exc:
            await server.stop(0)
            await endpoint.close()
            raise listen.bind_error(f"{config.metrics_bind_host}:{config.metrics_port}", "--metrics-host, "
                                    "--metrics-port", exc.strerror or str(exc)) from exc
        self.metrics_url = http.metrics_url(config, endpoint)
        native = await self._start_native(servicer, credentials, limit, server, endpoint) \
            if config.native_port is not None else None
        return _Parts(asyncio.get_running_loop(), server, health, streams, batcher, tuple(services), endpoint, native,
                      channel)

    def _start_channel(self, servicer: ExpertServicer, health: HealthServicer, credentials: Credentials, limit: int):
        """The same-host channel (``--shm-channel``): the gRPC port's unary handlers, its token, its limit."""
        c, handlers = self.config, {**servicer.unary_methods(), **health.unary_methods()}
        channel = ShmChannel.start(c.shm_channel, handlers, slots=c.shm_channel_slots, token=credentials.token,
                                   spin_us=c.shm_channel_spin_us,
                                   max_message_bytes=limit, clients=c.shm_channel_clients, group=c.shm_channel_group,
                                   direct_servicer=servicer if self._step_runner is self.engine else None)
        shm_channel.register(self.registry, self.metrics.grpc_calls, channel.stats)
        return channel

    async def _start_native(self, servicer: ExpertServicer, credentials: Credentials, limit: int,
                            server: grpc.aio.Server, endpoint: MetricsEndpoint) -> NativeFront:
        """The native Forward port (``--native-port``), not accepting until warm-up is done."""
        config = self.config
        address = f"{config.host}:{config.native_port}"
        try:
            native = NativeFront.start(
                address, model=self.model, model_info=servicer.current_model_info, batcher=servicer.batcher,
                loop=asyncio.get_running_loop(), queue_tokens=config.batching.queue_tokens,
                queue_calls=config.batching.max_queue_size, max_message_bytes=limit, token=credentials.token,
                tls=credentials.tls, cache_dir=config.native_cpu.cache_dir,
                direct=config.native_direct and self._step_runner is self.engine)
        except OSError as exc:
            await server.stop(0)
            await endpoint.close()
            raise listen.bind_error(address, "--host, --native-port", "in use or not on this host") from exc
        self.native_port = native.port
        native.register_metrics(self.registry, self.metrics.grpc_calls)
        self.rebalancer.add_swap_listener(native.refresh_model_info)  # its GetModelInfo shows placements
        return native

    async def _warm_up(self) -> None:
        parts = self._parts
        try:
            await parts.batcher.run_on_device(self._warm)
            await parts.batcher.calibrate()  # step times for admission
        except Exception as exc:  # noqa: BLE001 - the server stays NOT_SERVING; wait_ready raises it
            log.exception("warm-up failed")
            self._failure = exc
            self._ready.set()
            return
        parts.batcher.start()
        if parts.native is not None:
            parts.native.set_accepting(True)
        self.rebalancer.start(parts.batcher.loads, parts.batcher.run_on_device)
        for name in ("", *parts.services, "readiness"):
            await parts.health.set(name, SERVING)
        self.metrics.set_ready(True)
        self._ready.set()

    def _warm(self) -> None:
        """Device-worker thread: compile every step, then ``on_warm`` (multi-host: the group joins)."""
        warmup.warm_up(self.engine, self._progress)
        if self._on_warm is not None:
            self._on_warm()

    async def _drain(self) -> None:
        """The drain's four steps (module docstring), within the grace."""
        parts = self._parts
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self._grace
        self.metrics.set_ready(False)
        if parts.native is not None:  # its queued calls are accepted ones: the batcher runs them before it drains
            parts.native.set_accepting(False, DRAINING)
            await parts.native.quiesce(max(0.0, deadline - loop.time()))
        drained = asyncio.ensure_future(parts.batcher.drain())  # stops accepting when it first runs
        await self.rebalancer.stop()
        await parts.health.enter_graceful_shutdown()
        parts.streams.close()
        await asyncio.wait({drained}, timeout=max(0.0, deadline - loop.time()))
        if not drained.done():
            drained.cancel()
            log.warning("drain grace of %ss passed with %d requests unanswered", self._grace, parts.batcher.pending)
        await self._linger_while_calls_arrive(min(began + self._linger, deadline))
        await parts.health.end_watches()
        if parts.native is not None:
            await parts.native.stop(max(0.0, deadline - loop.time()))
        if parts.channel is not None:
            await parts.channel.stop(max(0.0, deadline - loop.time()))
        await parts.server.stop(max(0.0, deadline - loop.time()))
        await parts.batcher.close()

    async def _linger_while_calls_arrive(self, until: float) -> None:
        """Drain step 3: wait until no call (health calls aside) started for LINGER_QUIET_S, or ``until``."""
        loop = asyncio.get_running_loop()
        seen = self._calls_started()
        while (left := until - loop.time()) > 0:
            await asyncio.sleep(min(LINGER_QUIET_S, left))
            now = self._calls_started()
            if now == seen:
                return
            seen = now

    def _calls_started(self) -> float:
        """Calls started on this server so far, health checks not counted (``grpc_server_started_total``)."""
        return self.metrics.grpc_calls.calls_started(skip_service=HEALTH_SERVICE)


def create_server(config: ServerConfig, *, registry: CollectorRegistry | None = None,
                  progress: Callable | None = None, layers=None, step_runner: Callable | None = None,
                  on_warm: Callable[[], None] | None = None) -> ServerHandle:
    """Build the model (``build.build_served``), start serving (health NOT_SERVING) and begin warm-up;
    returns at once.

    Raises OSError naming the flag when a port is taken (before the model is built, where it can
    tell; else when the listener binds), ValueError for a configuration it cannot serve.

    Args:
      config: the parsed configuration (ports may be 0: the handle has the bound ones).
      registry: Prometheus registry for the metrics (default: a fresh one).
      progress: called with each ``expertd.server.engine.engine.CompileEvent`` during warm-up.
      layers: LoadedLayers to serve instead of loading ``config.model`` (tests, benchmarks).
      step_runner: ``engine -> what runs the batcher's steps`` (default: the Engine itself;
        multi-host: ``expertd.server.multihost.serve.LeaderEngine``, which first sends each step to the
        other processes).
      on_warm: called on the device-worker thread after warm-up, before the server says SERVING
        (multi-host: waits for the group); a failure there is a warm-up failure.
    """
    disable_created_metrics()  # the *_created series only add noise to every scrape
    listen.check_free(config.host, config.port, "--port")  # before the model loads: OSError naming the flag
    listen.check_free(config.metrics_bind_host, config.metrics_port, "--metrics-port")
    if config.native_port is not None:
        listen.check_free(config.host, config.native_port, "--native-port")
        try:
            build_native_front(config.native_cpu.cache_dir)  # before the model loads: a first build takes a while
        except NativeUnavailable as exc:
            raise ValueError(f"--native-port: the native Forward port cannot be built here: {exc}") from exc
    loop = event_loop.loop_factory(config.event_loop)  # ValueError for a loop that is not installed
    served = build.build_served(config, layers)
    runner = None if step_runner is None else step_runner(served.engine)
    handle = ServerHandle(config, served, registry or CollectorRegistry(), progress, runner, on_warm, loop)
    handle._start()
    return handle
