"""System shared memory: POSIX shared-memory regions that request tensors name instead of carrying bytes.

One ``SharedMemoryRegistry`` per server, behind both front ends: the KServe v2 system shared-memory
extension (``SystemSharedMemoryRegister`` / ``Status`` / ``Unregister``, tensors naming
``shared_memory_region`` / ``_offset`` / ``_byte_size`` in their parameters, as
``tritonclient.utils.shared_memory`` uses them) and expertd.v1 (``RegisterSharedMemory``, ...,
``Tensor.shared_memory``, ``ForwardRequest.output_shared_memory``). A region registered through
one is visible to the other.

Registration rules (``InvalidRequest`` naming the field otherwise; INVALID_ARGUMENT):
- ``name``: 1..128 printable characters, not registered already.
- ``key``: the POSIX object as ``shm_open`` names it (leading ``/`` optional): one path component
  of 1..255 characters, not ``.`` or ``..``; it must exist (under ``/dev/shm``) as a regular file,
  opened without following a symbolic link (``O_NOFOLLOW``), owned by the user the server runs as
  (its effective uid: a server running as root does not open another user's object for a caller).
- ``offset`` + ``byte_size`` within the object's size; ``byte_size`` >= 1.
- At most ``max_regions`` regions and ``max_total_bytes`` bytes registered at once
  (INVALID_ARGUMENT naming ``name`` or ``byte_size``, with the limit).

Use: a tensor names ``(region, offset, byte_size)`` inside a registered region. ``input_array``
checks the region exists, the span lies inside it and the byte size equals the tensor's, then reads
the bytes into an array of the server's own (``preadv``: one copy, in the kernel). ``output_slot``
checks the same for an output (byte size at least the output's) and returns a ``Slot`` the answer
is written into (``pwrite``). The server never maps a caller's object: a caller that truncates
its object while a call reads or writes it gets INVALID_ARGUMENT for that call (the read comes
back short), never a fault (SIGBUS) of the server.

Unregistering while a request uses a region: the name goes at once (later requests naming it get
INVALID_ARGUMENT); the object stays open while any request still refers to it (it is closed when
the last reference goes), so a request in flight reads and writes the object it validated.
"""
from __future__ import annotations

import dataclasses
import math
import os
import stat
import threading

import numpy as np

from expertd.server.errors import InvalidRequest

SHM_DIR = "/dev/shm"
MAX_NAME_CHARS = 128
MAX_KEY_CHARS = 255
DEFAULT_MAX_REGIONS = 64
DEFAULT_MAX_TOTAL_BYTES = 64 << 30


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A registered region as its caller described it."""

    name: str
    key: str
    offset: int
    byte_size: int


class Region:
    """A registered region: ``byte_size`` bytes of the object ``key`` from ``offset``, read and
    written through its open file descriptor (closed when the last reference goes)."""

    def __init__(self, info: RegionInfo, fd: int):
        """Owns ``fd`` from here on."""
        self.info = info
        self._fd = fd

    def _check(self, offset: int, byte_size: int, field: str) -> int:
        """The object's file offset of the region's byte ``offset`` (InvalidRequest naming ``field``
        when ``[offset, offset + byte_size)`` is not inside the region)."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.info.byte_size:
            raise InvalidRequest(field, f"bytes [{offset}, {offset + byte_size}) are outside region "
                                        f"{self.info.name!r} of {self.info.byte_size} bytes")
        return self.info.offset + offset

    def _shrank(self, field: str) -> InvalidRequest:
        size = os.fstat(self._fd).st_size
        return InvalidRequest(field, f"the shared-memory object {self.info.key!r} of region {self.info.name!r} "
                                     f"shrank to {size} bytes")

    def check(self, offset: int, byte_size: int, field: str) -> None:
        """InvalidRequest naming ``field`` unless the span lies inside the region and the object."""
        start = self._check(offset, byte_size, field)
        if os.fstat(self._fd).st_size < start + byte_size:
            raise self._shrank(field)

    def read_into(self, offset: int, out: np.ndarray, field: str) -> None:
        """Fill the contiguous array ``out`` from the region's byte ``offset``."""
        start = self._check(offset, out.nbytes, field)
        buffer = memoryview(out.reshape(-1).view(np.uint8))  # bytes of any dtype (bfloat16 exports none)
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fd, [buffer[done:]], start + done)
            if got <= 0:  # the object ends before the span: truncated since registration
                raise self._shrank(field)
            done += got

    def write(self, offset: int, array: np.ndarray, field: str) -> None:
        """Write the contiguous array ``array`` at the region's byte ``offset``."""
        start = self._check(offset, array.nbytes, field)
        if os.fstat(self._fd).st_size < start + array.nbytes:  # never grow an object its owner shrank
            raise self._shrank(field)
        buffer = memoryview(array.reshape(-1).view(np.uint8))
        done = 0
        while done < len(buffer):
            done += os.pwrite(self._fd, buffer[done:], start + done)

    def __del__(self):
        if hasattr(self, "_fd"):
            os.close(self._fd)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one output goes: ``byte_size`` bytes at ``offset`` of ``region`` (already validated)."""

    region: Region
    offset: int
    byte_size: int
    field: str

    def write(self, array: np.ndarray) -> None:
        """Copy ``array`` (little-endian, row-major) into the slot's first ``array.nbytes`` bytes."""
        self.region.write(self.offset, np.ascontiguousarray(array), self.field)


