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
  of 1..255 characters, not ``.`` or ``..``; it must exist (under ``/dev/shm``) as a regular file.
- ``offset`` + ``byte_size`` within the object's size; ``byte_size`` >= 1.
- At most ``max_regions`` regions and ``max_total_bytes`` bytes registered at once
  (INVALID_ARGUMENT naming ``name`` or ``byte_size``, with the limit).

Use: a tensor names ``(region, offset, byte_size)`` inside a registered region. ``input_array``
checks the region exists, the span lies inside it, the byte size equals the tensor's, and that the
object is still at least that large (a truncated object would fault the server on read), then
returns a read-only array viewing the mapping: no copy. ``output_slot`` checks the same for an
output (byte size at least the output's) and returns a ``Slot`` the answer is written into.

Unregistering while a request uses a region: the name goes at once (later requests naming it get
INVALID_ARGUMENT); the mapping stays valid while any request or array still refers to it (it is
closed when the last reference goes), so a request in flight reads and writes the memory it
validated, never an unmapped page.
"""
from __future__ import annotations

import dataclasses
import mmap
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
    """A mapped region: ``byte_size`` bytes of the object ``key`` from ``offset``.

    Holds the object's file descriptor (to check its size before each use) and the mapping; both
    are closed when the last reference to the region (registry, request, array view) goes.
    """

    def __init__(self, info: RegionInfo, fd: int):
        """Maps the region of ``fd`` (InvalidRequest naming ``key`` when it cannot be mapped); owns
        ``fd`` once mapped (the caller closes it if this raises)."""
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, info.offset + info.byte_size - start, offset=start)
        except (OSError, ValueError) as exc:
            raise InvalidRequest("key", f"cannot map shared-memory object {info.key!r}: {exc}") from None
        self.info = info
        self._map = mapping
        self._view = memoryview(mapping)[info.offset - start:info.offset - start + info.byte_size]
        self._fd = fd

    def span(self, offset: int, byte_size: int, field: str) -> memoryview:
        """Bytes ``[offset, offset + byte_size)`` of the region (InvalidRequest naming ``field`` when
        they are not inside it, or the object has shrunk below them)."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.info.byte_size:
            raise InvalidRequest(field, f"bytes [{offset}, {offset + byte_size}) are outside region "
                                        f"{self.info.name!r} of {self.info.byte_size} bytes")
        size = os.fstat(self._fd).st_size
        if size < self.info.offset + offset + byte_size:
            raise InvalidRequest(field, f"the shared-memory object {self.info.key!r} of region {self.info.name!r} "
                                        f"shrank to {size} bytes")
        return self._view[offset:offset + byte_size]

    def __del__(self):
        if not hasattr(self, "_fd"):
            return  # never mapped: the registering caller closed the descriptor
        try:
            self._view.release()
            self._map.close()
        except BufferError:
            pass  # arrays still view the mapping: it closes when the last one goes
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
        view = self.region.span(self.offset, array.nbytes, self.field)
        target = np.frombuffer(view, dtype=array.dtype, count=array.size).reshape(array.shape)
        np.copyto(target, array, casting="no")


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
        """The read-only ``shape`` ``dtype`` array at ``offset`` of region ``name``; ``byte_size`` must
        equal its bytes (InvalidRequest naming ``field`` otherwise). Little-endian hosts only."""
        expected = int(np.prod(shape)) * dtype.itemsize
        if byte_size != expected:
            raise InvalidRequest(f"{field}.byte_size", f"expected {expected} bytes for {dtype} {list(shape)}, "
                                                       f"got {byte_size}")
        view = self.region(name, f"{field}.region").span(offset, byte_size, f"{field}.offset")
        array = np.frombuffer(view, dtype=dtype).reshape(shape)
        array.flags.writeable = False
        return array

    def output_slot(self, name: str, offset: int, byte_size: int, needed: int, field: str) -> Slot:
        """A slot for an output of ``needed`` bytes at ``offset`` of region ``name`` (``byte_size``, the
        caller's room, at least ``needed``; InvalidRequest naming ``field`` otherwise)."""
        if byte_size < needed:
            raise InvalidRequest(f"{field}.byte_size", f"the output needs {needed} bytes, the slot has {byte_size}")
        region = self.region(name, f"{field}.region")
        region.span(offset, byte_size, f"{field}.offset")
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
