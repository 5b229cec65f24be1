"""What a multi-host follower (process 1..N-1) serves: its Engine, grpc.health.v1 and metrics.

The follower holds its shard of the experts in its own Engine (same configuration as the leader,
so the same global mesh) and runs the steps the leader sends (`expertd.server.multihost.serve.follow`).
It answers health on the gRPC port with the leader's service names ("", "liveness",
"readiness"; Kubernetes probes are the same for every pod of a group) and exports the metrics
that make sense without a front end: readiness, build info, compilations, steps and step time.

Its listeners follow the leader's security settings: health over TLS with `--tls-cert` (mutual
with `--tls-client-ca`), metrics at `--metrics-host` (loopback when auth is on and
`--metrics-auth` is not) behind the token with `--metrics-auth` and TLS with `--metrics-tls`,
served by the leader's endpoint (`expertd.server.metrics.http`) on an event loop of its own.
Both ports are checked before the model loads (`expertd.server.transport.listen`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, disable_created_metrics

from expertd.server.app import PROBE_SERVICES
from expertd.server.config import ServerConfig
from expertd.server.engine import build
from expertd.server.metrics import http
from expertd.server.metrics.families import Metrics
from expertd.server.transport import listen
from expertd.server.version import VERSION

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FollowerServer:
    """Loads the model and starts health + metrics at once (readiness NOT_SERVING until `set_ready`).

    Raises ValueError for a bad security setting and OSError naming the flag for a port another
    process listens on, both before the model loads.

    Attributes: `engine`, `metrics`, `port` (gRPC health), `metrics_port` and `metrics_url`, as bound;
    `security` (the start-up line, as the leader's `ServerHandle.security_summary`).
    """

    def __init__(self, config: ServerConfig):
        disable_created_metrics()
        credentials = config.security.credentials()  # ValueError naming a bad option: fail closed
        listen.check_free(config.host, config.port, "--port")
        listen.check_free(config.metrics_bind_host, config.metrics_port, "--metrics-port")
        self.engine = build.build_served(config).engine
        self.metrics = Metrics(CollectorRegistry(), token_buckets=self.engine.buckets)
        self.metrics.set_build_info(version=VERSION, jax_version=jax.__version__, grpc_version=grpc.__version__,
                                    platform=self.engine.platform)
        self.metrics.set_ready(False)
        self.engine.add_compile_listener(lambda event: self.metrics.observe_compile(event.seconds))
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="expertd-follower-metrics",
                                             daemon=True)
        self._loop_thread.start()
        self._endpoint = http.metrics_endpoint(config, credentials, self.metrics.registry)
        try:
            self.metrics_port = self._on_loop(self._endpoint.start(config.metrics_bind_host, config.metrics_port))
        except OSError as exc:
            self._close_loop()
            raise listen.bind_error(f"{config.metrics_bind_host}:{config.metrics_port}", "--metrics-host, "
                                    "--metrics-port", exc.strerror or str(exc)) from exc
        self.metrics_url = http.metrics_url(config, self._endpoint)
        self._health = health.HealthServicer()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="expertd-health"))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        address = f"{config.host}:{config.port}"
        try:
            self.port = self._server.add_secure_port(address, listen.grpc_server_credentials(credentials.tls)) \
                if credentials.tls else self._server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind", without the reason
            self._close_loop()
            raise listen.bind_error(address, "--host, --port", "the address is in use or not on this host") from None
        self.tls = credentials.tls is not None
        self.security = listen.security_summary(config, credentials, self.metrics_url)
        self.set_ready(False)
        self._health.set("liveness", SERVING)
        self._server.start()

    def _on_loop(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _close_loop(self) -> None:
        """Close the metrics endpoint, then its event loop and thread."""
        self._on_loop(self._endpoint.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)
        self._loop.close()

    def set_ready(self, ready: bool) -> None:
        """Health "" and "readiness" (and the ready gauge) follow `ready`; "liveness" stays SERVING."""
        for name in ("", "readiness"):
            self._health.set(name, SERVING if ready else NOT_SERVING)
        self.metrics.set_ready(ready)

    def mark_lost(self) -> None:
        """The group is broken: everything NOT_SERVING, liveness included (the process is exiting)."""
        for name in ("", *PROBE_SERVICES):
            self._health.set(name, NOT_SERVING)
        self.metrics.set_ready(False)

    def stop(self) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(0)
        self._close_loop()
