"""Building and loading the native front end's extension module (``front.cc``).

Built on first use with the system's gRPC C++ (the packages of ``PACKAGES_HINT``; found through
pkg-config's ``grpc++`` and ``protobuf``: libgrpc++-dev does not bring libprotobuf-dev's ``protobuf.pc``)
into ``<cache_dir>/native_front/<key>/``, keyed by a hash of the source, the descriptors and the
compiler flags; later processes load it from there. The C++ message classes are generated from the
descriptors the Python stubs carry (``expert_pb2.DESCRIPTOR``, and google.rpc's Status and error
details for the rich refusals, handed to protoc as a descriptor set), so both sides always speak the
same ``expertd.v1``. To build ahead of time (an image):
``python -c "from expertd.server.native_front import build_module; build_module('DIR')"``.
"""
from __future__ import annotations

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

SOURCE = pathlib.Path(__file__).with_name("front.cc")
MODULE = "expertd_native_front"
CXXFLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-Wall")
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
    """Where the built module for this source, descriptor and Python lives."""
    key = hashlib.sha256(SOURCE.read_bytes() + _descriptor_set() + " ".join(CXXFLAGS).encode()).hexdigest()[:16]
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
    flags = subprocess.run([tools["pkg-config"], "--cflags", "--libs", "grpc++", "protobuf"], capture_output=True,
                           text=True)
    if flags.returncode != 0:
        raise NativeUnavailable(f"pkg-config grpc++ protobuf: {flags.stderr.strip()} ({PACKAGES_HINT})")
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
        sources = [SOURCE, *(stem.with_suffix(".pb.cc") for stem in stems),
                   service.with_name(service.name + ".grpc.pb.cc")]
        compiled = subprocess.run([tools["g++"], *CXXFLAGS, f"-I{out}", f"-I{sysconfig.get_paths()['include']}",
                                   *map(str, sources), "-o", str(out / module.name), *flags.stdout.split()],
                                  capture_output=True, text=True)
        if compiled.returncode != 0:
            raise NativeUnavailable(f"g++ failed: {compiled.stderr.strip()[-2000:]}")
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