class SharedMemoryRegistry:
    """Registered regions by name (thread-safe; see module docstring)."""

    def __init__(self, *, max_regions: int = DEFAULT_MAX_REGIONS, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                 shm_dir: str = SHM_DIR):
        self.max_regions = max_regions
        self.max_total_bytes = max_total_bytes
        self.shm_dir = shm_dir
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> RegionInfo:
        """Map ``byte_size`` bytes of object ``key`` from ``offset`` as region ``name``."""
        _check_name(name)
        path = os.path.join(self.shm_dir, _object_name(key))
        if byte_size < 1:
            raise InvalidRequest("byte_size", f"expected >= 1 bytes, got {byte_size}")
        if offset < 0:
            raise InvalidRequest("offset", f"expected >= 0, got {offset}")
        with self._lock:
            if name in self._regions:
                raise InvalidRequest("name", f"region {name!r} is registered already; unregister it first")
            if len(self._regions) >= self.max_regions:
                raise InvalidRequest("name", f"{len(self._regions)} regions are registered, the most allowed; "
                                             "unregister one first")
            total = sum(r.info.byte_size for r in self._regions.values())
            if total + byte_size > self.max_total_bytes:
                raise InvalidRequest("byte_size", f"{byte_size} more bytes would exceed the {self.max_total_bytes} "
                                                  f"bytes that may be registered at once ({total} are)")
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise InvalidRequest("key", f"cannot open shared-memory object {key!r}: {exc.strerror}") from None
            try:
                status = os.fstat(fd)
                if not stat.S_ISREG(status.st_mode):
                    raise InvalidRequest("key", f"{key!r} is not a shared-memory object")
                if status.st_uid != os.geteuid():
                    raise InvalidRequest("key", f"shared-memory object {key!r} belongs to uid {status.st_uid}, not "
                                                f"to the server's user (uid {os.geteuid()}): create it as that user")
                if offset + byte_size > status.st_size:
                    raise InvalidRequest("byte_size", f"offset {offset} + byte_size {byte_size} exceeds the "
                                                      f"{status.st_size} bytes of object {key!r}")
                region = Region(RegionInfo(name, key, offset, byte_size), fd)
            except BaseException:
                os.close(fd)
                raise
            self._regions[name] = region
            return region.info

    def unregister(self, name: str = "") -> None:
        """Forget region ``name`` (every region when empty); unknown names are ignored, as in Triton."""
        with self._lock:
            if name:
                self._regions.pop(name, None)
            else:
                self._regions.clear()

    def status(self, name: str = "") -> list[RegionInfo]:
        """Region ``name`` (LookupError, NOT_FOUND, when not registered), or every region, by name."""
        with self._lock:
            if name:
                if name not in self._regions:
                    raise LookupError(f"no shared-memory region {name!r} is registered")
                return [self._regions[name].info]
            return [self._regions[n].info for n in sorted(self._regions)]

    def region(self, name: str, field: str) -> Region:
        """The region called ``name`` (InvalidRequest naming ``field`` when none is)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidRequest(field, f"no shared-memory region {name!r} is registered")
        return region

    # -- tensors in regions ----------------------------------------------------------------------
    def input_array(self, name: str, offset: int, byte_size: int, dtype: np.dtype, shape: tuple[int, ...],
                    field: str) -> np.ndarray:
        """A read-only ``shape`` ``dtype`` array of the bytes at ``offset`` of region ``name`` (read now,
        the server's own copy); ``byte_size`` must equal its bytes (InvalidRequest naming ``field``
        otherwise). Little-endian hosts only."""
        expected = math.prod(shape) * dtype.itemsize
        if byte_size != expected:
            raise InvalidRequest(f"{field}.byte_size", f"expected {expected} bytes for {dtype} {list(shape)}, "
                                                       f"got {byte_size}")
        region = self.region(name, f"{field}.region")
        region.check(offset, byte_size, f"{field}.offset")  # inside the region before anything is allocated
        array = np.empty(shape, dtype)
        region.read_into(offset, array, f"{field}.offset")
        array.flags.writeable = False
        return array

    def output_slot(self, name: str, offset: int, byte_size: int, needed: int, field: str) -> Slot:
        """A slot for an output of ``needed`` bytes at ``offset`` of region ``name`` (``byte_size``, the
        caller's room, at least ``needed``; InvalidRequest naming ``field`` otherwise)."""
        if byte_size < needed:
            raise InvalidRequest(f"{field}.byte_size", f"the output needs {needed} bytes, the slot has {byte_size}")
        region = self.region(name, f"{field}.region")
        region.check(offset, byte_size, f"{field}.offset")
        return Slot(region, offset, byte_size, f"{field}.offset")


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidRequest("name", f"expected 1..{MAX_NAME_CHARS} printable characters, got {name!r}")


def _object_name(key: str) -> str:
    """The file name under /dev/shm of POSIX shared-memory object ``key`` (leading slashes dropped,
    as glibc's shm_open does); InvalidRequest naming ``key`` for anything but one path component."""
    stripped = key.lstrip("/")
    if not stripped or len(stripped) > MAX_KEY_CHARS or "/" in stripped or "\0" in stripped \
            or stripped in (".", ".."):
        raise InvalidRequest("key", f"expected a shared-memory object name such as '/expertd_input' "
                                    f"(one component, 1..{MAX_KEY_CHARS} characters), got {key!r}")
    return stripped
