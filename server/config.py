"""Server configuration: frozen dataclasses, parsed once at the entry point.

Sources, later ones winning: the defaults below < an optional TOML file (``--config FILE``) <
command-line flags. The bearer token may also come from the ``EXPERTD_AUTH_TOKEN`` environment
variable, used when neither ``auth_token`` nor ``auth_token_file`` is set by a flag or the file. Every field is one flag
(``--max-queue-delay-ms``) and one TOML key (``max_queue_delay_ms``, in the table of its
section: top level for ServerConfig, ``[model]``, ``[batching]``, ``[security]``)::

    port = 8001
    [model]
    preset = "mixtral-8x7b"
    num_layers = 2
    [batching]
    bucket_sizes = [1, 8, 64, 512]

Bad values raise ``ValueError`` naming the option. Nothing else in expertd reads flags or the
environment.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import tomllib
from collections.abc import Callable
from typing import Any

AUTH_TOKEN_ENV = "EXPERTD_AUTH_TOKEN"
DTYPES = ("float32", "bfloat16")


def _option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, metavar: str | None = None):
    """A dataclass field that is also a flag/TOML key; ``parse`` turns the flag's text into the value."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar})


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as '1,8,64', got {text!r}") from None


def _optional_str(text: str) -> str | None:
    return text or None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str | None = _option(None, "model preset with seeded random weights: tiny (default when no "
                                 "--checkpoint), mixtral-8x7b, qwen3-30b-a3b, deepseek-v3", parse=_optional_str)
    checkpoint: str | None = _option(None, "Hugging Face checkpoint directory (config.json + *.safetensors) "
                                     "of a Mixtral, Qwen2/3-MoE or DeepSeek-V3 model", parse=_optional_str, metavar="DIR")
    layers: str | None = _option(None, "MoE layer indices to serve, e.g. '1,3-5' (default: all MoE layers, or "
                                 "--num-layers)", parse=_optional_str, metavar="LIST")
    num_layers: int | None = _option(None, "serve the first N MoE layers (default: all; tiny has 2)", parse=int, metavar="N")
    dtype: str = _option("bfloat16", f"weight and compute dtype: {' or '.join(DTYPES)}")
    seed: int = _option(0, "seed of the preset weights (a pure function of seed, layer and tensor name)", parse=int)
    num_devices: int | None = _option(None, "devices of the expert-parallel mesh (default: all visible devices)",
                                      parse=int, metavar="N")
    backend: str = _option("auto", "expert kernel backend passed to the engine (auto, reference, ragged_dot, capacity, "
                                   "expert_loop, native_cpu, pallas)")
    huge_pages: bool = _option(True, "on CPU, move the weights onto transparent huge pages at load (up to ~1.4 s per "
                               "GB; decode-size batches measured a median 1.04x as fast)")
    panel_weights: bool = _option(True, "on CPU with the native kernel, relay the expert weights out panel-major at load "
                                  "(same results; the layer ran 1.04-1.26x as fast at T <= 256, BENCHMARKS.md)")

    def __post_init__(self):
        if self.preset is not None and self.checkpoint is not None:
            raise ValueError("give either --preset or --checkpoint, not both")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layers is not None and self.num_layers is not None:
            raise ValueError("give either --layers or --num-layers, not both")
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"--num-devices must be >= 1, got {self.num_devices}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {self.num_layers}")

    @property
    def name(self) -> str:
        """What GetModelInfo reports: the checkpoint directory or the preset name."""
        return self.checkpoint or self.preset or "tiny"


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    bucket_sizes: tuple[int, ...] = _option((1, 4, 16, 64, 256), "token buckets compiled at start-up; a batch is "
                                            "padded to the smallest bucket that fits", parse=_int_list, metavar="LIST")
    max_batch_tokens: int | None = _option(None, "tokens merged into one step at most (default: the largest bucket)",
                                           parse=int, metavar="N")
    max_queue_delay_ms: float = _option(2.0, "how long a batch that would be padded waits for more requests "
                                        "(counted from its first request's arrival or the previous step's end; "
                                        "batches that fill a bucket start at once)", parse=float, metavar="MS")
    max_queue_size: int = _option(1024, "requests waiting or computing at most; more get RESOURCE_EXHAUSTED",
                                  parse=int, metavar="N")
    max_request_tokens: int = _option(8192, "tokens one request may carry (larger requests are split into batches "
                                      "of at most the largest bucket); sizes the gRPC message limit", parse=int, metavar="N")
    expert_load_window_s: float = _option(60.0, "recent window of GetExpertLoad and the load-imbalance gauge",
                                          parse=float, metavar="SECONDS")

    def __post_init__(self):
        buckets = self.bucket_sizes
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"--bucket-sizes must be ascending unique integers >= 1, got {list(buckets)}")
        if self.max_batch_tokens is not None and not 1 <= self.max_batch_tokens <= buckets[-1]:
            raise ValueError(f"--max-batch-tokens must be between 1 and the largest bucket {buckets[-1]}, "
                             f"got {self.max_batch_tokens}")
        if self.max_queue_delay_ms < 0:
            raise ValueError(f"--max-queue-delay-ms must be >= 0, got {self.max_queue_delay_ms}")
        if self.max_queue_size < 1:
            raise ValueError(f"--max-queue-size must be >= 1, got {self.max_queue_size}")
        if self.max_request_tokens < 1:
            raise ValueError(f"--max-request-tokens must be >= 1, got {self.max_request_tokens}")
        if self.expert_load_window_s <= 0:
            raise ValueError(f"--expert-load-window-s must be > 0, got {self.expert_load_window_s}")

    @property
    def batch_tokens(self) -> int:
        """The effective max batch tokens."""
        return self.max_batch_tokens or self.bucket_sizes[-1]


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    tls_cert: str | None = _option(None, "PEM server certificate chain; enables TLS", parse=_optional_str, metavar="FILE")
    tls_key: str | None = _option(None, "PEM private key of --tls-cert", parse=_optional_str, metavar="FILE")
    tls_client_ca: str | None = _option(None, "PEM CA for client certificates; enables mutual TLS (clients must "
                                        "present a certificate it signed)", parse=_optional_str, metavar="FILE")
    auth_token: str | None = dataclasses.field(default=None, repr=False, metadata={
        "help": f"bearer token every call except health must send (prefer ${AUTH_TOKEN_ENV} or --auth-token-file: "
                "argv is visible to other users)", "parse": _optional_str, "metavar": "TOKEN"})
    auth_token_file: str | None = _option(None, "file whose first line is the bearer token", parse=_optional_str, metavar="FILE")

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("give either --auth-token or --auth-token-file, not both")

    def token(self) -> str | None:
        """The bearer token, read from --auth-token-file when given."""
        if self.auth_token_file is None:
            return self.auth_token
        lines = pathlib.Path(self.auth_token_file).read_text().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"--auth-token-file {self.auth_token_file} is empty")
        return lines[0].strip()


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = _option("[::]", "address the gRPC and metrics servers bind ('127.0.0.1' for loopback only)")
    port: int = _option(8001, "gRPC port (0: pick a free port; the bound port is printed)", parse=int)
    metrics_port: int = _option(8002, "Prometheus /metrics HTTP port (0: pick a free port)", parse=int)
    drain_grace_s: float = _option(30.0, "on SIGTERM: seconds to finish accepted requests before exiting", parse=float,
                                   metavar="SECONDS")
    compile_cache_dir: str | None = _option(os.path.join("~", ".cache", "expertd", "jax"),
                                            "JAX persistent compilation cache ('' disables it)", parse=_optional_str,
                                            metavar="DIR")
    reflection: bool = _option(True, "serve gRPC server reflection (grpcurl, ghz)")
    retain_freed_memory: bool = _option(False, "on CPU, keep freed host buffers for reuse (glibc malloc: one arena, "
                                        "no mmap'd blocks): buckets of 1024+ tokens stop page-faulting their "
                                        "buffers every step (1.01-1.17x at 4096), but single-token requests "
                                        "measured ~1.8x the latency and resident memory stays at its peak")
    aux_loss_coeff: float = _option(1e-2, "default load-balancing aux-loss coefficient of Route", parse=float)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 65535, got {value}")
        if self.port == self.metrics_port != 0:
            raise ValueError(f"--port and --metrics-port must differ, both are {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")


