"""The top-level section (``ServerConfig``: ports, drain, metrics endpoint, the other sections as
fields) and the section table ``SECTIONS`` that ``sources`` reads flags and TOML keys by."""
from __future__ import annotations

import dataclasses
import itertools
import os

from expertd.server.config.batching import BatchingConfig
from expertd.server.config.fields import (
    AUTH_TOKEN_ENV,
    EVENT_LOOPS,
    from_environment,
    option,
    optional_str,
)
from expertd.server.config.model import ModelConfig
from expertd.server.config.multihost import MultihostConfig
from expertd.server.config.native_cpu import NativeCpuConfig
from expertd.server.config.security import SecurityConfig


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("[::]", "address the gRPC server binds, and the metrics endpoint unless --metrics-host "
                              "(or auth) says otherwise ('127.0.0.1' for loopback only)")
    port: int = option(8001, "gRPC port (0: pick a free port; the bound port is printed)", parse=int)
    metrics_port: int = option(8002, "Prometheus /metrics HTTP port (0: pick a free port)", parse=int)
    native_port: int | None = option(None, "also serve Forward from gRPC C++ on this port, Python once per batch "
                                     "(0: a free port; needs the system's libgrpc++: docs/serving.md; "
                                     "$EXPERTD_NATIVE_PORT)", parse=int, metavar="PORT", env="EXPERTD_NATIVE_PORT")
    native_direct: bool = option(True, "on --native-port, a lone call at an idle server, and what queues behind it, "
                                       "run on gRPC C++'s threads, not waking the event loop (one process only)")
    shm_channel: str | None = option(None, "also serve Forward, Route, GetModelInfo, GetExpertLoad and health to "
                                     "processes on this host over shared memory, as shm://NAME "
                                     "(/dev/shm/expertd-NAME.sock, or a path; docs/attention.md)", metavar="NAME",
                                     parse=optional_str, nonempty=True)
    shm_channel_group: str | None = option(None, "on --shm-channel: also let this group's members attach (the socket "
                                           "0660 with this group; default: this user only, 0600)", metavar="GROUP",
                                           parse=optional_str, nonempty=True)
    shm_channel_slots: int = option(4, "on --shm-channel: calls each client may have in flight (a slot each)",
                                    parse=int)
    shm_channel_spin_us: float = option(2000.0, "on --shm-channel: after each answer the server polls, not sleeps, "
                                        "this long for the next call, while no call waits on a step (a CPU woken from "
                                        "idle runs the next call slower; 0: never poll)", parse=float,
                                        metavar="MICROSECONDS")
    shm_channel_clients: int = option(64, "on --shm-channel: clients attached at once (more are refused "
                                      "RESOURCE_EXHAUSTED)", parse=int)
    metrics_host: str | None = option(None, "address the metrics endpoint binds (default: --host, but 127.0.0.1 "
                                      "when auth is on and --metrics-auth is not: unauthenticated metrics of an "
                                      "authenticated server stay local unless asked)", metavar="ADDRESS",
                                      nonempty=True)
    metrics_tls: bool = option(False, "serve /metrics over TLS with --tls-cert / --tls-key (with --tls-client-ca "
                                      "scrapers need a client certificate too)")
    metrics_auth: bool = option(False, "require the bearer token on /metrics ('Authorization: Bearer <token>')")
    drain_grace_s: float = option(30.0, "on SIGTERM: seconds to finish accepted requests before exiting",
                                  parse=float, metavar="SECONDS")
    drain_linger_s: float = option(2.0, "on SIGTERM, once accepted requests are done: answer new calls UNAVAILABLE "
                                   "while they arrive, up to this long after the drain began (clients move to other "
                                   "replicas before the port closes); within the grace", parse=float, metavar="SECONDS")
    compile_cache_dir: str | None = option(os.path.join("~", ".cache", "expertd", "jax"),
                                           "JAX persistent compilation cache ('' disables it)", parse=optional_str,
                                           metavar="DIR")
    reflection: bool = option(True, "serve gRPC server reflection (grpcurl, ghz)")
    shared_memory_regions: int = option(64, "POSIX shared-memory regions callers on this host may register at once "
                                        "(KServe system_shared_memory, expertd.v1 RegisterSharedMemory; "
                                        "docs/shared-memory.md); 0 turns shared memory off", parse=int)
    retain_freed_memory: bool = option(False, "on CPU, keep freed host buffers for reuse (glibc malloc: one arena, "
                                       "no mmap'd blocks): large buckets stop page-faulting, memory stays at its peak")
    cpu_sync_dispatch: bool = option(False, "on CPU, run each step on the calling thread, not JAX's worker thread: "
                                     "a lone call ~0.1 ms sooner, small batches under load (docs/serving.md)")
    aux_loss_coeff: float = option(1e-2, "default load-balancing aux-loss coefficient of Route", parse=float)
    event_loop: str = option("auto", "the gRPC server's event loop: uvloop, asyncio (the standard library's), or "
                             "auto: uvloop where it is installed", metavar="|".join(EVENT_LOOPS))
    ld_preload: str = from_environment("", "LD_PRELOAD", "libraries preloaded into this process (a malloc other "
                                       "than glibc's makes --retain-freed-memory refuse)")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    multihost: MultihostConfig = dataclasses.field(default_factory=MultihostConfig)
    native_cpu: NativeCpuConfig = dataclasses.field(default_factory=NativeCpuConfig)

    def __post_init__(self):
        if not 0 <= self.aux_loss_coeff < float("inf"):  # NaN fails every comparison
            raise ValueError(f"--aux-loss-coeff must be finite and >= 0, got {self.aux_loss_coeff}")
        ports = {f"--{n.replace('_', '-')}": v for n in ("port", "metrics_port", "native_port")
                 if (v := getattr(self, n)) is not None}
        if bad := next(((flag, v) for flag, v in ports.items() if not 0 <= v <= 65535), None):
            raise ValueError(f"{bad[0]} must be between 0 and 65535, got {bad[1]}")
        if same := next(((a, b) for a, b in itertools.combinations(ports, 2) if ports[a] == ports[b] != 0), None):
            raise ValueError(f"{same[0]} and {same[1]} must differ, both are {ports[same[0]]}")
        for name in ("shared_memory_regions", "drain_grace_s", "drain_linger_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.shm_channel_spin_us <= 1e6:
            raise ValueError(f"--shm-channel-spin-us must be between 0 and 1000000, got {self.shm_channel_spin_us}")
        for name in ("shm_channel_slots", "shm_channel_clients"):
            if not 1 <= getattr(self, name) <= 1024:
                raise ValueError(f"--{name.replace('_', '-')} must be between 1 and 1024, got {getattr(self, name)}")
        for name in ("shm_channel", "shm_channel_group"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"--{name.replace('_', '-')} is set but empty: give a name, or leave it unset")
        if self.shm_channel_group is not None and self.shm_channel is None:
            raise ValueError("--shm-channel-group needs --shm-channel NAME")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.metrics_host is not None and not self.metrics_host.strip():
            raise ValueError("--metrics-host is set but empty: give an address, or leave it unset")
        if self.metrics_tls and self.security.tls_cert is None:
            raise ValueError("--metrics-tls needs --tls-cert and --tls-key (it serves the gRPC port's certificate)")
        if self.metrics_auth and not self.security.auth_enabled:
            raise ValueError(f"--metrics-auth needs a bearer token: --auth-token-file, --auth-token, ${AUTH_TOKEN_ENV}")
        if self.multihost.enabled and self.model.num_devices is not None:
            raise ValueError("--num-devices cannot be combined with a multi-host group (its mesh: all devices)")

    @property
    def metrics_bind_host(self) -> str:
        """Where the metrics endpoint listens: --metrics-host; else loopback when auth is on and the
        metrics are not behind the token; else --host."""
        if self.metrics_host is not None:
            return self.metrics_host
        return "127.0.0.1" if self.security.auth_enabled and not self.metrics_auth else self.host


# TOML table -> (section class, flag prefix); None is the top level.
SECTIONS: dict[str | None, tuple[type, str]] = {
    None: (ServerConfig, ""), "model": (ModelConfig, ""), "batching": (BatchingConfig, ""), "security": (SecurityConfig,
    ""), "multihost": (MultihostConfig, ""), "native_cpu": (NativeCpuConfig, "native-cpu-")}


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags and TOML keys (not sections, not environment-only)."""
    return [f for f in dataclasses.fields(cls) if f.name not in SECTIONS and f.metadata.get("flag", True)]


def flag(section: str | None, field: dataclasses.Field) -> str:
    """``--max-queue-delay-ms``, ``--native-cpu-isa``: the flag of a field of ``section``."""
    return "--" + SECTIONS[section][1] + field.name.replace("_", "-")
