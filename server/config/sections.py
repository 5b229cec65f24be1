"""The configuration's frozen dataclasses, one per section, each checking its own values.

Every field made with ``option`` is one flag and one TOML key (``sources`` reads them); a field
made with ``from_environment`` is neither: only an environment variable fills it. Bad values raise
``ValueError`` naming the flag. Nothing here reads flags or the environment; the security files are
read by ``credentials`` (``SecurityConfig.credentials()``), the one module that reads them.

Fail closed: a security option (``nonempty``: token, token file, certificate paths) that is set to
an empty or whitespace-only value is an error wherever it was set (flag, TOML key, environment),
never the same as leaving it unset.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

from expertd.server.config.credentials import Credentials, check_token, load_tls, read_token_file
from expertd.server.transport.event_loop import EVENT_LOOPS

AUTH_TOKEN_ENV = "EXPERTD_AUTH_TOKEN"
DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_COORDINATOR_PORT = 8476
# The expert FFN backends (expertd.kernels.experts.BACKENDS) and the native CPU kernel's
# instruction-set levels, lowest first (expertd.kernels.cpu.ISA_LEVELS); a test keeps them equal.
EXPERT_BACKENDS = ("reference", "ragged_dot", "capacity", "expert_loop", "native_cpu", "pallas")
NATIVE_CPU_ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, metavar: str | None = None,
           env: str | None = None, env_set: tuple[str, Any] | None = None, env_unless: tuple[str, ...] = (),
           repr: bool = True, nonempty: bool = False):
    """A field that is also a flag and a TOML key; ``parse`` turns the flag's text into the value.

    ``env`` names an environment variable that fills it when neither a flag nor the file set it
    (nor any of the fields ``env_unless``); ``env_set = (variable, value)``: where that variable
    is set at all, the field takes ``value`` instead (it wins over ``env``). ``nonempty``: a text
    value set empty or whitespace-only, by any source, is an error (fail closed).
    """
    return dataclasses.field(default=default, repr=repr, metadata={
        "help": help, "parse": parse, "metavar": metavar, "env": env, "env_set": env_set, "env_unless": env_unless,
        "nonempty": nonempty})


def from_environment(default: Any, env: str, help: str):
    """A field only the environment variable ``env`` fills (no flag, no TOML key)."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "flag": False})


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as '1,8,64', got {text!r}") from None


