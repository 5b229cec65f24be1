"""Same-host zero copy: POSIX shared-memory regions whose tensors the server reads and writes in place.

    from expertd.client import ExpertClient
    from expertd.client.shared_memory import SharedMemoryRegion

    with ExpertClient("localhost:8001") as client, SharedMemoryRegion("io", 2 * x.nbytes) as region:
        client.register_shared_memory(region)          # the server maps the same pages
        inp = region.tensor(0, x.dtype, x.shape)        # SharedTensor: a view at offset 0
        out = region.tensor(x.nbytes, x.dtype, x.shape)
        inp.array[...] = x                              # the only copy of the input
        y = client.forward(inp, layer=0, out=out)       # y is out.array: written by the server
        client.unregister_shared_memory(region.name)

A region is a POSIX shared-memory object (``/dev/shm/<key>``) this process creates (and unlinks
on ``close``) or opens; it is registered with a server under ``name``, the server's registry being
the one its KServe v2 system shared-memory extension uses (tritonclient's own shared-memory
utilities work the same). Only for a server on this host.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from multiprocessing import shared_memory

import numpy as np

from expertd.client.pb.v1 import expert_pb2


@dataclasses.dataclass(frozen=True)
class SharedTensor:
    """A tensor in a registered region: ``array`` is this process's view of bytes
    ``[offset, offset + array.nbytes)`` of region ``region`` (row-major, little-endian)."""

    region: str
    offset: int
    array: np.ndarray

    def ref(self) -> expert_pb2.SharedMemoryRef:
        return expert_pb2.SharedMemoryRef(region=self.region, offset=self.offset, byte_size=self.array.nbytes)


class SharedMemoryRegion:
    """A POSIX shared-memory object of ``byte_size`` bytes, to register as region ``name``.

    Args:
      name: the region's name on the server.
      byte_size: its size in bytes.
      key: the object's name (``/expertd-<name>-<pid>`` by default).
      create: create the object (and unlink it on ``close``); False opens an existing one.
    """

    def __init__(self, name: str, byte_size: int, *, key: str | None = None, create: bool = True):
        self.name = name
        self.key = key or f"/expertd-{name}-{os.getpid()}"
        self.byte_size = int(byte_size)
        self._created = create
        self._shm = shared_memory.SharedMemory(self.key.lstrip("/"), create=create, size=self.byte_size if create
                                               else 0)
        if self._shm.size < self.byte_size:
            raise ValueError(f"shared-memory object {self.key!r} has {self._shm.size} bytes, fewer than {byte_size}")

    def tensor(self, offset: int, dtype, shape) -> SharedTensor:
        """A SharedTensor of ``dtype`` and ``shape`` at ``offset`` (a writable view of this region)."""
        dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
        count = int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.byte_size:
            raise ValueError(f"{dtype} {list(shape)} at offset {offset} does not fit region {self.name!r} "
                             f"of {self.byte_size} bytes")
        array = np.frombuffer(self._shm.buf, dtype=dtype, count=count, offset=offset).reshape(shape)
        return SharedTensor(self.name, offset, array)

    def close(self) -> None:
        """Unmap the object (views of it must be gone) and unlink it when this process created it."""
        try:
            try:
                self._shm.close()
            except BufferError:  # views left in reference cycles (exception tracebacks) go first
                gc.collect()
                self._shm.close()
        except BufferError:
            pass  # arrays still view it: the mapping goes with the last of them
        finally:
            if self._created:
                self._shm.unlink()
                self._created = False

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
