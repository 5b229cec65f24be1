"""The security material of ``expertd serve``, read and checked once at start: fail closed.

Rules (every violation is a ``ValueError`` naming the option; ``expertd serve`` exits 2):
- A security option that is set is never ignored: a token, token file or certificate path that is
  empty or whitespace-only is an error (``sections.SecurityConfig`` and ``sources`` check the
  flags, the TOML keys and ``$EXPERTD_AUTH_TOKEN``), never a silent "off".
- ``--auth-token-file``: readable, its first line non-empty; a token (from any source) is printable
  ASCII without whitespace, the only bytes a gRPC metadata value carries as they are.
- ``--tls-cert`` / ``--tls-key``: both or neither; each readable; the chain holds PEM certificates,
  the key is an unencrypted PEM private key that belongs to the chain's first certificate.
- ``--tls-client-ca``: readable, PEM certificates.

Nothing here decides what is on: the presence of the options does (``SecurityConfig``). This module
only reads the files they name (it is the one place that does) and proves them usable with the
standard library's ``ssl``, the same OpenSSL checks a TLS handshake would fail on later.
"""
from __future__ import annotations

import dataclasses
import pathlib
import ssl
import string

TOKEN_CHARACTERS = frozenset(string.printable) - frozenset(string.whitespace)


@dataclasses.dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of the server's certificate chain and key (and of the client CA for mutual TLS),
    with the paths they came from (``ssl.SSLContext.load_cert_chain`` takes paths only)."""

    cert_path: str
    key_path: str
    client_ca_path: str | None
    certificate_chain: bytes = dataclasses.field(repr=False)
    private_key: bytes = dataclasses.field(repr=False)
    client_ca: bytes | None = dataclasses.field(default=None, repr=False)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context with this certificate (requiring client certificates signed by the
        client CA when mutual): what the metrics endpoint serves with."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_path, self.key_path, password=_no_password)
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What the server enforces: the bearer token (None: no auth) and TLS (None: plaintext).

    ``token_source`` says where the token came from (a flag or the environment variable), for the
    start-up log; the token itself is never shown.
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    token_source: str | None = None
    tls: TlsMaterial | None = None

    def describe(self) -> str:
        """``TLS on, mTLS off, auth on (--auth-token-file)``: what the start-up log states."""
        auth = f"on ({self.token_source})" if self.token is not None else "off"
        return (f"TLS {'on' if self.tls else 'off'}, mTLS {'on' if self.tls and self.tls.mutual else 'off'}, "
                f"auth {auth}")


def check_token(token: str, option: str) -> str:
    """``token`` stripped of surrounding whitespace; ValueError naming ``option`` when it is empty or
    has characters a gRPC metadata value cannot carry."""
    token = token.strip()
    if not token:
        raise ValueError(f"{option} is empty: give a token, or leave the option unset to run without auth")
    bad = sorted(set(token) - TOKEN_CHARACTERS)
    if bad:
        raise ValueError(f"{option}: the token may hold printable ASCII characters without whitespace only, "
                         f"found {''.join(bad)!r}")
    return token


def read_token_file(path: str, option: str = "--auth-token-file") -> str:
    """The token on the first line of ``path`` (ValueError naming ``option`` when unreadable or empty)."""
    text = _read(path, option).decode("utf-8", errors="replace")
    lines = text.splitlines()
    return check_token(lines[0] if lines else "", f"{option} {path} (first line)")


def load_tls(cert: str, key: str, client_ca: str | None) -> TlsMaterial:
    """Read and check the server certificate chain, its key and the client CA (see module rules)."""
    chain, private_key = _read(cert, "--tls-cert"), _read(key, "--tls-key")
    _check_certificates(chain, f"--tls-cert {cert}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, _EncryptedKey) as exc:
        reason = "is encrypted (give an unencrypted key)" if isinstance(exc, _EncryptedKey) else \
            f"is not a PEM private key of the --tls-cert certificate ({_reason(exc)})"
        raise ValueError(f"--tls-key {key} {reason}") from None
    ca = None
    if client_ca is not None:
        ca = _read(client_ca, "--tls-client-ca")
        _check_certificates(ca, f"--tls-client-ca {client_ca}")
    return TlsMaterial(cert, key, client_ca, chain, private_key, ca)


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    """``load_cert_chain``'s password callback: a key that asks for one is refused, never prompted for."""
    raise _EncryptedKey


def _read(path: str, option: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot read it ({exc.strerror or exc})") from None


def _check_certificates(pem: bytes, what: str) -> None:
    """ValueError unless ``pem`` holds at least one PEM certificate and nothing OpenSSL refuses."""
    text = pem.decode("ascii", errors="replace")
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError(f"{what} holds no PEM certificate ('-----BEGIN CERTIFICATE-----')")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"{what} is not a valid PEM certificate ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or str(exc) or type(exc).__name__
