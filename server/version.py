"""The server's version: the installed distribution's (pyproject.toml ``version``), read once.

Reported by GetModelInfo (``server_version``), KServe ServerMetadata and ``expertd_build_info``.
"""
from __future__ import annotations

import importlib.metadata

try:
    VERSION = importlib.metadata.version("expertd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
