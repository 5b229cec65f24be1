"""FP8 e4m3 block dequantisation by look-up tables: the fast path of
`codecs.dequantize_fp8_block` for blocks of MIN_BLOCK_ELEMENTS or more (DeepSeek's 128x128).

Each block's 256 possible values (code x the block's scale, rounded once to the output dtype) are
tabulated; the native CPU library looks each code up in its block's table (`kernels.cpu.
block_lookup`), or, without it, a block row's tables lie side by side and one `np.take` over a
chunk of rows indexes them by `code + 256 * column block`. Both run outside the GIL: the loader's
threads dequantise in parallel. Nothing here knows tensor names.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from expertd.kernels import cpu

MIN_BLOCK_ELEMENTS = 1024  # smaller blocks: more tables than a chunk has codes; the per-chunk path
CHUNK_ELEMENTS = 1 << 16  # codes per look-up (its intp index: 512 KiB)
NAN_SCAN_WORDS = 1 << 15  # eight-code words the NaN scan holds at a time (256 KiB)

E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # code -> value
_E4M3_FINITE = np.isfinite(E4M3_VALUES)  # all but the NaN codes 0x7F and 0xFF
_INTEGER_VIEWS = {2: np.uint16, 4: np.uint32}
_LOW7, _ONES, _TOPS = (np.uint64(int(byte) * 0x0101010101010101) for byte in (0x7F, 0x01, 0x80))


def dequantize_into(codes, block_scales, bm: int, bn: int, out) -> bool:
    """Dequantise `codes` `[R, C]` (uint8 e4m3 codes) with `block_scales` `[ceil(R/bm), ceil(C/bn)]`
    (float32, checked) into `out` `[R, C]` (float32 or bfloat16) through a 256-entry table per
    block: code -> value x scale in float32, rounded once to out's dtype, as the per-chunk path
    computes it. False, leaving `out` unwritten, for blocks under MIN_BLOCK_ELEMENTS or when a
    value could be non-finite (a NaN code, or a scale that overflows some code): the per-chunk
    path then serves or refuses it, naming the index."""
    if bm * bn < MIN_BLOCK_ELEMENTS:
        return False
    with np.errstate(over="ignore"):  # an overflow is seen below and left to the per-chunk path
        table = E4M3_VALUES[_E4M3_FINITE] * block_scales[:, :, None]
    if not np.isfinite(table).all() or has_nan_code(codes):
        return False
    block_rows, block_cols = block_scales.shape
    tables = np.zeros((block_rows, block_cols, 256), out.dtype)
    tables[..., _E4M3_FINITE] = table
    if not (codes.strides[1] == 1 and out.flags.c_contiguous and cpu.block_lookup(out, codes, tables, bm, bn)):
        lookup_numpy(codes, tables, bm, bn, out)
    return True


def lookup_numpy(codes, tables, bm: int, bn: int, out) -> None:
    """`out[r, c] = tables[r // bm, c // bn, codes[r, c]]` in numpy (the path without the native
    library): `tables` `[ceil(R/bm), ceil(C/bn), 256]` of out's dtype."""
    block_rows, block_cols, _ = tables.shape
    bits = _INTEGER_VIEWS[out.dtype.itemsize]  # look-ups move the values as same-size integers
    tables, out = tables.view(bits).reshape(block_rows, block_cols * 256), out.view(bits)
    rows, cols = codes.shape
    column_base = np.arange(cols, dtype=np.intp) // bn * 256  # intp: np.take converts any other index
    step = max(1, min(bm, CHUNK_ELEMENTS // max(1, cols)))
    index = np.empty((step, cols), np.intp)
    for i in range(block_rows):
        for r0 in range(i * bm, min(rows, i * bm + bm), step):
            r1 = min(r0 + step, i * bm + bm, rows)
            np.add(codes[r0:r1], column_base, out=index[:r1 - r0])
            np.take(tables[i], index[:r1 - r0], out=out[r0:r1], mode="clip")  # in range: no checks


def has_nan_code(codes) -> bool:
    """Whether uint8 `codes` hold an e4m3fn NaN (0x7F or 0xFF: the low seven bits all set); eight
    codes at a time when they are contiguous."""
    if not (codes.flags.c_contiguous and codes.size % 8 == 0):
        return bool(((codes & 0x7F) == 0x7F).any())
    words = codes.reshape(-1).view(np.uint64)
    for start in range(0, len(words), NAN_SCAN_WORDS):
        low = words[start:start + NAN_SCAN_WORDS] & _LOW7
        low += _ONES  # a byte whose low seven bits are all set carries into its top bit
        low &= _TOPS
        if low.any():
            return True
    return False
