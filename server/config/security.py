"""The ``[security]`` section: TLS / mutual TLS and the bearer token (fail closed)."""
from __future__ import annotations

import dataclasses

from expertd.server.config.credentials import Credentials, check_token, load_tls, read_token_file
from expertd.server.config.fields import (
    AUTH_TOKEN_ENV,
    option,
)


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
                raise ValueError(f"--{field.name.replace('_', '-')} is set but empty: give a value, or leave it unset "
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
