"""How a configuration field is declared (``option``, ``from_environment``), the parsers flags use,
and the constants several sections share. The sections are one module each beside this one.

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
from collections.abc import Callable
from typing import Any

AUTH_TOKEN_ENV = "EXPERTD_AUTH_TOKEN"
DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_COORDINATOR_PORT = 8476
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # --event-loop (expertd.server.transport.event_loop)


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
