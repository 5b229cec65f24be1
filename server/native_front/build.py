"""Building and loading the native front end's extension module (the C++ sources in ``csrc/``).

Built on first use with the system's gRPC C++ (the packages of ``PACKAGES_HINT``; found through
pkg-config's ``grpc++`` and ``protobuf``: libgrpc++-dev does not bring libprotobuf-dev's ``protobuf.pc``)
into ``<cache_dir>/native_front/<key>/``, keyed by a hash of every source and header in csrc/, the
descriptors and the compiler flags; later processes load it from there. Each source (ours and the
generated ones) is compiled on its own, as many at once as there are CPUs, then linked; what the
compiler said is kept beside the module (``BUILD_LOG``; the build is free of warnings). The C++
message classes are generated from the descriptors the Python stubs carry (``expert_pb2.DESCRIPTOR``,
and google.rpc's Status and error details for the rich refusals, handed to protoc as a descriptor
set), so both sides always speak the same ``expertd.v1``. To build ahead of time (an image):
``python -c "from expertd.server.native_front import build_module; build_module('DIR')"``.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sysconfig
import tempfile
import threading

from google.protobuf import any_pb2, descriptor_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from expertd.client.pb.v1 import expert_pb2

CSRC_DIR = pathlib.Path(__file__).with_name("csrc")
# The module's sources, one job each (csrc/README.md); headers there are all in the key (HEADERS).
SOURCES = tuple(CSRC_DIR / name for name in ("module.cc", "reactor.cc", "service.cc", "checks.cc", "queue.cc",
                                             "runner.cc", "stats.cc"))
HEADERS = tuple(sorted(CSRC_DIR.glob("*.h")))
MODULE = "expertd_native_front"
CXXFLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra")
BUILD_LOG = "build.log"  # beside the module: the compiler's messages of the build that made it
TOOLS = ("protoc", "grpc_cpp_plugin", "pkg-config", "g++")
PACKAGES_HINT = ("Debian / Ubuntu: apt-get install libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc "
                 "pkg-config")
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/expertd")
_lock = threading.Lock()


class NativeUnavailable(RuntimeError):
    """The native front end cannot be built here; the message says what is missing and how to get it."""


GENERATED = (status_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR, expert_pb2.DESCRIPTOR)
"""The files whose C++ classes are generated: google.rpc's Status and error details (the rich
refusals) and ``expertd/v1/expert.proto``. Their imports (Any, Duration) are libprotobuf's own."""


def _descriptor_set() -> bytes:
    """A FileDescriptorSet holding GENERATED as the Python stubs have them, imports first."""
    files = descriptor_pb2.FileDescriptorSet()
    for file in (any_pb2.DESCRIPTOR, duration_pb2.DESCRIPTOR, *GENERATED):
        files.file.add().ParseFromString(file.serialized_pb)
    return files.SerializeToString()


def module_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the built module for these sources and headers, descriptors, flags and Python lives."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode() + path.read_bytes())
    digest.update(_descriptor_set() + " ".join(CXXFLAGS).encode())
    key = digest.hexdigest()[:16]
    root = pathlib.Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    return root / "native_front" / key / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def build_module(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The extension module's path, built first if the cache lacks it (NativeUnavailable naming
    what is missing or the compiler's messages)."""
    module = module_path(cache_dir)
    if module.exists():
        return module
    tools = {name: shutil.which(name) for name in TOOLS}
    if missing := [name for name, path in tools.items() if path is None]:
        raise NativeUnavailable(f"{', '.join(missing)} not found ({PACKAGES_HINT})")
    flags = {}
    for kind in ("--cflags", "--libs"):
        found = subprocess.run([tools["pkg-config"], kind, "grpc++", "protobuf"], capture_output=True, text=True)
        if found.returncode != 0:
            raise NativeUnavailable(f"pkg-config grpc++ protobuf: {found.stderr.strip()} ({PACKAGES_HINT})")
        flags[kind] = found.stdout.split()
    module.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=module.parent) as scratch:  # concurrent builds each own one
        out = pathlib.Path(scratch)
        (out / "expert.desc").write_bytes(_descriptor_set())
        protos = [file.name for file in GENERATED]  # google/rpc/status.proto, ..., expertd/v1/expert.proto
        generated = subprocess.run([tools["protoc"], f"--descriptor_set_in={out / 'expert.desc'}", f"--cpp_out={out}",
                                    f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={tools['grpc_cpp_plugin']}",
                                    *protos], capture_output=True, text=True)
        if generated.returncode != 0:
            raise NativeUnavailable(f"protoc failed: {generated.stderr.strip()[-2000:]}")
        stems = [out / proto.removesuffix(".proto") for proto in protos]
        service = stems[-1]  # only expert.proto has a service
        sources = [*SOURCES, *(stem.with_suffix(".pb.cc") for stem in stems),
                   service.with_name(service.name + ".grpc.pb.cc")]
        objects = [out / f"{index}-{source.name}.o" for index, source in enumerate(sources)]
        includes = [f"-I{out}", f"-I{sysconfig.get_paths()['include']}", *flags["--cflags"]]

        def compile_one(source: pathlib.Path, obj: pathlib.Path) -> subprocess.CompletedProcess:
            return subprocess.run([tools["g++"], *CXXFLAGS, *includes, "-c", str(source), "-o", str(obj)],
                                  capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            steps = list(pool.map(compile_one, sources, objects))
        log = "".join(step.stderr for step in steps)
        if failed := [step for step in steps if step.returncode != 0]:
            raise NativeUnavailable(f"g++ failed: {failed[0].stderr.strip()[-2000:]}")
        linked = subprocess.run([tools["g++"], *CXXFLAGS, *map(str, objects), "-o", str(out / module.name),
                                 *flags["--libs"]], capture_output=True, text=True)
        log += linked.stderr
        if linked.returncode != 0:
            raise NativeUnavailable(f"g++ failed: {linked.stderr.strip()[-2000:]}")
        (out / BUILD_LOG).write_text(log)
        os.replace(out / BUILD_LOG, module.with_name(BUILD_LOG))
        os.replace(out / module.name, module)
    return module


@functools.cache
def _load(path: str):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(cache_dir: str | os.PathLike | None = None):
    """The extension module (``build_module`` first when needed); NativeUnavailable where it cannot be built."""
    with _lock:
        return _load(str(build_module(cache_dir)))

