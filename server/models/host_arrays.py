"""The host arrays the checkpoint loader fills (`checkpoint_layer`): allocated so that large ones
fault in huge pages, and filled from stored views of any strides.

  host_empty(shape, dtype) -> an uninitialised array (large ones: their own MADV_HUGEPAGE mapping,
      page-aligned, which JAX on one CPU device then uses in place)
  copy_into(out, src): `out[...] = src` for 2-D views of any strides, cast to out's dtype
  copy_new(array, dtype) -> a new array of `dtype` filled by `copy_into`
"""
from __future__ import annotations

import mmap

import numpy as np

from expertd.kernels import cpu

HUGE_ALLOCATION = 16 << 20  # outputs at least this large get their own huge-page mapping


def host_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array; a large one in its own anonymous mapping marked MADV_HUGEPAGE, so
    writing it faults in 2 MiB pages rather than 4 KiB ones (where THP is in "madvise" mode)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    if count * dtype.itemsize < HUGE_ALLOCATION or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype, count).reshape(shape)


def copy_new(array, dtype) -> np.ndarray:
    out = np.empty(array.shape, dtype)
    copy_into(out, array)
    return out


def copy_into(out: np.ndarray, src: np.ndarray) -> None:
    """`out[...] = src` for 2-D arrays of any strides (a transposed view), cast to out's dtype:
    equal dtypes by `expertd.kernels.cpu.copy_2d` (cache-blocked register transposes where the
    native CPU library is built), a cast by its numpy path (cache blocks)."""
    if src.ndim != 2 or src.flags.c_contiguous:
        out[...] = src
    elif src.dtype == out.dtype:
        cpu.copy_2d(out, src)
    else:
        cpu.copy_2d_numpy(out, src)
