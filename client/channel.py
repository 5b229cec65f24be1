"""What the sync and asyncio clients share: targets, the channel and its service config, TLS
credentials, auth metadata, retry backoff.

Targets (``resolve_target``), one server or replicas of it:
- ``host:port``: gRPC resolves the name (DNS), and every address it resolves to is a replica.
- ``dns:///name:port``: the same, spelled as gRPC's URI; a Kubernetes headless Service name
  resolves to its ready pods (``dns:///expertd-headless.<namespace>.svc.cluster.local:8001``).
- ``host1:port1,host2:port2,...``: a fixed list. IP literals become gRPC's own ``ipv4:`` /
  ``ipv6:`` lists; host names are resolved once, when the client is made (gRPC has no resolver
  for a list of names), all IPv4 if every name has an IPv4 address, else all IPv6.
- any other gRPC URI (``ipv4:``, ``ipv6:``, ``unix:``, ...) as it is.
- ``shm://NAME``: the same-host channel of a server started with ``--shm-channel NAME``
  (``expertd.client.shm_channel``: a gRPC channel look-alike, the same methods and errors; one
  server, not replicas).

The channel's service config (``service_config``): gRPC's ``round_robin`` over the replicas
whose ``grpc.health.v1`` status (service "", Watched by gRPC's client-side health checking) is
SERVING, so warming-up and draining servers get no calls; and a ``retryPolicy`` that retries
``RETRIED_BY_GRPC`` with exponential backoff on the idempotent unary methods, each attempt picked
anew (another replica). The clients' own retry loop retries RESOURCE_EXHAUSTED (with the
server's RetryInfo hint) and, once, an idempotent call gRPC could not retry because its replica
was lost after it began answering (``LOST_IN_TRANSPORT``): no call is retried twice over.
Health calls go through a second channel without health checking (``ClientBase.probe``): they
must reach servers that are not SERVING.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import pathlib
import random
import socket

import grpc
from grpc_health.v1 import health_pb2_grpc

from expertd.client import admission, errors, shm_channel, shm_frames
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.client.throttle import AdaptiveThrottle, Throttle

# Large enough for a 256 MiB request or response; the server enforces its own, smaller limit.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# What gRPC's retry policy retries: UNAVAILABLE (a replica died, is draining, or none is reachable)
# and CANCELLED as a server sends it (a gRPC server that stops cancels the calls it still holds,
# or that reach it as it stops). A call the client cancels itself is never retried (gRFC A6).
RETRIED_BY_GRPC = ("UNAVAILABLE", "CANCELLED")
# Unary methods that may run twice without harm: retried on RETRIED_BY_GRPC by gRPC's retry policy.
IDEMPOTENT_METHODS = (
    ("expertd.v1.ExpertService", "Forward"), ("expertd.v1.ExpertService", "Route"),
    ("expertd.v1.ExpertService", "GetModelInfo"), ("expertd.v1.ExpertService", "GetExpertLoad"),
    ("inference.GRPCInferenceService", "ModelInfer"), ("inference.GRPCInferenceService", "ModelMetadata"),
    ("inference.GRPCInferenceService", "ModelConfig"),
)
# What gRPC may hold per call to retry it: it keeps a call's sent messages until the call commits
# (its response, or its messages passing this size); gRPC's own 256 MiB bounds a channel's calls.
RETRY_BUFFER_BYTES = 64 * 1024 * 1024
# gRPC makes at most 5 attempts of a call whatever maxAttempts says (gRFC A6).
GRPC_MAX_ATTEMPTS = 5
# Retried by the clients' own loop (the server's RetryInfo hint says when): any replica's queue may be full.
CLIENT_RETRIED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
# gRPC's status details for a call whose transport was lost under it (the connection reset or closed),
# not a status a server sent. gRPC's retry policy retries a call only until the server's response
# headers arrive (the call commits, gRFC A6): an idempotent call lost after that (its replica killed
# while answering) is sent once more by the clients' own loop.
LOST_IN_TRANSPORT = "Stream removed"
HEALTH_CHECK_SERVICE = ""  # the whole server: NOT_SERVING while warming up and draining
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p")
# A dead replica's replacement is found within seconds: reconnect attempts at most this far apart
# (gRPC's default is 120 s), and names re-resolved at most this often after a failure (default 30 s).
MAX_RECONNECT_BACKOFF_MS = 2000
DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS = 5000


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


@dataclasses.dataclass(frozen=True)
class Target:
    """A target as gRPC takes it: ``uri`` and, for a list, ``authority`` (its first entry: the
    ``:authority`` header and the name TLS checks, unless ``TlsOptions.server_name`` says otherwise)."""

    uri: str
    authority: str | None = None


def resolve_target(target: str) -> Target:
    """The gRPC target for one of the forms in the module docstring (ValueError naming a bad entry)."""
    text = target.strip()
    if not text:
        raise ValueError("target is empty: give host:port, host1:port,host2:port or dns:///name:port")
    if text.partition(":")[0] in GRPC_SCHEMES:
        return Target(text)
    entries = [entry.strip() for entry in text.split(",")]
    if len(entries) == 1:
        return Target(text)
    endpoints = [_host_port(entry, target) for entry in entries]
    literals = [_ip(host) for host, _ in endpoints]
    if all(literals):
        versions = {ip.version for ip in literals}
        if len(versions) > 1:
            raise ValueError(f"target {target!r} mixes IPv4 and IPv6 addresses: give one family, or a DNS name")
        addresses = [(str(ip), port) for ip, (_, port) in zip(literals, endpoints)]
    else:
        addresses = _resolve_names(endpoints, target)
    version = ipaddress.ip_address(addresses[0][0]).version
    listed = ",".join(f"[{host}]:{port}" if version == 6 else f"{host}:{port}" for host, port in addresses)
    return Target(f"ipv{version}:{listed}", authority=entries[0])


def _host_port(entry: str, target: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r}: entry {entry!r} is not host:port")
    return host, int(port)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve_names(endpoints: list[tuple[str, int]], target: str) -> list[tuple[str, int]]:
    """Every address of every host (resolved now), in one family: IPv4 if all hosts have one."""
    by_family: dict[int, list[tuple[str, int]]] = {4: [], 6: []}
    families: list[set[int]] = []
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"target {target!r}: cannot resolve {host!r} ({exc.strerror})") from None
        found = set()
        for family, _, _, _, sockaddr in infos:
            version = 4 if family == socket.AF_INET else 6 if family == socket.AF_INET6 else None
            if version is not None and (sockaddr[0], port) not in by_family[version]:
                by_family[version].append((sockaddr[0], port))
                found.add(version)
        families.append(found)
    for version in (4, 6):
        if all(version in found for found in families):
            return by_family[version]
    raise ValueError(f"target {target!r}: the hosts share no address family (some IPv4 only, some IPv6 only)")


def service_config(retries: int, backoff: Backoff) -> dict:
    """The channel's service config (module docstring): round_robin over healthy replicas and,
    with ``retries`` > 0, RETRIED_BY_GRPC retried up to ``min(retries + 1, 5)`` attempts with ``backoff``."""
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}],
                    "healthCheckConfig": {"serviceName": HEALTH_CHECK_SERVICE}}
    if retries > 0:
        config["methodConfig"] = [{
            "name": [{"service": service, "method": method} for service, method in IDEMPOTENT_METHODS],
            "retryPolicy": {
                "maxAttempts": min(retries + 1, GRPC_MAX_ATTEMPTS),
                "initialBackoff": _duration(backoff.initial),
                "maxBackoff": _duration(max(backoff.maximum, backoff.initial)),
                "backoffMultiplier": max(backoff.multiplier, 1.0),
                "retryableStatusCodes": list(RETRIED_BY_GRPC),
            },
        }]
    return config


def _duration(seconds: float) -> str:
    """A service-config duration (gRPC refuses 0): ``"0.050000s"``."""
    return f"{max(seconds, 1e-3):.6f}s"


def channel_options(max_message_bytes: int, tls: TlsOptions | None, *, retries: int = 0,
                    backoff: Backoff | None = None, authority: str | None = None,
                    health_checked: bool = True) -> list[tuple[str, int | str]]:
    """Channel arguments: message limits, the service config (``health_checked=False``: plain
    round_robin, no retries: the probe channel), reconnection and re-resolution bounds, TLS name."""
    config = service_config(retries, backoff or DEFAULT_BACKOFF) if health_checked else \
        {"loadBalancingConfig": [{"round_robin": {}}]}
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.service_config", json.dumps(config)),
        ("grpc.enable_retries", 1),
        # A call is retried only while gRPC still holds what it sent (256 KiB by default): up to
        # RETRY_BUFFER_BYTES, so large Forwards are retried on another replica as small ones are.
        ("grpc.per_rpc_retry_buffer_size", min(max_message_bytes, RETRY_BUFFER_BYTES)),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS),
    ]
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def open_channel(target: str, *, aio: bool, tls: TlsOptions | None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retries: int = 0, backoff: Backoff | None = None, health_checked: bool = True):
    """A ``grpc.Channel`` (``grpc.aio.Channel`` with ``aio``) to ``target`` (any form of ``resolve_target``),
    or for ``shm://NAME`` the same-host channel's look-alike (``tls`` must be off: the channel is local)."""
    if shm_frames.name_of(target) is not None:
        if tls is not None:
            raise ValueError(f"target {target!r}: the same-host channel has no TLS (it never leaves the host); "
                             "drop tls=")
        kind = shm_channel.AsyncShmChannel if aio else shm_channel.ShmChannel
        return kind(target, retries=retries, backoff=backoff or DEFAULT_BACKOFF)
    resolved = resolve_target(target)
    options = channel_options(max_message_bytes, tls, retries=retries, backoff=backoff, authority=resolved.authority,
                              health_checked=health_checked)
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(resolved.uri, options=options)
    return module.secure_channel(resolved.uri, tls.credentials(), options=options)


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
    """Channel, stubs and call settings of ExpertClient (``aio=False``) and AsyncExpertClient (``aio=True``).

    ``_channel``: balanced over the healthy replicas, RETRIED_BY_GRPC retried by gRPC (module
    docstring). ``probe()``: the health stub on a second channel, opened on first use, with no
    health checking and no retries, so that health reaches servers that are not SERVING.
    ``_forward_call(request)``: how a Forward goes (``expertd.client.admission``).
    ``_refused_here(attempt)`` before and ``_answered(error)`` after each attempt of a throttled call
    (Forward, Route): client-side throttling (``expertd.client.throttle``) and the pushback.
    """

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
        throttle: Throttle | AdaptiveThrottle | None,
    ):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        tls_options = normalize_tls(tls)
        self._channel = open_channel(target, aio=aio, tls=tls_options, max_message_bytes=max_message_bytes,
                                     retries=retries, backoff=backoff)
        self.target = target
        self._aio = aio
        self._tls = tls_options
        self._timeout = timeout
        self._retries = retries
        self._backoff = backoff
        self._metadata = auth_metadata(token)
        self._stub = expert_pb2_grpc.ExpertServiceStub(self._channel)
        self._pushback = admission.Pushback()
        self._throttle = AdaptiveThrottle(throttle) if isinstance(throttle, Throttle) else throttle
        held = self._channel.stream_unary("/expertd.v1.ExpertService/Forward",
                                          request_serializer=expert_pb2.ForwardRequest.SerializeToString,
                                          response_deserializer=expert_pb2.ForwardResponse.FromString)
        self._forward_held = functools.partial(
            admission.call_after_admission if aio else admission.call_after_admission_blocking, held)
        self._probe_channel = None
        self._health: health_pb2_grpc.HealthStub | None = None

    @property
    def same_host(self) -> bool:
        """Whether the target is the same-host channel (``shm://NAME``)."""
        return shm_frames.name_of(self.target) is not None

    def probe(self) -> health_pb2_grpc.HealthStub:
        """The health stub on the probe channel (opened now if it is not yet)."""
        if self._health is None:
            self._probe_channel = self._channel if self.same_host else \
                open_channel(self.target, aio=self._aio, tls=self._tls, health_checked=False)
            self._health = health_pb2_grpc.HealthStub(self._probe_channel)
        return self._health

    def _forward_call(self, request: expert_pb2.ForwardRequest):
        """(method, metadata) for a Forward: the unary stub with the admission metadata its size calls
        for, or, while the server pushes back, the call that holds its large body until admitted."""
        if self.same_host:  # the body is in shared memory already: nothing to hold back
            return self._stub.Forward, ()
        metadata = admission.admission_metadata(request)
        if metadata and self._pushback.active():
            return self._forward_held, metadata
        return self._stub.Forward, metadata

    def _refused_here(self, attempt: int) -> errors.ThrottledError | None:
        """The error of a first attempt (``attempt`` 0) this client refuses itself (client-side
        throttling), or None: send it. Retries always go out (counted when answered)."""
        if self._throttle is None or attempt > 0:
            return None
        return None if self._throttle.allow() else self._throttle.refusal()

    def _retry_delay(self, error: errors.ExpertError, attempt: int, retries: int, idempotent: bool) -> float:
        """Seconds to wait before attempt ``attempt + 1`` of a unary call whose attempt failed with
        ``error``; raises ``error`` when it is not retried here. Retried here, at most ``retries``
        times: CLIENT_RETRIED codes, and an ``idempotent`` call's first attempt lost in transport
        (LOST_IN_TRANSPORT); every other UNAVAILABLE gRPC's retry policy has already retried."""
        lost = idempotent and attempt == 0 and error.code == grpc.StatusCode.UNAVAILABLE \
            and error.message.startswith(LOST_IN_TRANSPORT)
        if not (lost or error.code in CLIENT_RETRIED) or attempt >= retries:
            raise error
        return self._backoff.delay(attempt, error.retry_delay)

    def _answered(self, error: errors.ExpertError | None) -> None:
        """Count a throttled call's attempt the server answered (``error`` None: OK)."""
        if error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._pushback.refused()
            if self._throttle is not None:
                self._throttle.refused(error.retry_delay)
        elif self._throttle is not None:
            self._throttle.accepted()

    def _channels(self) -> list:
        probe = self._probe_channel is not None and self._probe_channel is not self._channel
        return [self._channel] + ([self._probe_channel] if probe else [])
