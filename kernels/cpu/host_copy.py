"""Host copies for loading weights: a 2-D copy from any strided view into a row-major array.

  copy_2d(out, src): ``out[...] = src`` for ``out [R, C]`` C-contiguous and ``src [R, C]`` a view
      of the same dtype with any strides (a transposed or sliced one). A checkpoint stores an
      expert's weights ``[out, in]``; expertd serves them ``[in, out]``, so every expert matrix is
      copied from a transposed view once at load. With the native CPU library, 2- and 4-byte
      elements of a transposed view move as 8 x 8 / 4 x 4 register transposes in cache blocks
      (csrc/host_copy.cc, no GIL held); without it (or for other views), numpy copies cache
      blocks of TILE x TILE. Either way the bits are those of ``out[...] = src``.
  copy_2d_numpy(out, src): the path without the native library (it also casts, as assignment does).
  copy_2d_reference(out, src): ``out[...] = src``, what both paths are tested against.
  block_lookup(out, codes, tables, bm, bn) -> bool: ``out [R, C]`` (2- or 4-byte elements) = each
      code of ``codes [R, C]`` uint8 looked up in its (bm x bn) block's 256-entry table, ``tables
      [ceil(R/bm), ceil(C/bn), 256]`` of out's dtype: FP8 weights with block scales decoded through
      tables of code x scale. False, ``out`` untouched, without the native library.
  block_lookup_reference(codes, tables, bm, bn): the same in numpy, a new array.
"""
from __future__ import annotations

import numpy as np

from expertd.kernels.cpu.build import load

TILE = 256  # rows and columns of the blocks the numpy path moves at a time
_SAME_SIZE_INTEGERS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def copy_2d(out: np.ndarray, src: np.ndarray) -> None:
    """``out[...] = src`` (see the module docstring). ValueError naming the argument when ``out``
    is not a C-contiguous 2-D array, ``src`` not 2-D of ``out``'s shape, or the dtypes differ."""
    if out.ndim != 2 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous 2-D array, got {out.ndim}-D "
                         f"(c_contiguous={out.flags.c_contiguous}, writeable={out.flags.writeable})")
    if src.shape != out.shape:
        raise ValueError(f"src must have out's shape {list(out.shape)}, got {list(src.shape)}")
    if src.dtype != out.dtype:
        raise ValueError(f"src must have out's dtype {out.dtype}, got {src.dtype} (cast before copying)")
    if src.flags.c_contiguous or out.size == 0:
        out[...] = src
        return
    size = out.dtype.itemsize
    lib = load()[0] if size in _SAME_SIZE_INTEGERS else None
    if lib is not None and lib.expertd_strided_copy_2d(src.ctypes.data, src.strides[0], src.strides[1],
                                                       out.ctypes.data, out.shape[0], out.shape[1], size) == 0:
        return
    copy_2d_numpy(out, src)


def copy_2d_numpy(out: np.ndarray, src: np.ndarray) -> None:
    """``out[...] = src`` for 2-D arrays of one shape, TILE x TILE at a time so that reads and
    writes both stay in cache: `copy_2d`'s path without the native library, and a casting copy
    (``src`` of another dtype) for anyone."""
    size = out.dtype.itemsize
    if src.dtype == out.dtype and size in _SAME_SIZE_INTEGERS:  # numpy's strided bfloat16 loop is slow
        out, src = out.view(_SAME_SIZE_INTEGERS[size]), src.view(_SAME_SIZE_INTEGERS[size])
    rows, cols = out.shape
    for r in range(0, rows, TILE):
        for c in range(0, cols, TILE):
            out[r:r + TILE, c:c + TILE] = src[r:r + TILE, c:c + TILE]


def copy_2d_reference(out: np.ndarray, src: np.ndarray) -> None:
    """``out[...] = src``: the plain numpy copy `copy_2d` equals bit for bit."""
    out[...] = src


def block_lookup(out: np.ndarray, codes: np.ndarray, tables: np.ndarray, bm: int, bn: int) -> bool:
    """See the module docstring. ValueError naming the argument for shapes or dtypes that disagree."""
    rows, cols = codes.shape
    if codes.dtype != np.uint8 or codes.strides[1] != 1:
        raise ValueError(f"codes must be uint8 with contiguous rows, got {codes.dtype} strides {codes.strides}")
    if bm < 1 or bn < 1:
        raise ValueError(f"bm and bn must be >= 1, got {bm} x {bn}")
    if out.shape != codes.shape or not out.flags.c_contiguous or out.dtype.itemsize not in (2, 4):
        raise ValueError(f"out must be a C-contiguous [{rows}, {cols}] array of 2- or 4-byte elements, got "
                         f"{out.dtype} {list(out.shape)}")
    expected = (-(-rows // bm), -(-cols // bn), 256)
    if tables.shape != expected or tables.dtype != out.dtype or not tables.flags.c_contiguous:
        raise ValueError(f"tables must be a C-contiguous {out.dtype} {list(expected)} array, got {tables.dtype} "
                         f"{list(tables.shape)}")
    lib = load()[0]
    if lib is None or out.size == 0:
        return lib is not None
    return lib.expertd_block_lookup(codes.ctypes.data, rows, cols, codes.strides[0], tables.ctypes.data, bm, bn,
                                    out.ctypes.data, out.dtype.itemsize) == 0


def block_lookup_reference(codes: np.ndarray, tables: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """``tables[r // bm, c // bn, codes[r, c]]`` for every (r, c)."""
    rows, cols = codes.shape
    return tables[(np.arange(rows) // bm)[:, None], (np.arange(cols) // bn)[None, :], codes]
