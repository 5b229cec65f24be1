"""Bearer-token auth of gRPC calls: the configured token as compared, and the check of a call's
metadata (``expertd.server.transport.interceptors`` applies it before a request body is read)."""
from __future__ import annotations

import hmac

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"


def parse_token(token: str) -> bytes:
    """The configured bearer token as compared (ValueError for a token no client could send or that
    anyone could guess: empty, blank, surrounding whitespace, not printable ASCII)."""
    if not token or not token.strip():
        raise ValueError("auth token must not be empty or blank")
    if token != token.strip() or not (token.isascii() and token.isprintable()):
        raise ValueError("auth token must be printable ASCII without surrounding whitespace")
    return token.encode()


def authorized(metadata, expected: bytes) -> bool:
    """Whether the call's first ``authorization`` metadata is ``Bearer <expected>`` (scheme in any case)."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, credentials = text.strip().partition(" ")
            candidate = credentials.strip().encode("utf-8", "replace")
            return scheme.lower() == "bearer" and hmac.compare_digest(candidate, expected)
    return False


def has_key(metadata, key: str) -> bool:
    """Whether the call's metadata carries ``key``."""
    return any(k == key for k, _ in metadata or ())
