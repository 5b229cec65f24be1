"""`StoredTensors`: a checkpoint's safetensors files as a lazy, memory-mapped mapping name -> array.

- Which file holds which tensor comes from `model.safetensors.index.json` (its `weight_map`), or,
  without one, from the headers of every `*.safetensors` file in the directory.
- A file's header (8-byte little-endian length, then JSON: dtype, shape and byte range per tensor)
  is read the first time one of its tensors is asked for, and checked: byte ranges inside the
  file, sizes equal to shape x dtype size. Nothing else is read until an array is indexed.
- `tensors[name]` is a read-only numpy view of the memory-mapped bytes, in the numpy / ml_dtypes
  dtype of the header (`quant.numpy_dtype`): float8 (F8_E4M3, F8_E8M0) included, which
  safetensors' own numpy backend cannot give. No copy is made; pages are read as they are touched.
- `release(name)` drops the process's mapping of a tensor's pages (madvise DONTNEED; the data stays
  in the page cache), so a loader that has consumed a tensor keeps its resident memory bounded.
  Reading from several threads is safe.

Every problem raises `StoredError` (a ValueError) naming the file or tensor.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from expertd.server.models.quant import QuantError, numpy_dtype

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
PAGE = mmap.PAGESIZE


class StoredError(ValueError):
    """A checkpoint's files cannot be read as safetensors; the message names the file or tensor."""


class _File:
    """One safetensors file: its parsed header and (once an array is asked for) its memory map."""

    def __init__(self, path: Path, where: str):
        self.path = path
        self.where = where
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) != 8:
                    raise ValueError("shorter than the 8-byte header length")
                (length,) = struct.unpack("<Q", prefix)
                if length > min(MAX_HEADER_BYTES, size - 8):
                    raise ValueError(f"header length {length} does not fit the file ({size} bytes)")
                header = json.loads(f.read(length))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise StoredError(f"{where}: cannot read {path.name}: {exc}") from exc
        if not isinstance(header, dict):
            raise StoredError(f"{where}: cannot read {path.name}: its header is not a JSON object")
        self.data_start = 8 + length
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            self.entries[name] = self._entry(name, entry, size - self.data_start)

    def _entry(self, name, entry, data_bytes):
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise StoredError(f"{self.where}: cannot read {self.path.name}: tensor {name!r} has a malformed "
                              f"header entry {entry!r}") from exc
        if not (0 <= begin <= end <= data_bytes):
            raise StoredError(f"{self.where}: cannot read {self.path.name}: tensor {name!r} bytes {begin}..{end} "
                              f"lie outside the file's {data_bytes} data bytes")
        try:
            itemsize = numpy_dtype(dtype).itemsize
        except QuantError:
            itemsize = None  # a dtype numpy cannot hold (e.g. F4): readable as a header, refused as an array
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise StoredError(f"{self.where}: cannot read {self.path.name}: tensor {name!r} holds {end - begin} "
                              f"bytes, but {dtype} {list(shape)} needs {math.prod(shape) * itemsize}")
        return dtype, shape, begin, end

    def array(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.entries[name]
        try:
            np_dtype = numpy_dtype(dtype)
        except QuantError as exc:
            raise StoredError(f"{self.where}: tensor {name!r}: {exc}") from exc
        with self._lock:  # loaders read experts from several threads
            if self._map is None:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, np_dtype)
        return np.frombuffer(self._map, np_dtype, count, self.data_start + begin).reshape(shape)

    def release(self, name: str, part: int | None = None, parts: int = 1) -> None:
        """Drop the whole pages inside tensor `name`'s bytes (or inside part `part` of `parts` equal
        parts, e.g. one expert of an `[E, ...]` tensor) from this process's mapping."""
        if self._map is None or not hasattr(self._map, "madvise"):
            return
        _dtype, _shape, begin, end = self.entries[name]
        if part is not None:
            size = (end - begin) // parts
            begin, end = begin + part * size, begin + (part + 1) * size
        start = -(-(self.data_start + begin) // PAGE) * PAGE
        stop = (self.data_start + end) // PAGE * PAGE
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array still views it: the map closes when that array goes
                pass
            self._map = None


class StoredTensors(Mapping):
    """The tensors of checkpoint directory `path` (see the module docstring). Use as a context manager."""

    def __init__(self, path, *, where: str | None = None):
        self.path = Path(path)
        self.where = where or f"checkpoint {self.path}"
        self._files: dict[Path, _File] = {}
        self._lock = threading.Lock()
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
                self.location = {str(name): self.path / str(file) for name, file in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise StoredError(f"{self.where}: {INDEX_FILE} has no valid weight_map ({exc})") from exc
            for file in sorted(set(self.location.values())):
                if not file.is_file():
                    raise StoredError(f"{self.where}: {file.name} (listed in {INDEX_FILE}) is missing")
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise StoredError(f"{self.where}: no *.safetensors files")
            self.location = {name: shard for shard in shards for name in self._file(shard).entries}

    def __enter__(self) -> StoredTensors:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _file(self, path: Path) -> _File:
        with self._lock:
            if path not in self._files:
                self._files[path] = _File(path, self.where)
            return self._files[path]

    def _holder(self, name: str) -> _File:
        if name not in self.location:
            raise StoredError(f"{self.where}: tensor {name!r} is missing")
        file = self._file(self.location[name])
        if name not in file.entries:
            raise StoredError(f"{self.where}: tensor {name!r} is listed in {INDEX_FILE} but not stored in "
                              f"{file.path.name}")
        return file

    # Mapping: names -> memory-mapped arrays

    def __contains__(self, name) -> bool:
        return name in self.location

    def __getitem__(self, name: str) -> np.ndarray:
        return self._holder(name).array(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.location)

    def __len__(self) -> int:
        return len(self.location)

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) of `name`, from its file's header alone."""
        dtype, shape, _begin, _end = self._holder(name).entries[name]
        return dtype, shape

    def nbytes(self, name: str) -> int:
        _dtype, _shape, begin, end = self._holder(name).entries[name]
        return end - begin

    def file_of(self, name: str) -> Path:
        return self._holder(name).path

    def release(self, name: str, part: int | None = None, parts: int = 1) -> None:
        """Drop the mapped pages of tensor `name` (or of its part `part` of `parts`, e.g. one expert
        of a fused `[E, ...]` tensor) from this process; they stay in the page cache."""
        if name in self.location and self.location[name] in self._files:
            self._files[self.location[name]].release(name, part, parts)


def files_bytes(path) -> int:
    """Total size of the *.safetensors files of checkpoint directory `path`."""
    return sum(os.path.getsize(p) for p in Path(path).glob("*.safetensors"))
