"""The family modules: one file per MoE family (or group of identical ones), each defining `FAMILY`
(an `expertd.server.models.family.Family`). `FAMILIES` lists them all, found by module name, so
adding a family is adding its file (and its test)."""
from __future__ import annotations

import importlib
import pkgutil

from expertd.server.models.family import Family


def _discover() -> tuple[Family, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__name__} must define FAMILY = Family(...)")
        found.append(family)
    return tuple(found)


FAMILIES: tuple[Family, ...] = _discover()
