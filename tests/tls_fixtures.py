"""Throwaway PEM files for the TLS tests, made with the openssl command line (never committed; the
keys live in a test's temporary folder)."""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess


@dataclasses.dataclass(frozen=True)
class Pki:
    """A CA, a server certificate it signed (for ``server_names`` and 127.0.0.1), a client
    certificate it signed, and another CA that signed neither."""

    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    other_ca: pathlib.Path


def make_pki(directory: pathlib.Path, server_names: tuple[str, ...] = ("localhost",)) -> Pki:
    """The certificates of a ``Pki`` in ``directory``; the server's names as DNS subject alternative names."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=expertd test {ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    names = ",".join(f"DNS:{name}" for name in server_names)
    (directory / "server.ext").write_text(f"subjectAltName={names},IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "server.ext"]), ("client", [])):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=expertd test {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-out", f"{name}.pem", *extra)
    return Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key", directory / "client.pem",
               directory / "client.key", directory / "other-ca.pem")