_SECTIONS: dict[str | None, type] = {None: ServerConfig, "model": ModelConfig, "batching": BatchingConfig,
                                     "security": SecurityConfig}


def _own_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in _SECTIONS]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per config field (defaults shown; unset flags stay unset)."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file with any of the options below (flags win over it)")
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]" if section else "server")
        for field in _own_fields(cls):
            flag = "--" + field.name.replace("_", "-")
            default = field.default
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            help_text = field.metadata["help"] + (f" (default: {shown})" if default is not None else "")
            dest = f"{section}.{field.name}" if section else field.name
            if isinstance(default, bool):
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, dest=dest, type=field.metadata["parse"] or str,
                                   metavar=field.metadata["metavar"] or field.name.upper(), default=argparse.SUPPRESS, help=help_text)


def from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerConfig:
    """Build the config from parsed flags (see ``add_arguments``), the TOML file they name and the environment."""
    environ = os.environ if environ is None else environ
    given = vars(args)
    values: dict[str | None, dict[str, Any]] = {section: {} for section in _SECTIONS}
    if "config" in given:
        values = _merge(values, _read_toml(pathlib.Path(given["config"])))
    for dest, value in given.items():
        section, _, name = dest.rpartition(".")
        if dest != "config":
            values[section or None][name] = value
    token = environ.get(AUTH_TOKEN_ENV)
    if token and not {"auth_token", "auth_token_file"} & values["security"].keys():
        values["security"]["auth_token"] = token
    sections = {name: cls(**values[name]) for name, cls in _SECTIONS.items() if name}
    return ServerConfig(**values[None], **sections)


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    """Parse ``expertd serve`` flags into a ServerConfig (``argparse`` exits on malformed flags)."""
    parser = argparse.ArgumentParser(prog="expertd serve", description="Serve MoE layers over gRPC.")
    add_arguments(parser)
    return from_args(parser.parse_args(argv), environ)


