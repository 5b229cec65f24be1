"""The native Forward port's build (``server/native_front/build.py``): every C++ source and header
in csrc/ is compiled or included and in the module's key, the sources stay small, and the build
gives no warning (the compiler's messages are kept beside the module)."""
from __future__ import annotations

import shutil

from native_front_fixtures import require_native_front

from expertd.server.native_front import build

MAX_LINES = 500  # issue 48: no C++ file over 500 lines


def test_every_source_and_header_in_csrc_is_built_and_keyed_with_warnings_on():
    assert set(build.SOURCES) == set(build.CSRC_DIR.glob("*.cc"))
    assert build.HEADERS and set(build.HEADERS) == set(build.CSRC_DIR.glob("*.h"))
    assert {"-Wall", "-Wextra"} <= set(build.CXXFLAGS)


def test_a_change_to_any_source_or_header_gives_a_new_key(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC_DIR, copy)
    monkeypatch.setattr(build, "SOURCES", tuple(copy / path.name for path in build.SOURCES))
    monkeypatch.setattr(build, "HEADERS", tuple(copy / path.name for path in build.HEADERS))
    before = build.module_path(tmp_path)
    for path in build.SOURCES + build.HEADERS:
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert build.module_path(tmp_path) != before, path.name
        path.write_bytes(original)
    assert build.module_path(tmp_path) == before
    first, second = build.SOURCES[:2]  # the same bytes split otherwise between two files: another build
    moved = second.read_bytes()
    first.write_bytes(first.read_bytes() + moved[:1])
    second.write_bytes(moved[1:])
    assert build.module_path(tmp_path) != before


def test_no_source_or_header_is_over_the_line_cap():
    sizes = {path.name: len(path.read_text().splitlines()) for path in build.SOURCES + build.HEADERS}
    assert max(sizes.values()) <= MAX_LINES, sizes


def test_the_build_gives_no_warning_on_its_sources():
    require_native_front()
    log = build.module_path().with_name(build.BUILD_LOG).read_text()
    ours = [line for line in log.splitlines() if str(build.CSRC_DIR) in line and "warning:" in line]
    assert not ours, log
