"""Simple quantisers of the official weight formats and a plain safetensors writer, for test fixtures.

Each quantiser takes a float32 weight as transformers holds it (`[..., out, in]` unless said) and
returns (stored tensors by suffix, the dequantised float32 weight the loader must reproduce). They
are written from the formats' definitions, independently of `expertd.server.models.quant`:

- fp8_block(w, (bm, bn), ue8m0): e4m3 codes + one scale per bm x bn block (edge blocks partial),
  float32 `weight_scale_inv` or a power-of-two e8m0 scale; dequantised = code * scale in float32.
- fp8_per_tensor(w): e4m3 codes + one float32 scale (Mistral's `qscale_weight`).
- fp4(w, group): e2m1 codes two per byte (element 2k low nibble) + an e8m0 scale per `group` inputs.
- int_packed(w, group): symmetric int4 in int32 words (value j of a word at bits 4j..4j+3, stored
  as q + 8) + a bfloat16 scale per `group` inputs + the dense shape (compressed-tensors).
- mxfp4(w): `[..., out, in]` -> blocks `[..., out, in/32, 16]` uint8 + e8m0 scales `[..., out, in/32]`.

`save_safetensors(path, tensors)` writes the format byte by byte (8-byte header length, JSON
header, data), so float8 / e8m0 tensors get their own dtype strings.
"""
from __future__ import annotations

import json
import math
import struct

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_NAMES = {np.dtype(np.float32): "F32", BF16: "BF16", np.dtype(np.float16): "F16", E4M3: "F8_E4M3", E8M0: "F8_E8M0",
          np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def save_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _NAMES[np.dtype(array.dtype)], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for chunk in chunks:
            f.write(chunk)


def _pow2_scale(amax, top):
    """Power-of-two scales >= amax / top (e8m0 codes and float values)."""
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / top)).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    return (exponent + 127).astype(np.uint8), np.exp2(exponent).astype(np.float32)


def fp8_block(w: np.ndarray, block=(128, 128), ue8m0: bool = False):
    """({"": e4m3 codes, "scale": scale}, dequantised)."""
    bm, bn = block
    *lead, rows, cols = w.shape
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = np.zeros((*lead, gr * bm, gc * bn), np.float32)
    padded[..., :rows, :cols] = w
    amax = np.abs(padded.reshape(*lead, gr, bm, gc, bn)).max(axis=(-3, -1))
    if ue8m0:
        codes, scale = _pow2_scale(amax, 448.0)
        stored_scale = codes.view(E8M0)
    else:
        scale = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
        stored_scale = scale
    full = np.repeat(np.repeat(scale, bm, axis=-2), bn, axis=-1)[..., :rows, :cols]
    q = (w / full).astype(E4M3)
    return {"": q, "scale": stored_scale}, q.astype(np.float32) * full


def fp8_per_tensor(w: np.ndarray):
    scale = np.array([max(float(np.abs(w).max()) / 448.0, 1e-12)], np.float32)
    q = (w / scale[0]).astype(E4M3)
    return {"": q, "scale": scale}, q.astype(np.float32) * scale[0]


def fp4(w: np.ndarray, group: int = 32):
    *lead, rows, cols = w.shape
    groups = w.reshape(*lead, rows, cols // group, group)
    codes, scale = _pow2_scale(np.abs(groups).max(axis=-1), 6.0)
    scaled = groups / scale[..., None]
    nearest = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)  # [.., g, group]
    deq = (E2M1[nearest] * scale[..., None]).reshape(w.shape)
    nibbles = nearest.reshape(*lead, rows, cols)
    packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    return {"": packed, "scale": codes.view(E8M0)}, deq.astype(np.float32)


def int_packed(w: np.ndarray, group: int = 32):
    rows, cols = w.shape
    scale = (np.abs(w.reshape(rows, -1, group)).max(axis=-1) / 7.0).astype(BF16)
    s = np.maximum(scale.astype(np.float32), 1e-6)
    q = np.clip(np.round(w / np.repeat(s, group, axis=1)), -8, 7).astype(np.int64)
    words = np.zeros((rows, math.ceil(cols / 8)), np.int64)
    for c in range(cols):
        words[:, c // 8] |= (q[:, c] + 8) << (4 * (c % 8))
    deq = (q * np.repeat(scale.astype(np.float32), group, axis=1)).astype(np.float32)
    return {"packed": words.astype(np.uint32).view(np.int32), "scale": scale,
            "shape": np.array([rows, cols], np.int32)}, deq


def mxfp4(w: np.ndarray):
    *lead, rows, cols = w.shape
    groups = w.reshape(*lead, rows, cols // 32, 32)
    codes, scale = _pow2_scale(np.abs(groups).max(axis=-1), 6.0)
    nearest = np.abs((groups / scale[..., None])[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    deq = (E2M1[nearest] * scale[..., None]).reshape(w.shape).astype(np.float32)
    blocks = (nearest[..., 0::2] | (nearest[..., 1::2] << 4)).astype(np.uint8)  # [.., out, in/32, 16]
    return {"blocks": blocks, "scales": codes}, deq
