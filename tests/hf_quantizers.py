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

`Quantizer(quantize, ...)` stores a fixture layer's weights in one of the formats `QUANTIZE` names
(with the companion tensors' official names) and `quantization_config(quantize, ...)` is the
matching config.json entry. `save_safetensors(path, tensors)` writes the format byte by byte
(8-byte header length, JSON header, data), so float8 / e8m0 tensors get their own dtype strings.
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
QUANTIZE = (None, "fp8", "fp8_ue8m0", "fp8_qscale", "fp4", "int4", "mxfp4")
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


def quantization_config(quantize, block, group) -> dict:
    if quantize in ("fp8", "fp8_ue8m0"):
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), **({"scale_fmt": "ue8m0"} if quantize == "fp8_ue8m0" else {}),
                "modules_to_not_convert": ["lm_head", "model.layers.*.mlp.gate"]}
    if quantize == "fp8_qscale":
        return {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "static"}
    if quantize == "fp4":
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "scale_fmt": "ue8m0",
                "expert_dtype": "fp4"}
    if quantize == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router", "lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                "dynamic": False, "actorder": None}}}, "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_experts.*"]}


class Quantizer:
    """Stores one layer's weights in the requested format; returns the dequantised float32 weight."""

    def __init__(self, quantize, block, group, tensors):
        self.quantize, self.block, self.group, self.tensors = quantize, block, group, tensors

    def weight(self, name: str, w: np.ndarray, *, shared: bool = False, transposed: bool = False) -> np.ndarray:
        """Store `w` (`[.., out, in]`) under `name`; `transposed`: transformers holds `[.., in, out]`
        (the stored dense weight and the result are transposed, MXFP4 blocks are not)."""
        q, module = self.quantize, name[:-len(".weight")] if name.endswith(".weight") else None
        if q is None or (q in ("int4", "mxfp4") and shared):
            self.tensors[name] = np.swapaxes(w, -1, -2) if transposed else w
            return self.tensors[name].astype(np.float32)
        f32 = w.astype(np.float32)
        if q == "fp8_qscale" or (q == "fp4" and shared):
            parts, deq = fp8_per_tensor(f32) if q == "fp8_qscale" else fp8_block(f32, self.block, ue8m0=True)
            suffix = ".qscale_weight" if q == "fp8_qscale" else ".scale"
            self.tensors.update({name: parts[""], module + suffix: parts["scale"]})
            if q == "fp8_qscale":
                self.tensors[module + ".qscale_act"] = np.ones(1, np.float32)
        elif q in ("fp8", "fp8_ue8m0"):
            parts, deq = fp8_block(f32, self.block, ue8m0=q == "fp8_ue8m0")
            # ue8m0 (DeepSeek-V3.1 style): power-of-two scales, stored as float32 weight_scale_inv
            self.tensors.update({name: parts[""], name + "_scale_inv": parts["scale"].astype(np.float32)})
        elif q == "fp4":
            parts, deq = fp4(f32, 32)
            self.tensors.update({name: parts[""], module + ".scale": parts["scale"]})
        elif q == "int4":
            parts, deq = int_packed(f32, self.group)
            self.tensors.update({name + "_packed": parts["packed"], name + "_scale": parts["scale"],
                                 name + "_shape": parts["shape"]})
        else:  # mxfp4: blocks of the [.., out, in] weight
            parts, deq = mxfp4(f32)
            self.tensors.update({name + "_blocks": parts["blocks"], name + "_scales": parts["scales"]})
        return np.swapaxes(deq, -1, -2) if transposed else deq