def optional_str(text: str) -> str | None:
    return text or None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str | None = option(None, "model preset with seeded random weights: tiny (default when no "
                                "--checkpoint), mixtral-8x7b, qwen3-30b-a3b, deepseek-v3", parse=optional_str)
    checkpoint: str | None = option(None, "Hugging Face checkpoint directory (config.json + *.safetensors) of an "
                                    "MoE model (docs/models.md lists the families; `expertd inspect DIR` tells "
                                    "what serve would do)", parse=optional_str, metavar="DIR")
    layers: str | None = option(None, "MoE layer indices to serve, e.g. '1,3-5' (default: all MoE layers, or "
                                "--num-layers)", parse=optional_str, metavar="LIST")
    num_layers: int | None = option(None, "serve the first N MoE layers (default: all; tiny has 2)", parse=int,
                                    metavar="N")
    dtype: str = option("auto", "weight and compute dtype: float32 or bfloat16; auto: a checkpoint's own (float32 "
                        "-> float32, bfloat16 / float16 / FP8 / FP4 / INT4 -> bfloat16), bfloat16 for presets")
    seed: int = option(0, "seed of the preset weights (a pure function of seed, layer and tensor name)", parse=int)
    num_devices: int | None = option(None, "devices of the expert-parallel mesh (default: all visible devices)",
                                     parse=int, metavar="N")
    backend: str = option("auto", f"expert kernel backend: auto or one of {', '.join(EXPERT_BACKENDS)}")
    huge_pages: bool = option(True, "on CPU, move the weights onto transparent huge pages at load (BENCHMARKS.md)")
    panel_weights: bool = option(True, "on CPU with the native kernel, relay the expert weights out panel-major at "
                                       "load (same results, read faster; BENCHMARKS.md)")
    num_redundant_experts: int = option(0, "EPLB: extra expert slots per MoE layer on an expert-parallel mesh, "
                                        "holding replicas of the hottest experts (E + N must be divisible by the "
                                        "device count; 0: one slot per expert)", parse=int, metavar="N")
    eplb_interval_s: float = option(0.0, "EPLB: every S seconds, re-plan each layer's expert placement from the "
                                    "load of the last --expert-load-window-s and swap it in between steps (0: the "
                                    "placement made at start-up stays)", parse=float, metavar="SECONDS")

    def __post_init__(self):
        if self.preset is not None and self.checkpoint is not None:
            raise ValueError("give either --preset or --checkpoint, not both")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.backend != "auto" and self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"--backend must be 'auto' or one of {EXPERT_BACKENDS}, got {self.backend!r}")
        if self.layers is not None and self.num_layers is not None:
            raise ValueError("give either --layers or --num-layers, not both")
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"--num-devices must be >= 1, got {self.num_devices}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {self.num_layers}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"--num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if not self.eplb_interval_s >= 0:
            raise ValueError(f"--eplb-interval-s must be >= 0, got {self.eplb_interval_s}")

    @property
    def name(self) -> str:
        """What GetModelInfo reports: the checkpoint directory or the preset name."""
        return self.checkpoint or self.preset or "tiny"


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    bucket_sizes: tuple[int, ...] = option((1, 4, 16, 64, 256), "token buckets compiled at start-up; a batch is "
                                           "padded to the smallest bucket that fits", parse=int_list, metavar="LIST")
    max_batch_tokens: int | None = option(None, "tokens merged into one step at most (default: the largest bucket)",
                                          parse=int, metavar="N")
    max_queue_delay_ms: float = option(2.0, "how long a batch that would be padded waits for more requests "
                                       "(counted from its first request's arrival or the previous step's end; "
                                       "batches that fill a bucket start at once)", parse=float, metavar="MS")
    max_queue_size: int = option(1024, "requests waiting or computing at most, a hard cap; more get "
                                 "RESOURCE_EXHAUSTED (the token and wait bounds normally refuse first)",
                                 parse=int, metavar="N")
    max_queue_tokens: int | None = option(None, "tokens queued (accepted, not yet computed) at most, over all "
                                          "layers; more get RESOURCE_EXHAUSTED (default: 8 x --max-request-tokens)",
                                          parse=int, metavar="N")
    max_queue_wait_ms: float = option(1000.0, "expected wait (the queued work ahead at the measured step times) "
                                      "at most; a request expected to wait longer, or to finish after its "
                                      "deadline, gets RESOURCE_EXHAUSTED at once", parse=float, metavar="MS")
    inline_step_max_ms: float = option(1.0, "a request that finds the server idle (nothing else admitted, the "
                                       "device thread free) runs its step on the event loop, without the hand-over "
                                       "to the device thread, when it is expected to take at most this long; 0: "
                                       "always hand over", parse=float, metavar="MS")
    small_step_slack: float = option(1.25, "a step carrying small requests (at most half a step) takes others' "
                                     "rows only while its fastest time stays within this factor of theirs "
                                     "alone; 0: always fill the step", parse=float, metavar="X")
    max_request_tokens: int = option(8192, "tokens one request may carry (larger requests are split into batches "
                                     "of at most the largest bucket); sizes the gRPC message limit", parse=int,
                                     metavar="N")
    expert_load_window_s: float = option(60.0, "recent window of GetExpertLoad and the load-imbalance gauge",
                                         parse=float, metavar="SECONDS")

    def __post_init__(self):
        buckets = self.bucket_sizes
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"--bucket-sizes must be ascending unique integers >= 1, got {list(buckets)}")
        if self.max_batch_tokens is not None and not 1 <= self.max_batch_tokens <= buckets[-1]:
            raise ValueError(f"--max-batch-tokens must be between 1 and the largest bucket {buckets[-1]}, "
                             f"got {self.max_batch_tokens}")
        for flag, value, ok, expected in (
                ("--max-queue-delay-ms", self.max_queue_delay_ms, self.max_queue_delay_ms >= 0, ">= 0"),
                ("--max-queue-size", self.max_queue_size, self.max_queue_size >= 1, ">= 1"),
                ("--max-request-tokens", self.max_request_tokens, self.max_request_tokens >= 1, ">= 1"),
                ("--max-queue-wait-ms", self.max_queue_wait_ms, self.max_queue_wait_ms > 0, "> 0"),
                ("--inline-step-max-ms", self.inline_step_max_ms, self.inline_step_max_ms >= 0, ">= 0"),
                ("--small-step-slack", self.small_step_slack, self.small_step_slack == 0 or self.small_step_slack >= 1,
                 ">= 1, or 0 to always fill steps"),
                ("--expert-load-window-s", self.expert_load_window_s, self.expert_load_window_s > 0, "> 0")):
            if not ok:  # NaN fails every comparison, so it is refused too
                raise ValueError(f"{flag} must be {expected}, got {value}")
        if self.max_queue_tokens is not None and self.max_queue_tokens < self.max_request_tokens:
            raise ValueError(f"--max-queue-tokens must be >= --max-request-tokens {self.max_request_tokens} (or "
                             f"the largest request could never be queued), got {self.max_queue_tokens}")

    @property
    def queue_tokens(self) -> int:
        """Tokens queued at most (--max-queue-tokens, default 8 x --max-request-tokens)."""
        return self.max_queue_tokens or 8 * self.max_request_tokens

    @property
    def batch_tokens(self) -> int:
        """Rows merged into one engine step at most (the largest bucket unless --max-batch-tokens is lower)."""
        return self.max_batch_tokens or self.bucket_sizes[-1]


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """TLS, mutual TLS and the bearer token. Each is on exactly when its option is set; a set option
    is never ignored (empty values and unusable files are errors: ``credentials``)."""

    tls_cert: str | None = option(None, "PEM server certificate chain; enables TLS", metavar="FILE", nonempty=True)
    tls_key: str | None = option(None, "PEM private key of --tls-cert (unencrypted)", metavar="FILE", nonempty=True)
    tls_client_ca: str | None = option(None, "PEM CA for client certificates; enables mutual TLS (clients must "
                                       "present a certificate it signed)", metavar="FILE", nonempty=True)
    auth_token: str | None = option(None, f"bearer token every call except health must send (prefer "
                                          f"${AUTH_TOKEN_ENV} or --auth-token-file: argv is visible to other users)",
                                    metavar="TOKEN", env=AUTH_TOKEN_ENV, env_unless=("auth_token_file",), repr=False,
                                    nonempty=True)
    auth_token_file: str | None = option(None, "file whose first line is the bearer token", metavar="FILE",
                                         nonempty=True)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not value.strip():
                raise ValueError(f"{flag('security', field)} is set but empty: give a value, or leave it unset "
                                 f"(security options are never ignored)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("give either --auth-token or --auth-token-file, not both")
        if self.auth_token is not None:
            check_token(self.auth_token, f"--auth-token (or ${AUTH_TOKEN_ENV})")

    @property
    def auth_enabled(self) -> bool:
        return self.auth_token is not None or self.auth_token_file is not None

    def credentials(self) -> Credentials:
        """Read and check the token file and the TLS files (ValueError naming the option)."""
        token = source = None
        if self.auth_token_file is not None:
            token, source = read_token_file(self.auth_token_file), "--auth-token-file"
        elif self.auth_token is not None:
            token, source = check_token(self.auth_token, "--auth-token"), f"--auth-token or ${AUTH_TOKEN_ENV}"
        tls = load_tls(self.tls_cert, self.tls_key, self.tls_client_ca) if self.tls_cert is not None else None
        return Credentials(token, source, tls)

    def token(self) -> str | None:
        """The bearer token (read from --auth-token-file when given), or None without auth."""
        if self.auth_token_file is not None:
            return read_token_file(self.auth_token_file)
        return None if self.auth_token is None else check_token(self.auth_token, "--auth-token")


@dataclasses.dataclass(frozen=True)
class MultihostConfig:
    """This process's place in a multi-host group (expertd.server.multihost.serve); one process unless
    ``num_processes`` > 1. The LeaderWorkerSet variables fill what no flag or TOML key sets."""

    coordinator_address: str | None = option(None, "jax.distributed coordinator HOST:PORT, on process 0 (default: "
                                             "$LWS_LEADER_ADDRESS:--coordinator-port)", parse=optional_str,
                                             metavar="HOST:PORT")
    coordinator_port: int = option(DEFAULT_COORDINATOR_PORT, "coordinator port with $LWS_LEADER_ADDRESS", parse=int,
                                   metavar="PORT")
    num_processes: int = option(1, "processes in the group (default: $LWS_GROUP_SIZE, else 1)", parse=int,
                                metavar="N", env="LWS_GROUP_SIZE")
    process_id: int = option(0, "this process's index; 0 runs the gRPC front end (default: $LWS_WORKER_INDEX)",
                             parse=int, metavar="I", env="LWS_WORKER_INDEX")
    multihost_port: int | None = option(None, "process 0's batch channel to the others (default: coordinator "
                                        "port + 1)", parse=int, metavar="PORT")
    peer_timeout_s: float = option(10.0, "a peer silent this long is lost", parse=float, metavar="SECONDS")
    exit_grace_s: float = option(2.0, "NOT_SERVING this long before exiting on a lost peer", parse=float,
                                 metavar="SECONDS")
    join_timeout_s: float = option(600.0, "wait this long for the group to form", parse=float, metavar="SECONDS")

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"--num-processes ($LWS_GROUP_SIZE) must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id ($LWS_WORKER_INDEX) must be between 0 and {self.num_processes - 1}, "
                             f"got {self.process_id}")
        if self.enabled and not self.coordinator_address:
            raise ValueError("a group of several processes needs --coordinator-address HOST:PORT "
                             "(or LWS_LEADER_ADDRESS)")
        if self.enabled:
            self.coordinator_host  # noqa: B018 - validates HOST:PORT
        for name in ("peer_timeout_s", "exit_grace_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def coordinator_host(self) -> str:
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--coordinator-address must be HOST:PORT, got {self.coordinator_address!r}")
        return host.strip("[]")

    @property
    def channel_port(self) -> int:
        """The leader's batch-channel port (default: the coordinator's port + 1)."""
        if self.multihost_port is not None:
            return self.multihost_port
        return int(self.coordinator_address.rpartition(":")[2]) + 1


@dataclasses.dataclass(frozen=True)
class NativeCpuConfig:
    """How the native CPU expert kernel is built and run (flags ``--native-cpu-*``, TOML
    ``[native_cpu]``); the kernel's former environment variables fill what no flag or key sets."""

    isa: str | None = option(None, f"cap the native kernel's instruction set: {', '.join(NATIVE_CPU_ISA_LEVELS)} "
                             "(default: the best this CPU runs; $EXPERTD_NATIVE_CPU_ISA, or "
                             "$EXPERTD_NATIVE_CPU_PORTABLE for portable)", parse=optional_str, metavar="LEVEL",
                             env="EXPERTD_NATIVE_CPU_ISA", env_set=("EXPERTD_NATIVE_CPU_PORTABLE", "portable"))
    cache_dir: str | None = option(None, "where the built kernel library is kept (default: $EXPERTD_CACHE_DIR, "
                                   "else ~/.cache/expertd)", parse=optional_str, metavar="DIR", env="EXPERTD_CACHE_DIR")
    trace: bool = option(False, "build the kernel library that records every parallel-for call's timing "
                                "($EXPERTD_TRACE_PARALLEL_FOR=1)", env="EXPERTD_TRACE_PARALLEL_FOR")
    compiler: str | None = option(None, "C++ compiler that builds the kernel (default: $CXX, else c++, g++ or "
                                  "clang++)", parse=optional_str, metavar="CXX", env="CXX")

    def __post_init__(self):
        if self.isa is not None and self.isa not in NATIVE_CPU_ISA_LEVELS:
            raise ValueError(f"--native-cpu-isa must be one of {', '.join(NATIVE_CPU_ISA_LEVELS)}, got {self.isa!r}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("[::]", "address the gRPC server binds, and the metrics endpoint unless --metrics-host "
                              "(or auth) says otherwise ('127.0.0.1' for loopback only)")
    port: int = option(8001, "gRPC port (0: pick a free port; the bound port is printed)", parse=int)
    metrics_port: int = option(8002, "Prometheus /metrics HTTP port (0: pick a free port)", parse=int)
    native_port: int | None = option(None, "also serve Forward from gRPC C++ on this port, no Python per call "
                                     "(0: a free port; needs the system's libgrpc++: docs/serving.md; "
                                     "$EXPERTD_NATIVE_PORT)", parse=int, metavar="PORT", env="EXPERTD_NATIVE_PORT")
    native_direct: bool = option(True, "on --native-port, a lone call at an idle server, and what queues behind it, "
                                       "run on gRPC C++'s threads, not waking the event loop (one process only)")
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
