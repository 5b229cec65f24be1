"""Regenerate the committed gRPC stubs: ``python -m expertd.client.protos`` (``make protos``).

Every ``proto/**/*.proto`` is compiled with the pinned grpcio-tools (see pyproject's ``dev``
extra) into ``client/pb/``. A proto in ``proto/<dir>/`` becomes the Python package
``expertd.client.pb.<dir>`` with a leading ``expertd/`` dropped, e.g.::

    proto/expertd/v1/expert.proto        -> expertd.client.pb.v1.expert_pb2 / expert_pb2_grpc
    proto/inference/grpc_service.proto   -> expertd.client.pb.inference.grpc_service_pb2

protoc writes imports by proto package path (``from expertd.v1 import expert_pb2``), which would
resolve as generic top-level names; they are rewritten to the ``expertd.client.pb`` location.
Descriptor file names stay proto-root relative (``expertd/v1/expert.proto``), so reflection and
cross-file imports between protos are unchanged.

Protos listed in ``PRIVATE_POOLS`` (the KServe ``inference`` package, whose names clash with
tritonclient's) register into that module's ``POOL`` instead of protobuf's default pool, so no
import of them can collide with another library's copy of the same names.

``--check`` regenerates into a temporary directory and exits 1 when the committed stubs differ
(tests/client/test_protos.py runs the same comparison). New generated packages must be listed in
pyproject.toml ``packages``.
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import re
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
STUBS_ROOT = REPO_ROOT / "client" / "pb"
STUBS_PACKAGE = "expertd.client.pb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
HEADER = "# Regenerate with `make protos` (python -m expertd.client.protos); do not edit.\n"
INIT_TEXT = '"""Generated gRPC stubs (`make protos`); do not edit."""\n'
PRIVATE_POOLS = {pathlib.PurePosixPath("inference"): "expertd.client.kserve_pool"}
"""proto folder -> module whose ``POOL`` (a private DescriptorPool) its generated files register into."""
_DEFAULT_POOL_ADD = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_IMPORTS_END = "# @@protoc_insertion_point(imports)\n"


def proto_files(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.PurePosixPath]:
    """Every .proto below ``proto_root``, as sorted proto-root-relative paths."""
    files = sorted(pathlib.PurePosixPath(p.relative_to(proto_root).as_posix()) for p in proto_root.rglob("*.proto"))
    for rel in files:
        if len(rel.parts) < 2:
            raise ValueError(f"{rel}: protos must live in a package folder (proto/<package>/...), not at proto/ itself")
    return files


def python_subpackage(proto_dir: pathlib.PurePosixPath) -> tuple[str, ...]:
    """``expertd/v1`` -> ``("v1",)``; ``inference`` -> ``("inference",)``."""
    parts = proto_dir.parts
    return parts[1:] if parts[0] == "expertd" else parts


def _rewrite_imports(text: str, proto_dirs: set[pathlib.PurePosixPath]) -> str:
    """Point protoc's ``from <proto.dir> import x_pb2`` lines at the expertd.client.pb packages."""
    for proto_dir in sorted(proto_dirs, key=lambda d: -len(d.parts)):
        old = ".".join(proto_dir.parts)
        new = ".".join((STUBS_PACKAGE, *python_subpackage(proto_dir)))
        text = re.sub(rf"^from {re.escape(old)} import ", f"from {new} import ", text, flags=re.MULTILINE)
    return text


