"""What the sync and asyncio clients share: TLS credentials, channel options, auth metadata, retry backoff."""
from __future__ import annotations

import dataclasses
import pathlib
import random

import grpc
from grpc_health.v1 import health_pb2_grpc

from expertd.client.pb.v1 import expert_pb2_grpc

# Large enough for a 256 MiB request or response; the server enforces its own, smaller limit.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def _read(value: bytes | str | pathlib.Path | None) -> bytes | None:
    """PEM contents: bytes are taken as they are, a str or Path is a file to read."""
    if value is None or isinstance(value, bytes):
        return value
    return pathlib.Path(value).read_bytes()


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """TLS for the channel. Certificates and keys are PEM bytes or paths to PEM files.

    root_certificates: CA that signed the server's certificate (None: the system roots).
    client_certificate / client_key: this client's certificate chain and key, for mutual TLS.
    server_name: expected name in the server's certificate, when it differs from the target host.
    """

    root_certificates: bytes | str | pathlib.Path | None = None
    client_certificate: bytes | str | pathlib.Path | None = None
    client_key: bytes | str | pathlib.Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.client_certificate is None) != (self.client_key is None):
            raise ValueError("client_certificate and client_key must be given together (mutual TLS)")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_certificates),
            private_key=_read(self.client_key),
            certificate_chain=_read(self.client_certificate),
        )


def channel_options(max_message_bytes: int, tls: TlsOptions | None) -> list[tuple[str, int | str]]:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Retries are done by the client itself (typed errors, RetryInfo); keep gRPC's own off.
        ("grpc.enable_retries", 0),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization: Bearer <token>`` metadata, or nothing without a token."""
    if token is None:
        return ()
    if not token or any(c in token for c in "\r\n"):
        raise ValueError("token must be a non-empty single-line string")
    return (("authorization", f"Bearer {token}"),)


def normalize_tls(tls: bool | TlsOptions | None) -> TlsOptions | None:
    """``True`` means TLS with the system roots; ``False``/``None`` a plaintext channel."""
    if tls is True:
        return TlsOptions()
    if tls is False or tls is None:
        return None
    if isinstance(tls, TlsOptions):
        return tls
    raise TypeError(f"tls must be a bool or TlsOptions, got {type(tls).__name__}")


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter for retried calls (UNAVAILABLE, RESOURCE_EXHAUSTED)."""

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0

    def delay(self, attempt: int, server_hint: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based); never below the server's hint."""
        cap = min(self.maximum, self.initial * self.multiplier**attempt)
        wait = random.uniform(0.0, cap)
        return max(wait, server_hint) if server_hint is not None else wait


DEFAULT_BACKOFF = Backoff()  # immutable: one instance serves every client's default


class ClientBase:
    """Channel, stubs and call settings of ExpertClient (``aio=False``) and AsyncExpertClient (``aio=True``)."""

    def __init__(
        self,
        target: str,
        *,
        aio: bool,
        timeout: float | None,
        retries: int,
        tls: bool | TlsOptions,
        token: str | None,
        max_message_bytes: int,
        backoff: Backoff,
    ):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        tls_options = normalize_tls(tls)
        options = channel_options(max_message_bytes, tls_options)
        module = grpc.aio if aio else grpc
        if tls_options is None:
            self._channel = module.insecure_channel(target, options=options)
        else:
            self._channel = module.secure_channel(target, tls_options.credentials(), options=options)
        self.target = target
        self._timeout = timeout
        self._retries = retries
        self._backoff = backoff
        self._metadata = auth_metadata(token)
        self._stub = expert_pb2_grpc.ExpertServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
