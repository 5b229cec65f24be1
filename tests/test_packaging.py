"""The distribution maps kernels/, server/ and client/ into the `expertd` namespace and nothing else."""
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_packages_import_from_the_repo_folders():
    import expertd.client
    import expertd.kernels
    import expertd.server

    assert pathlib.Path(expertd.kernels.__file__).parent == ROOT / "kernels"
    assert pathlib.Path(expertd.server.__file__).parent == ROOT / "server"
    assert pathlib.Path(expertd.client.__file__).parent == ROOT / "client"


def test_expertd_is_a_namespace_package():
    import expertd

    assert getattr(expertd, "__file__", None) is None  # PEP 420: no expertd/__init__.py


@pytest.mark.slow
def test_regular_wheel_has_only_expertd_packages(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    # every folder setuptools sees as a package is listed (csrc included): no "would be ignored" warning
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("expertd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.startswith("expertd-")}
    assert top_level == {"expertd"}, top_level
    for pkg in ("kernels", "server", "client"):
        assert f"expertd/{pkg}/__init__.py" in names
    assert "expertd/__init__.py" not in names
    # The native CPU kernels compile on first use from their sources and headers.
    native = sorted(p.name for p in (ROOT / "kernels" / "cpu" / "csrc").iterdir() if p.suffix in (".cc", ".h"))
    assert {"grouped_matmul_cpu.cc", "dispatch_cpu.cc", "parallel.h", "simd.h"} <= set(native)
    for name in native:
        assert f"expertd/kernels/cpu/csrc/{name}" in names, name
    for pkg in ("kernels/cpu", "server/models"):  # subpackages travel too
        assert f"expertd/{pkg}/__init__.py" in names, pkg
    # every subpackage in the tree travels (pyproject.toml lists them one by one)
    inits = {f"expertd/{path.relative_to(ROOT)}" for top in ("kernels", "server", "client")
             for path in (ROOT / top).rglob("__init__.py")}
    assert not inits - set(names), sorted(inits - set(names))
