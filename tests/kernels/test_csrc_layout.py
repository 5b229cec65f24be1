"""The native CPU sources as files (kernels/cpu/csrc): small files split by job, each opening with
a comment that says what it holds, every one of them in the build."""
import pathlib

from expertd.kernels.cpu import build

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
CPP = sorted(p for p in KERNELS.rglob("*") if p.suffix in (".cc", ".h"))


def test_no_cpp_file_in_kernels_is_over_500_lines():
    assert CPP
    long = {str(p.relative_to(KERNELS)): n for p in CPP if (n := len(p.read_text().splitlines())) > 500}
    assert not long


def test_every_cpp_file_opens_with_a_comment_saying_what_it_holds():
    bare = [p.name for p in CPP if not p.read_text().startswith("// ")]
    assert not bare


def test_every_source_is_built_and_every_header_is_in_the_build_key():
    assert {p for p in CPP if p.suffix == ".cc"} == set(build.SOURCES)
    assert {p for p in CPP if p.suffix == ".h"} == set(build.HEADERS)