def _read_toml(path: pathlib.Path) -> dict[str | None, dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    out: dict[str | None, dict[str, Any]] = {section: {} for section in _SECTIONS}
    for key, value in data.items():
        if key in _SECTIONS and isinstance(value, dict):
            out[key] = _checked(key, _SECTIONS[key], value, path)
        else:
            out[None].update(_checked(None, ServerConfig, {key: value}, path))
    return out


def _checked(section: str | None, cls: type, table: dict[str, Any], path: pathlib.Path) -> dict[str, Any]:
    known = {f.name: f for f in _own_fields(cls)}
    out = {}
    for key, value in table.items():
        where = f"{section}.{key}" if section else key
        if key not in known:
            raise ValueError(f"--config {path}: unknown option {where!r}; known: {sorted(known)}")
        out[key] = _coerce(known[key], value, f"--config {path}: {where}")
    return out


_TOML_TYPES = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,), "tuple[int, ...]": (list,)}


def _coerce(field: dataclasses.Field, value: Any, where: str) -> Any:
    """Check a TOML value against the field's annotation (``int``, ``float | None``, ...)."""
    base = str(field.type).removesuffix(" | None")
    ok = isinstance(value, _TOML_TYPES[base]) and not (isinstance(value, bool) and base != "bool")
    if base == "tuple[int, ...]":
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ValueError(f"{where} must be {base}, got {value!r}")
    if base == "float":
        return float(value)
    return tuple(value) if base == "tuple[int, ...]" else value


def _merge(base: dict, update: dict) -> dict:
    return {section: {**base.get(section, {}), **update.get(section, {})} for section in base}