def generate(out_root: pathlib.Path, proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Compile every proto under ``proto_root`` into ``out_root`` (replacing earlier stubs there).

    Returns the written files (stubs and package ``__init__.py`` files), relative to ``out_root``.
    """
    import importlib.resources

    from grpc_tools import protoc  # dev-only dependency; imported here so the client never needs it

    files = proto_files(proto_root)
    if not files:
        raise ValueError(f"no .proto files under {proto_root}")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as raw:
        raw_dir = pathlib.Path(raw)
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={raw_dir}",
            f"--pyi_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            *(str(f) for f in files),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {[str(f) for f in files]}")
        _remove_stubs(out_root)
        proto_dirs = {f.parent for f in files}
        written: list[pathlib.Path] = []
        for generated in sorted(raw_dir.rglob("*")):
            if not generated.is_file() or not generated.name.endswith(GENERATED_SUFFIXES):
                continue
            rel_dir = pathlib.PurePosixPath(generated.parent.relative_to(raw_dir).as_posix())
            target_rel = pathlib.Path(*python_subpackage(rel_dir), generated.name)
            text = HEADER + _rewrite_imports(generated.read_text(), proto_dirs)
            if rel_dir in PRIVATE_POOLS and generated.name.endswith("_pb2.py"):
                text = _into_private_pool(text, PRIVATE_POOLS[rel_dir], generated.name)
            (out_root / target_rel).parent.mkdir(parents=True, exist_ok=True)
            (out_root / target_rel).write_text(text)
            written.append(target_rel)
        for package_dir in sorted({pathlib.Path()} | {p.parent for p in written}):
            for level in [package_dir, *package_dir.parents]:
                init = level / "__init__.py"
                if not (out_root / init).exists():
                    (out_root / init).write_text(INIT_TEXT)
                    written.append(init)
    return sorted(written)


def _into_private_pool(text: str, pool_module: str, name: str) -> str:
    """Make a generated ``*_pb2.py`` add its file to ``pool_module.POOL`` instead of the default pool."""
    if text.count(_DEFAULT_POOL_ADD) != 1 or text.count(_IMPORTS_END) != 1:
        raise RuntimeError(f"{name}: protoc's output no longer has the expected pool registration line; "
                           "update expertd.client.protos")
    text = text.replace(_IMPORTS_END, f"{_IMPORTS_END}from {pool_module} import POOL as _private_pool\n")
    return text.replace(_DEFAULT_POOL_ADD, "DESCRIPTOR = _private_pool.AddSerializedFile(")


def _remove_stubs(out_root: pathlib.Path) -> None:
    """Delete earlier generated files (never anything hand-written) so removed protos leave nothing."""
    if not out_root.exists():
        return
    for path in out_root.rglob("*"):
        if path.is_file() and (path.name.endswith(GENERATED_SUFFIXES) or _is_generated_init(path)):
            path.unlink()


def _is_generated_init(path: pathlib.Path) -> bool:
    return path.name == "__init__.py" and path.read_text() == INIT_TEXT


def drift(committed_root: pathlib.Path = STUBS_ROOT, proto_root: pathlib.Path = PROTO_ROOT) -> list[str]:
    """Regenerate into a temporary directory; return the stub files that differ, are missing or stale."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp)
        expected = set(generate(fresh, proto_root))
        committed = {
            p.relative_to(committed_root)
            for p in committed_root.rglob("*")
            if p.is_file() and (p.name.endswith(GENERATED_SUFFIXES) or _is_generated_init(p))
        } if committed_root.exists() else set()
        problems = [f"missing: {p}" for p in sorted(expected - committed)]
        problems += [f"stale (no .proto): {p}" for p in sorted(committed - expected)]
        problems += [
            f"differs: {p}"
            for p in sorted(expected & committed)
            if not filecmp.cmp(fresh / p, committed_root / p, shallow=False)
        ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expertd.client.protos", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=STUBS_ROOT, help="output folder (default: client/pb)")
    parser.add_argument("--check", action="store_true", help="only compare with the committed stubs; exit 1 on drift")
    args = parser.parse_args(argv)
    if not PROTO_ROOT.is_dir():
        print(f"error: {PROTO_ROOT} not found; run from a source checkout", file=sys.stderr)
        return 2
    if args.check:
        problems = drift(args.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("stubs drifted from the .proto files: run `make protos`", file=sys.stderr)
        return 1 if problems else 0
    written = generate(args.out)
    for rel in written:
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
