"""What a multi-host follower (process 1..N-1) serves: its Engine, grpc.health.v1 and metrics.

The follower holds its shard of the experts in its own Engine (same configuration as the leader,
so the same global mesh) and runs the steps the leader sends (`expertd.server.multihost.follow`).
It answers health on the gRPC port with the leader's service names ("", "liveness",
"readiness"; Kubernetes probes are the same for every pod of a group) and exports the metrics
that make sense without a front end: readiness, build info, compilations, steps and step time.
"""
from __future__ import annotations

import concurrent.futures

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

from expertd.server import startup
from expertd.server.app import PROBE_SERVICES
from expertd.server.config import ServerConfig
from expertd.server.metrics import Metrics
from expertd.server.version import VERSION

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FollowerServer:
    """Loads the model and starts health + metrics at once (readiness NOT_SERVING until `set_ready`).

    Attributes: `engine`, `metrics`, `port` (gRPC health) and `metrics_port`, as bound.
    """

    def __init__(self, config: ServerConfig):
        disable_created_metrics()
        self.engine = startup.build(config).engine
        self.metrics = Metrics(CollectorRegistry(), token_buckets=self.engine.buckets)
        self.metrics.set_build_info(version=VERSION, jax_version=jax.__version__, grpc_version=grpc.__version__,
                                    platform=self.engine.platform)
        self.metrics.set_ready(False)
        self.engine.add_compile_listener(lambda event: self.metrics.observe_compile(event.seconds))
        host = config.host.strip("[]")
        self._httpd, _ = start_http_server(config.metrics_port, addr=host, registry=self.metrics.registry)
        self.metrics_port = self._httpd.server_port
        self._health = health.HealthServicer()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="expertd-health"))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{config.host}:{config.port}")
        self.set_ready(False)
        self._health.set("liveness", SERVING)
        self._server.start()

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
        self._httpd.shutdown()
        self._httpd.server_close()
