"""The server's listening addresses: a port another process listens on is refused at start, before
the model loads, with the flag that chose it named (an operator otherwise waits for a checkpoint to
load only to read gRPC's "Failed to bind").

`check_free(host, port, flag)` binds a probe socket as the real listeners do (SO_REUSEADDR, so a
port left in TIME_WAIT passes; dual-stack for the wildcard "[::]", as gRPC listens there) and
raises OSError naming `host:port` and `flag` when another socket holds it. Port 0,
names that do not resolve and every other bind problem (no IPv6 here, an address this host does
not have) are left to the real bind, whose failure `bind_error` words the same way.

`grpc_server_credentials(tls)` is a gRPC port's TLS; `security_summary` the start-up line saying
what guards the ports (TLS, mutual TLS, the bearer token) and the metrics endpoint.
"""
from __future__ import annotations

import errno
import socket

import grpc

from expertd.server.config import ServerConfig
from expertd.server.config.credentials import Credentials, TlsMaterial


def check_free(host: str, port: int, flag: str) -> None:
    """Raise OSError naming ``flag`` when another socket listens on ``host:port``."""
    if port == 0:
        return
    bare = host.strip("[]")
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        return
    try:
        probe = socket.socket(family, kind, proto)
    except OSError:  # no such family here (an IPv6 wildcard on a host without IPv6)
        return
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bare in ("", "::"):
            try:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                pass
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise bind_error(f"{host}:{port}", flag, "another process is listening there") from None


def bind_error(address: str, flag: str, why: str) -> OSError:
    """The error of a listener that cannot bind ``address``: names it, the flag, and what to do."""
    return OSError(f"cannot listen on {address} ({flag}): {why}; stop what holds it or choose another port")


def security_summary(config: ServerConfig, credentials: Credentials, metrics_url: str) -> str:
    """``security: TLS on, mTLS off, auth on (...); metrics: https://...:8002/metrics (TLS on,
    auth off)``: what the start-up log of a server (or a multi-host follower) states."""
    metrics = (f"metrics: {metrics_url} (TLS {'on' if config.metrics_tls else 'off'}, "
               f"auth {'on' if config.metrics_auth else 'off'}")
    if config.metrics_host is None and config.security.auth_enabled and not config.metrics_auth:
        metrics += "; loopback only: auth is on and --metrics-auth is not, give --metrics-host to change"
    return f"security: {credentials.describe()}; {metrics})"


def grpc_server_credentials(tls: TlsMaterial) -> grpc.ServerCredentials:
    """The gRPC port's TLS (mutual when a client CA was given) from the material read at start."""
    return grpc.ssl_server_credentials([(tls.private_key, tls.certificate_chain)], root_certificates=tls.client_ca,
                                       require_client_auth=tls.mutual)
