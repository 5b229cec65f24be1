"""The native Forward port's tests need it built (the system's gRPC C++: the packages of
``build.PACKAGES_HINT``): skipped with the builder's reason where it cannot be, unless
``EXPERTD_REQUIRE_NATIVE_FRONT=1`` (CI sets it), which makes that a failure."""
from __future__ import annotations

import os

import pytest

from expertd.server.native_front import NativeUnavailable, build_module


def native_front_available() -> bool:
    """Whether the native Forward port builds here (True after building it); False where it cannot,
    unless EXPERTD_REQUIRE_NATIVE_FRONT=1, which raises the builder's reason instead."""
    try:
        build_module()
    except NativeUnavailable:
        if os.environ.get("EXPERTD_REQUIRE_NATIVE_FRONT") == "1":
            raise
        return False
    return True


def require_native_front() -> None:
    """Build the native Forward port now, or skip (fail under EXPERTD_REQUIRE_NATIVE_FRONT=1)."""
    try:
        build_module()
    except NativeUnavailable as exc:
        if os.environ.get("EXPERTD_REQUIRE_NATIVE_FRONT") == "1":
            raise
        pytest.skip(f"the native Forward port cannot be built here: {exc}")
