"""Pure numpy dequantisers of the official quantised weight formats: arrays in, dense array out.

Nothing here knows tensor names or config.json; `names.py` picks the function and its inputs. Every
function takes the stored tensors (numpy arrays or memory maps of the checkpoint files), checks
shapes, dtypes and scales, and returns a new dense array in `out_dtype` (float32 or bfloat16). It
works a chunk of rows at a time, so besides the output it holds O(CHUNK_ELEMENTS) float32
temporaries and the decoded scales of at most one matrix (for block scales, one float per column
and block row), and a memory-mapped input is read once, never copied whole. Products are formed in
float32 and rounded once to `out_dtype` (round to nearest even), as the reference dequantisers do.

Scales: a float scale (float32 / bfloat16 / float16) must be finite and >= 0 (a zero scale zeroes
its block, which the formats can express); an e8m0 scale (`ml_dtypes.float8_e8m0fnu`, or its raw
bytes as uint8) is 2**(code - 127) and its code 0xFF (NaN) is refused. A dequantised value that is
not finite (a float8 NaN code in the weight, or an overflowing scale) is refused too. Every problem
raises `QuantError` (a ValueError) that names the tensor and, for bad values, the index.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from expertd.server.models.quant import fp8_tables

# float32 elements of temporaries per chunk of rows (8 MiB)
CHUNK_ELEMENTS = 1 << 21

OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
FLOAT_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
RAW_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

_CODES = np.arange(256, dtype=np.uint8)
# code -> float32 value; e4m3fn has NaN at 0x7F and 0xFF, e8m0 is 2**(code-127) with NaN at 0xFF
_E4M3_VALUES = fp8_tables.E4M3_VALUES
_E8M0_VALUES = _CODES.view(E8M0).astype(np.float32)
# FP4 e2m1 code -> value (OCP MX spec: sign is bit 3, exponent bits 2-1 with bias 1, mantissa bit 0);
# equals ml_dtypes.float4_e2m1fn
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


class QuantError(ValueError):
    """A quantised tensor or quantization_config cannot be read as stated; the message names it."""


def out_dtype_of(dtype) -> np.dtype:
    """The numpy dtype of `dtype` ("float32", "bfloat16", a numpy / ml_dtypes / jnp dtype), checked."""
    try:
        resolved = OUT_DTYPES[dtype] if isinstance(dtype, str) and dtype in OUT_DTYPES else np.dtype(dtype)
    except TypeError as exc:
        raise QuantError(f"out_dtype must be float32 or bfloat16, got {dtype!r}") from exc
    if resolved not in OUT_DTYPES.values():
        raise QuantError(f"out_dtype must be float32 or bfloat16, got {resolved}")
    return resolved


def dequantize_fp8_block(weight, scale, block_size=(128, 128), *, out_dtype=np.float32, name="weight",
                         scale_name="weight_scale_inv") -> np.ndarray:
    """FP8 e4m3 weight with one scale per (bm x bn) block, as DeepSeek defines it.

    Args:
      weight: `[..., R, C]` float8_e4m3fn (or its raw bytes as uint8 / int8); leading dims, if any,
        are independent matrices (e.g. experts).
      scale: `[..., ceil(R/bm), ceil(C/bn)]` float32 / bfloat16 / float16 (`weight_scale_inv`), or
        e8m0 (`float8_e8m0fnu` or raw uint8 codes; ue8m0 scales, named `.scale` by DeepSeek-V4).
      block_size: (bm, bn), config.json's `weight_block_size`.

    Returns `[..., R, C]` in `out_dtype` with `out[..., r, c] = float(weight[..., r, c]) *
    scale[..., r // bm, c // bn]`: block (i, j) covers rows bm*i .. min(bm*i + bm, R) and columns
    bn*j .. min(bn*j + bn, C), so edge blocks are partial and counted by ceiling (DeepSeek's
    `weight_dequant`; not block = dim / grid).
    """
    codes = _byte_codes(weight, name, (E4M3,), "a float8 e4m3 weight")
    _need_ndim(codes, 2, name)
    bm, bn = _block_size(block_size)
    *lead, rows, cols = codes.shape
    scales = _scale_array(scale, scale_name, e8m0=True)
    expected = (*lead, -(-rows // bm), -(-cols // bn))
    _check_shape(scales, expected, scale_name,
                 f"one scale per {bm}x{bn} block of {name!r} {list(codes.shape)}, edge blocks counted by ceiling")
    out = np.empty(codes.shape, out_dtype_of(out_dtype))
    count = math.prod(lead)
    codes3, scales3, out3 = (a.reshape(count, *a.shape[-2:]) for a in (codes, scales, out))
    for m in range(codes3.shape[0]):
        block_scales = _decode_scale(scales3[m], scale_name, (m * scales3.shape[1], scales.shape[:-1]))
        if fp8_tables.dequantize_into(codes3[m], block_scales, bm, bn, out3[m]):
            continue
        column_scales = np.repeat(block_scales, bn, axis=1)[:, :cols]  # [ceil(R/bm), C]
        for r0, r1 in _row_chunks(rows, cols):
            values = _E4M3_VALUES[codes3[m, r0:r1]]
            for i in range(r0 // bm, -(-r1 // bm)):  # the block rows this chunk touches
                values[max(r0, i * bm) - r0:min(r1, i * bm + bm) - r0] *= column_scales[i]
            _check_finite(values, name, (m * rows + r0, codes.shape[:-1]))
            out3[m, r0:r1] = values
    return out


def fp8_block_codes(weight, scale, block_size=(128, 128), *, name="weight",
                    scale_name="weight_scale_inv") -> tuple[np.ndarray, np.ndarray]:
    """The stored codes and scales of a block-scaled FP8 weight, kept (not dequantised): the
    weight `[..., R, C]` viewed as float8_e4m3fn and its scales `[..., ceil(R/bm), ceil(C/bn)]`
    decoded to float32 (float or e8m0 as stored), each checked as `dequantize_fp8_block` checks
    them; `dequantize_fp8_block(weight, scale, ...)` is codes x the scale of each code's block."""
    codes = _byte_codes(weight, name, (E4M3,), "a float8 e4m3 weight")
    _need_ndim(codes, 2, name)
    bm, bn = _block_size(block_size)
    *lead, rows, cols = codes.shape
    scales = _scale_array(scale, scale_name, e8m0=True)
    _check_shape(scales, (*lead, -(-rows // bm), -(-cols // bn)), scale_name,
                 f"one scale per {bm}x{bn} block of {name!r} {list(codes.shape)}, edge blocks counted by ceiling")
    return codes.view(E4M3), _decode_scale(scales, scale_name)


def dequantize_fp8_per_channel(weight, scale, *, channel_axis=-2, out_dtype=np.float32, name="weight",
                               scale_name="weight_scale") -> np.ndarray:
    """FP8 e4m3 weight with one float scale per output channel (or one for the whole tensor).

    Args:
      weight: `[..., R, C]` float8_e4m3fn (or raw bytes as uint8 / int8).
      scale: one element (per-tensor: shape `()`, `[1]`, `[1, 1]`), or per channel of `channel_axis`:
        - `channel_axis=-2` (rows; `nn.Linear [out, in]`: fbgemm `weight_scale [out, 1]`, Mistral
          `qscale_weight [out]`): `[..., R]` or `[..., R, 1]`;
        - `channel_axis=-1` (last axis; Llama 4 fused experts `[E, in, out]`): `[..., C]`, `[..., 1, C]`
          (fbgemm `gate_up_proj_scale [E, 1, 2I]`) or `[..., C, 1]` (fbgemm `down_proj_scale [E, H, 1]`:
          its H is the weight's last axis, as fbgemm's quantiser transposes before its per-row scales).
        float32 / bfloat16 / float16.

    Returns `[..., R, C]` in `out_dtype`: `out[..., r, c] = float(weight[..., r, c]) * s[..., r]`
    (channel_axis -2) or `* s[..., c]` (channel_axis -1), `s` the scale with its unit axes dropped.
    """
    codes = _byte_codes(weight, name, (E4M3,), "a float8 e4m3 weight")
    _need_ndim(codes, 2, name)
    if channel_axis not in (-1, -2):
        raise QuantError(f"channel_axis must be -1 or -2, got {channel_axis!r}")
    *lead, rows, cols = codes.shape
    scales = _scale_array(scale, scale_name, e8m0=False)
    lead = tuple(lead)
    if channel_axis == -2:
        allowed = [(*lead, rows), (*lead, rows, 1)]
    else:
        allowed = [(*lead, cols), (*lead, 1, cols), (*lead, cols, 1)]
    per_tensor = scales.size == 1 and scales.ndim <= 2
    if not per_tensor and scales.shape not in allowed:
        raise QuantError(f"tensor {scale_name!r}: shape {list(scales.shape)} does not fit weight {name!r} "
                         f"{list(codes.shape)}: expected one of {[list(s) for s in allowed]} "
                         "(one scale per output channel) or a single element")
    channels = rows if channel_axis == -2 else cols
    out = np.empty(codes.shape, out_dtype_of(out_dtype))
    count = math.prod(lead)
    codes3, out3 = codes.reshape(count, rows, cols), out.reshape(count, rows, cols)
    scales2 = scales.reshape(1, 1) if per_tensor else scales.reshape(count, channels)
    for m in range(codes3.shape[0]):
        k = 0 if per_tensor else m
        channel_scales = _decode_scale(scales2[k], scale_name, (k * scales2.shape[1], (scales2.size,)))
        for r0, r1 in _row_chunks(rows, cols):
            values = _E4M3_VALUES[codes3[m, r0:r1]]
            if per_tensor:
                values *= channel_scales[0]
            elif channel_axis == -2:
                values *= channel_scales[r0:r1, None]
            else:
                values *= channel_scales[None, :]
            _check_finite(values, name, (m * rows + r0, codes.shape[:-1]))
            out3[m, r0:r1] = values
    return out


def dequantize_mxfp4(blocks, scales, *, out_dtype=np.float32, name="blocks", scale_name="scales") -> np.ndarray:
    """MXFP4 (gpt-oss `*_blocks` / `*_scales`): 32 e2m1 values per 16 bytes, one e8m0 scale each.

    Args:
      blocks: `[..., G, 16]` uint8 (gpt-oss: `[E, R, C/32, 16]`); byte k of a block holds element 2k
        in its low nibble and element 2k+1 in its high nibble.
      scales: `[..., G]` uint8 or float8_e8m0fnu, e8m0 (bias 127).

    Returns `[..., G*32]` in `out_dtype` (gpt-oss: `[E, R, C]`; transformers' `GptOssExperts` holds
    the transpose `[E, C, R]`, which the family's loader makes):
    `out[..., 32g + 2k] = e2m1(blocks[..., g, k] & 0xF) * 2**(scales[..., g] - 127)` and
    `out[..., 32g + 2k + 1] = e2m1(blocks[..., g, k] >> 4) * 2**(scales[..., g] - 127)`.
    """
    codes = _byte_codes(blocks, name, (), "MXFP4 blocks (two e2m1 values per byte)")
    _need_ndim(codes, 2, name)
    if codes.shape[-1] != 16:
        raise QuantError(f"tensor {name!r}: shape {list(codes.shape)}: MXFP4 blocks end in 16 bytes (32 values), "
                         f"got {codes.shape[-1]}")
    scale_codes = _e8m0_codes(scales, scale_name)
    _check_shape(scale_codes, codes.shape[:-1], scale_name, f"one e8m0 scale per 32-value block of {name!r}")
    out = np.empty((*codes.shape[:-1][:-1], codes.shape[-2] * 32), out_dtype_of(out_dtype))
    _e2m1_rows(codes, scale_codes, out, name, scale_name)
    return out


def dequantize_fp4(weight, scale, *, group_size=32, out_dtype=np.float32, name="weight",
                   scale_name="scale") -> np.ndarray:
    """FP4 e2m1 with an e8m0 scale per `group_size` inputs (DeepSeek-V4 routed experts).

    Args:
      weight: `[..., R, C/2]` int8 / uint8 (stored I8): two e2m1 values per byte, element 2k of a row
        in the low nibble of byte k, element 2k+1 in the high nibble.
      scale: `[..., R, C/group_size]` float8_e8m0fnu (or raw uint8 codes).

    Returns `[..., R, C]` in `out_dtype`:
    `out[..., r, c] = e2m1(nibble c of row r) * 2**(scale[..., r, c // group_size] - 127)`.
    """
    codes = _byte_codes(weight, name, (), "packed FP4 (two e2m1 values per byte)")
    _need_ndim(codes, 2, name)
    if group_size <= 0 or group_size % 2:
        raise QuantError(f"group_size must be a positive even number, got {group_size!r}")
    *lead, rows, half = codes.shape
    per_group = group_size // 2
    if half % per_group:
        raise QuantError(f"tensor {name!r}: shape {list(codes.shape)}: {2 * half} values per row are not a whole "
                         f"number of {group_size}-value scale groups")
    groups = half // per_group
    scale_codes = _e8m0_codes(scale, scale_name)
    _check_shape(scale_codes, (*lead, rows, groups), scale_name,
                 f"one e8m0 scale per {group_size} values of each row of {name!r} {list(codes.shape)}")
    out = np.empty((*lead, rows, 2 * half), out_dtype_of(out_dtype))
    _e2m1_rows(codes.reshape(*lead, rows, groups, per_group), scale_codes, out, name, scale_name)
    return out


def dequantize_int_packed(packed, scale, *, columns, num_bits=4, group_size=None, out_dtype=np.float32,
                          name="weight_packed", scale_name="weight_scale") -> np.ndarray:
    """Symmetric INT4 / INT8 weights packed into int32 (compressed-tensors `pack-quantized`).

    Args:
      packed: `[..., R, ceil(C / (32/num_bits))]` int32 (`weight_packed`): value j of word w sits in
        bits num_bits*j .. num_bits*j + num_bits-1 (least significant first) and is row element
        w*(32/num_bits) + j, stored unsigned as q + 2**(num_bits-1); padding past C is dropped.
      scale: `[..., R, ceil(C / group_size)]` float32 / bfloat16 / float16 (`weight_scale`);
        group_size None means one scale per row (strategy "channel").
      columns: C, the logical row length (`weight_shape[1]`).

    Returns `[..., R, C]` in `out_dtype`: `out[..., r, c] = q[..., r, c] * scale[..., r, c // group_size]`
    with q in [-2**(num_bits-1), 2**(num_bits-1) - 1] (no zero point: symmetric schemes only).
    """
    words = np.asarray(packed)
    if words.dtype != np.int32:
        raise QuantError(f"tensor {name!r}: dtype {words.dtype}: packed weights are int32")
    _need_ndim(words, 2, name)
    if num_bits not in (4, 8):
        raise QuantError(f"num_bits must be 4 or 8, got {num_bits!r}")
    per_word = 32 // num_bits
    *lead, rows, width = words.shape
    if columns <= 0 or width != -(-columns // per_word):
        raise QuantError(f"tensor {name!r}: shape {list(words.shape)} does not hold rows of {columns} "
                         f"{num_bits}-bit values: expected {-(-columns // per_word)} int32 words per row")
    group = columns if group_size is None else group_size
    if group <= 0:
        raise QuantError(f"group_size must be positive, got {group_size!r}")
    scales = _scale_array(scale, scale_name, e8m0=False)
    _check_shape(scales, (*lead, rows, -(-columns // group)), scale_name,
                 f"one scale per {group} values of each row of {name!r} (rows of {columns})")
    shifts = np.arange(per_word, dtype=np.int32) * num_bits
    mask, offset = (1 << num_bits) - 1, 1 << (num_bits - 1)
    out = np.empty((*lead, rows, columns), out_dtype_of(out_dtype))
    count = math.prod(lead) * rows
    words2, scales2, out2 = (words.reshape(count, width), scales.reshape(count, scales.shape[-1]),
                             out.reshape(count, columns))
    for r0, r1 in _row_chunks(words2.shape[0], width * per_word):
        unsigned = (words2[r0:r1, :, None] >> shifts) & mask  # [n, width, per_word]
        values = unsigned.reshape(r1 - r0, width * per_word)[:, :columns].astype(np.float32)
        values -= offset
        row_scales = _decode_scale(scales2[r0:r1], scale_name, (r0, (*lead, rows)))
        values *= np.repeat(row_scales, group, axis=1)[:, :columns]
        _check_finite(values, name, (r0, (*lead, rows)))
        out2[r0:r1] = values
    return out


# -- helpers ------------------------------------------------------------------------------------


def _e2m1_rows(codes, scale_codes, out, name, scale_name):
    """out[..., G*2b] <- e2m1 codes[..., G, b] (low nibble first) * e8m0 scale_codes[..., G], by rows."""
    groups, nbytes = codes.shape[-2:]
    count = math.prod(codes.shape[:-2])
    codes3 = codes.reshape(count, groups, nbytes)
    scales2 = scale_codes.reshape(count, groups)
    out2 = out.reshape(count, groups * 2 * nbytes)
    for r0, r1 in _row_chunks(codes3.shape[0], groups * 2 * nbytes):
        chunk = codes3[r0:r1]
        values = np.empty((r1 - r0, groups, 2 * nbytes), np.float32)
        values[..., 0::2] = E2M1_VALUES[chunk & 0x0F]
        values[..., 1::2] = E2M1_VALUES[chunk >> 4]
        values *= _decode_e8m0(scales2[r0:r1], scale_name, (r0, scale_codes.shape[:-1]))[..., None]
        flat = values.reshape(r1 - r0, -1)
        _check_finite(flat, name, (r0, scale_codes.shape[:-1]))
        out2[r0:r1] = flat


def _row_chunks(rows: int, row_elements: int):
    """(start, stop) pairs covering range(rows) with ~CHUNK_ELEMENTS elements per chunk (at least a row)."""
    step = max(1, CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _byte_codes(array, name, typed, what) -> np.ndarray:
    """`array` as uint8 codes: one of the `typed` dtypes, or raw bytes (uint8 / int8)."""
    array = np.asarray(array)
    if array.dtype in typed or array.dtype in RAW_BYTES:
        return array.view(np.uint8)
    expected = " / ".join([dt.name for dt in typed] + ["raw bytes as uint8 / int8"])
    raise QuantError(f"tensor {name!r}: dtype {array.dtype} is not {what} (expected {expected})")


def _e8m0_codes(array, name) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype == E8M0 or array.dtype == np.uint8:
        return array.view(np.uint8)
    raise QuantError(f"tensor {name!r}: dtype {array.dtype} is not an e8m0 scale (expected float8_e8m0fnu or uint8)")


def _scale_array(array, name, *, e8m0: bool) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype in FLOAT_SCALE_DTYPES or (e8m0 and array.dtype in (E8M0, np.dtype(np.uint8))):
        return array
    expected = "float32 / bfloat16 / float16" + (" / float8_e8m0fnu / uint8 (e8m0)" if e8m0 else "")
    raise QuantError(f"tensor {name!r}: dtype {array.dtype} is not a scale (expected {expected})")


def _decode_scale(scales, name, at=(0, None)) -> np.ndarray:
    """float32 values of float or e8m0 `scales`, each checked; `at` places scales' first row (see `_where`)."""
    if scales.dtype == E8M0 or scales.dtype == np.uint8:
        return _decode_e8m0(scales.view(np.uint8), name, at)
    values = np.asarray(scales, np.float32)
    bad = ~(values >= 0) | ~np.isfinite(values)  # NaN fails `>= 0`
    if bad.any():
        index = np.unravel_index(int(np.argmax(bad)), values.shape)
        value = float(values[index])
        problem = "negative" if value < 0 else "not finite"
        raise QuantError(f"tensor {name!r}: scale {value} at index {_where(index, at)} is {problem}")
    return values


def _decode_e8m0(codes, name, at=(0, None)) -> np.ndarray:
    nan = codes == 0xFF
    if nan.any():
        index = np.unravel_index(int(np.argmax(nan)), codes.shape)
        raise QuantError(f"tensor {name!r}: e8m0 scale code 0xFF (NaN) at index {_where(index, at)}")
    return _E8M0_VALUES[codes]


def _check_finite(values, name, at):
    finite = np.isfinite(values)
    if not finite.all():
        index = np.unravel_index(int(np.argmin(finite)), values.shape)
        raise QuantError(f"tensor {name!r}: dequantised value at index {_where(index, at)} is not finite "
                         f"({values[index]}): a NaN code in the weight or an overflowing scale")


def _where(index, at) -> list[int]:
    """Index in the whole tensor of `index` into a chunk: at = (flat row of the chunk's first row, the
    tensor's row dims); index[0] counts rows of the chunk, index[1:] the trailing dims."""
    first_row, row_dims = at
    index = [int(i) for i in index]
    if row_dims is None or not index:
        return index
    return [int(i) for i in np.unravel_index(first_row + index[0], tuple(row_dims))] + index[1:]


def _check_shape(array, expected, name, meaning):
    if tuple(array.shape) != tuple(expected):
        raise QuantError(f"tensor {name!r}: shape {list(array.shape)}, expected {list(expected)} ({meaning})")


def _need_ndim(array, ndim, name):
    if array.ndim < ndim:
        raise QuantError(f"tensor {name!r}: shape {list(array.shape)}: expected at least {ndim} dimensions")


def _block_size(block_size) -> tuple[int, int]:
    try:
        bm, bn = (int(b) for b in block_size)
    except (TypeError, ValueError) as exc:
        raise QuantError(f"block_size must be two positive integers, got {block_size!r}") from exc
    if bm <= 0 or bn <= 0:
        raise QuantError(f"block_size must be two positive integers, got {block_size!r}")
    return bm, bn
