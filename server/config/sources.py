"""The only reader of flags, the TOML file and the environment in expertd's server.

Sources, later ones winning: the dataclass defaults < environment variables (for the options that
name one) < the TOML file (``--config FILE``) < command-line flags. Every option is one flag
(``--max-queue-delay-ms``) and one TOML key (``max_queue_delay_ms`` in the table of its section:
top level for ServerConfig, ``[model]``, ``[batching]``, ``[security]``, ``[multihost]``,
``[native_cpu]`` whose flags are ``--native-cpu-*``)::

    port = 8001
    [model]
    preset = "mixtral-8x7b"
    [batching]
    bucket_sizes = [1, 8, 64, 512]

Environment variables: ``EXPERTD_AUTH_TOKEN`` (the bearer token); ``EXPERTD_NATIVE_PORT`` (the native
Forward port, as the Kubernetes overlay sets it); the LeaderWorkerSet's
``LWS_LEADER_ADDRESS`` (with ``--coordinator-port``), ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX``;
the native CPU kernel's ``EXPERTD_NATIVE_CPU_ISA``, ``EXPERTD_NATIVE_CPU_PORTABLE`` (set: the
portable level), ``EXPERTD_CACHE_DIR``, ``EXPERTD_TRACE_PARALLEL_FOR`` (``1``: on) and ``CXX``;
``LD_PRELOAD`` (read, never set: host.allocator's check). Bad values raise ``ValueError`` naming
the option or variable.

Fail closed: a security option (``nonempty``) set to an empty or whitespace-only value is an error
in a flag, a TOML key (``[security] tls_cert = ""``) and ``$EXPERTD_AUTH_TOKEN`` alike; and
``from_args`` reads the files the security options name (``SecurityConfig.credentials``), so an
unreadable or unparsable one stops ``expertd serve`` before anything loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tomllib
from collections.abc import Mapping
from typing import Any

from expertd.server.config.multihost import MultihostConfig
from expertd.server.config.server import SECTIONS, ServerConfig, flag, options

Values = dict[str | None, dict[str, Any]]


def command_line() -> list[str]:
    """This process's arguments after the program name (what ``expertd`` dispatches on)."""
    return sys.argv[1:]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per option (defaults shown; unset flags stay unset)."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file with any of the options below (flags win over it)")
    for section, (cls, _) in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]" if section else "server")
        for field in options(cls):
            default = field.default
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            help_text = field.metadata["help"] + (f" (default: {shown})" if default is not None else "")
            dest = f"{section}.{field.name}" if section else field.name
            if isinstance(default, bool):
                group.add_argument(flag(section, field), dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag(section, field), dest=dest, type=field.metadata["parse"] or str,
                                   metavar=field.metadata["metavar"] or field.name.upper(), default=argparse.SUPPRESS,
                                   help=help_text)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The config from parsed flags (see ``add_arguments``), the TOML file they name and ``environ``
    (default: this process's environment); the security files it names are read and checked."""
    environ = os.environ if environ is None else environ
    given = vars(args)
    values: Values = {section: {} for section in SECTIONS}
    if "config" in given:
        values = _merge(values, _read_toml(pathlib.Path(given["config"])))
    for dest, value in given.items():
        section, _, name = dest.rpartition(".")
        if dest != "config":
            values[section or None][name] = value
    config = build(values, environ)
    config.security.credentials()  # unreadable or unparsable: ValueError naming the option, before anything loads
    return config


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Parse ``expertd serve`` flags into a ServerConfig (``argparse`` exits on malformed flags)."""
    parser = argparse.ArgumentParser(prog="expertd serve", description="Serve MoE layers over gRPC.")
    add_arguments(parser)
    return from_args(parser.parse_args(argv), environ)


def build(values: Values, environ: Mapping[str, str]) -> ServerConfig:
    """A ServerConfig from option values by section (flags and TOML merged), the environment
    filling what they leave unset."""
    values = {section: dict(table) for section, table in values.items()}
    for section, (cls, _) in SECTIONS.items():
        values[section].update(_from_environment(cls, values[section], environ))
    values["multihost"] = _multihost_values(values["multihost"], environ)
    sections = {name: cls(**values[name]) for name, (cls, _) in SECTIONS.items() if name}
    return ServerConfig(**values[None], **sections)


def multihost_from(given: Mapping[str, Any], environ: Mapping[str, str]) -> MultihostConfig:
    """A MultihostConfig from option values by field name (``given``) over the LWS_* variables."""
    values = dict(given)
    values.update(_from_environment(MultihostConfig, values, environ))
    return MultihostConfig(**_multihost_values(values, environ))


# ---------------------------------------------------------------------- environment

def _from_environment(cls: type, given: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Values of the fields of ``cls`` that name an environment variable, where it is set and
    ``given`` has no value for them."""
    out = {}
    for field in dataclasses.fields(cls):
        name = field.metadata.get("env")
        if name is None or field.name in given or set(field.metadata.get("env_unless", ())) & given.keys():
            continue
        env_set = field.metadata.get("env_set")
        if env_set is not None and environ.get(env_set[0]) is not None:
            out[field.name] = env_set[1]
            continue
        text = environ.get(name)
        if text is not None and field.metadata.get("nonempty") and not text.strip():
            raise ValueError(f"${name} is set but empty: give a value, or unset it (security settings are never "
                             f"ignored)")
        if text is None or (text == "" and field.type != "str"):
            continue
        out[field.name] = _parse_environment(field, name, text)
    return out


def _parse_environment(field: dataclasses.Field, name: str, text: str) -> Any:
    base = str(field.type).removesuffix(" | None")
    if base == "bool":
        return text == "1"
    if base == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"${name} must be an integer, got {text!r}") from None
    return text


def _multihost_values(values: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``coordinator_address`` from $LWS_LEADER_ADDRESS and the coordinator port when unset."""
    values = dict(values)
    if values.get("coordinator_address") is None and environ.get("LWS_LEADER_ADDRESS"):
        port = values.get("coordinator_port", MultihostConfig.coordinator_port)
        values["coordinator_address"] = f"{environ['LWS_LEADER_ADDRESS']}:{port}"
    return values


# ---------------------------------------------------------------------- TOML

def _read_toml(path: pathlib.Path) -> Values:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    out: Values = {section: {} for section in SECTIONS}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            out[key] = _checked(key, SECTIONS[key][0], value, path)
        else:
            out[None].update(_checked(None, ServerConfig, {key: value}, path))
    return out


def _checked(section: str | None, cls: type, table: dict[str, Any], path: pathlib.Path) -> dict[str, Any]:
    known = {f.name: f for f in options(cls)}
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
    if field.metadata.get("nonempty") and isinstance(value, str) and not value.strip():
        raise ValueError(f"{where} is empty: give a value, or remove the key (security settings are never ignored)")
    if base == "float":
        return float(value)
    return tuple(value) if base == "tuple[int, ...]" else value


def _merge(base: Values, update: Values) -> Values:
    return {section: {**base.get(section, {}), **update.get(section, {})} for section in base}
