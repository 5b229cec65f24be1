"""Which stored tensors hold a dense weight, and the per-weight dequantisation a loader calls.

A loader asks for a dense weight by the name transformers' model gives it (`<m>.weight` for an
`nn.Linear`, the parameter name for fused experts such as `mlp.experts.gate_up_proj`) and hands
over a mapping of the checkpoint's stored tensors; `locate` finds the tensors that hold it by the
format's naming rules, and `dequantize` decodes them by their dtypes:

| stored | dtype | meaning | method |
|---|---|---|---|
| `n` | float32 / bfloat16 / float16 | dense, returned cast | any |
| `n` + `n_scale_inv` (`<m>.weight_scale_inv`) | e4m3 + float or e8m0 | block scales (per tensor: no block) | fp8 |
| `<m>.weight` + `<m>.scale` | e4m3 + e8m0 or float | block scales (DeepSeek-V4) | fp8 |
| `<m>.weight` + `<m>.scale` | int8 / uint8 + e8m0 | FP4 e2m1 experts, a scale per 32 | fp8, expert_dtype fp4 |
| `<m>.weight` + `<m>.qscale_weight` | e4m3 + float | per tensor or per row (Mistral) | fp8 |
| `<m>.weight` + `<m>.weight_scale` `[out, 1]` | e4m3 + float | per row | fbgemm_fp8 |
| `n` + `n_scale` (fused `[E, in, out]`) | e4m3 + float | per output channel (last axis) | fbgemm_fp8 |
| `n_blocks` + `n_scales` | uint8 + uint8 | MXFP4, returned `[E, R, C]` | mxfp4 |
| `<m>.weight_packed` + `_scale` (+ `_shape`) | int32 + float | packed int, a scale per group | compressed-tensors |

Activation scales (`<m>.input_scale`, `<m>.activation_scale`, `<m>.qscale_act`) are not needed to
serve dequantised weights; `companion_names` lists them with the other tensors a loader skips.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

import ml_dtypes
import numpy as np

from expertd.server.models.quant import codecs
from expertd.server.models.quant.codecs import QuantError
from expertd.server.models.quant.scheme import QuantScheme

# safetensors dtype strings -> numpy dtypes; safetensors' numpy backend cannot read the float8 ones
# (it looks for np.float8_*), so a loader memory-maps their bytes and views them with these.
SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "F8_E4M3": codecs.E4M3,
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": codecs.E8M0,
}
DENSE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float64))
_PACKED_PARTS = ("_scale", "_shape", "_zero_point", "_g_idx")
_ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".qscale_act")


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """The stored tensors of one dense weight: `data` (codes or values), its `scale`, and for
    compressed-tensors its `shape` tensor. layout: "plain" (data under the dense name, decoded by
    dtype), "mxfp4" (`_blocks` / `_scales`) or "packed" (`_packed` / `_scale` / `_shape`)."""

    name: str
    data: str
    scale: str | None = None
    shape: str | None = None
    layout: str = "plain"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.data, self.scale, self.shape) if n is not None)


def numpy_dtype(safetensors_dtype: str) -> np.dtype:
    """The numpy (ml_dtypes) dtype of a safetensors header dtype such as "F8_E4M3" or "BF16"."""
    try:
        return SAFETENSORS_DTYPES[safetensors_dtype]
    except KeyError:
        raise QuantError(f"safetensors dtype {safetensors_dtype!r} has no numpy equivalent here; known: "
                         f"{', '.join(SAFETENSORS_DTYPES)}") from None


def locate(name: str, available: Collection[str], scheme: QuantScheme | None) -> StoredWeight:
    """The stored tensors holding dense weight `name`, by the naming rules in the module docstring.

    `available` only needs `in`. QuantError if they are missing, ambiguous, or of a format the
    scheme (None: unquantised) does not declare.
    """
    method = scheme.method if scheme is not None else None
    candidates = []
    if name + "_blocks" in available:
        if name + "_scales" not in available:
            raise QuantError(f"tensor {name + '_blocks'!r} has no scales: {name + '_scales'!r} is missing")
        candidates.append(StoredWeight(name, name + "_blocks", name + "_scales", layout="mxfp4"))
    if name + "_packed" in available:
        if name + "_scale" not in available:
            raise QuantError(f"tensor {name + '_packed'!r} has no scale: {name + '_scale'!r} is missing")
        shape = name + "_shape" if name + "_shape" in available else None
        candidates.append(StoredWeight(name, name + "_packed", name + "_scale", shape, layout="packed"))
    if name in available:
        scales = [s for s in _scale_names(name, method) if s in available]
        if len(scales) > 1:
            raise QuantError(f"tensor {name!r} has several scale tensors {scales}; expected one")
        candidates.append(StoredWeight(name, name, scales[0] if scales else None))
    if not candidates:
        looked = [name, name + "_blocks", name + "_packed"]
        raise QuantError(f"tensor {name!r} is missing (looked for {', '.join(map(repr, looked))})")
    if len(candidates) > 1:
        raise QuantError(f"tensor {name!r} is stored several ways: {[c.data for c in candidates]}")
    found = candidates[0]
    needs = {"mxfp4": "mxfp4", "packed": "compressed-tensors"}.get(found.layout)
    if needs is not None and method != needs:
        declared = f"declares {method!r}" if method else "declares no quantization_config"
        raise QuantError(f"tensor {found.data!r} is {needs} data but config.json {declared}")
    return found


def fp8_blocks(name: str, tensors: Mapping[str, np.ndarray], scheme: QuantScheme | None):
    """(codes float8_e4m3fn, scales float32, block) of weight `name` where it is stored as FP8 with
    square block scales of a power-of-two size (`codecs.fp8_block_codes`: the stored codes and
    scales as they are, shapes as stored), else None (the weight is dense, or quantised otherwise:
    `dequantize` it). QuantError for a malformed one."""
    if scheme is None or scheme.method != "fp8" or scheme.block_size is None or scheme.expert_dtype == "fp4":
        return None
    block = scheme.block_size[0]
    if scheme.block_size[1] != block or block < 16 or block & (block - 1):
        return None
    found = locate(name, tensors, scheme)
    if found.layout != "plain" or found.scale is None or found.scale.endswith(".qscale_weight"):
        return None
    data = tensors[found.data]
    if np.asarray(data).dtype != codecs.E4M3:
        return None
    codes, scales = codecs.fp8_block_codes(data, tensors[found.scale], scheme.block_size, name=name,
                                           scale_name=found.scale)
    return codes, scales, block


def dequantize(name: str, tensors: Mapping[str, np.ndarray], scheme: QuantScheme | None,
               out_dtype="bfloat16") -> np.ndarray:
    """Dense weight `name` in `out_dtype` (float32 / bfloat16) from the stored `tensors`.

    `tensors` maps stored names to arrays or memory maps (it only needs `in` and `[]`, so a lazy
    mapping over safetensors files works); float8 tensors must arrive as ml_dtypes dtypes (see
    `numpy_dtype`), int8 / uint8 ones as stored. Shapes are as stored: `[out, in]` for a Linear,
    `[E, R, C]` from MXFP4 (gpt-oss's `[E, 2I, H]` / `[E, H, I]`, which transformers holds
    transposed), `[E, in, out]` for Llama 4 fused experts. A dense tensor already in `out_dtype` is
    returned as stored (it may be a view of the memory map). QuantError names the tensor.
    """
    out = codecs.out_dtype_of(out_dtype)
    found = locate(name, tensors, scheme)
    if found.layout == "mxfp4":
        return codecs.dequantize_mxfp4(tensors[found.data], tensors[found.scale], out_dtype=out,
                                       name=found.data, scale_name=found.scale)
    if found.layout == "packed":
        return _dequantize_packed(found, tensors, scheme, out)
    data = np.asarray(tensors[found.data])
    if data.dtype in DENSE_DTYPES:
        if found.scale is not None:
            raise QuantError(f"tensor {name!r} is stored as {data.dtype} yet has a scale tensor {found.scale!r}")
        return data.astype(out, copy=False)
    if data.dtype not in codecs.RAW_BYTES + (codecs.E4M3,):
        raise QuantError(f"tensor {name!r}: dtype {data.dtype} is not supported (dense float, float8 e4m3, "
                         "or packed FP4 bytes)")
    if scheme is None:
        raise QuantError(f"tensor {name!r} is stored as {data.dtype} but config.json declares no "
                         "quantization_config")
    if found.scale is None:
        looked = ", ".join(repr(s) for s in _scale_names(name, scheme.method)) or "none for this method"
        raise QuantError(f"tensor {name!r} ({data.dtype}, {scheme.method}) has no scale tensor (looked for {looked})")
    scale = tensors[found.scale]
    names = {"name": name, "scale_name": found.scale, "out_dtype": out}
    if data.dtype in codecs.RAW_BYTES:
        if scheme.expert_dtype != "fp4":
            raise QuantError(f"tensor {name!r} is stored as {data.dtype} (packed FP4) but config.json declares no "
                             "expert_dtype 'fp4'")
        return codecs.dequantize_fp4(data, scale, group_size=scheme.group_size, **names)
    if scheme.method == "fp8":
        if scheme.block_size is None or found.scale.endswith(".qscale_weight"):
            return codecs.dequantize_fp8_per_channel(data, scale, channel_axis=-2, **names)
        return codecs.dequantize_fp8_block(data, scale, scheme.block_size, **names)
    if scheme.method == "fbgemm_fp8":
        axis = -2 if name.endswith(".weight") else -1  # nn.Linear [out, in] / fused experts [E, in, out]
        return codecs.dequantize_fp8_per_channel(data, scale, channel_axis=axis, **names)
    raise QuantError(f"tensor {name!r} is float8 e4m3 but config.json declares {scheme.method!r}")


def companion_names(names: Iterable[str], scheme: QuantScheme | None) -> frozenset[str]:
    """The stored names that are not dense weights themselves: scales, packed codes and their parts,
    activation scales. A loader enumerating a checkpoint skips these (see `dense_names`)."""
    names = set(names)
    method = scheme.method if scheme is not None else None
    skip = set()
    for name in names:
        if name.endswith("_blocks") and name[:-7] + "_scales" in names:
            skip |= {name, name[:-7] + "_scales"}
        elif name.endswith("_packed") and name[:-7] + "_scale" in names:
            skip |= {name} | {name[:-7] + part for part in _PACKED_PARTS if name[:-7] + part in names}
        else:
            skip |= {s for s in _scale_names(name, method) + _activation_names(name, method) if s in names}
    return frozenset(skip)


def dense_names(names: Iterable[str], scheme: QuantScheme | None) -> list[str]:
    """The dense weights a checkpoint holds, in stored order: `n_blocks` and `<m>.weight_packed` give
    `n` and `<m>.weight`, companions drop out, everything else is itself."""
    names = list(names)
    skip = companion_names(names, scheme)
    dense = []
    for name in names:
        if name.endswith("_blocks") and name in skip:
            dense.append(name[:-7])
        elif name.endswith("_packed") and name in skip:
            dense.append(name[:-7])
        elif name not in skip:
            dense.append(name)
    return dense


def _scale_names(name: str, method: str | None) -> list[str]:
    """Candidate scale tensors of `name` stored plain (data under its own name), by method."""
    module = name[:-len(".weight")] if name.endswith(".weight") else None
    if method == "fp8":
        return [name + "_scale_inv"] + ([module + ".scale", module + ".qscale_weight"] if module else [])
    if method == "fbgemm_fp8":
        return [name + "_scale"]
    return []


def _activation_names(name: str, method: str | None) -> list[str]:
    if method not in ("fp8", "fbgemm_fp8"):
        return []
    if name.endswith(".weight"):
        return [name[:-len(".weight")] + suffix for suffix in _ACTIVATION_SCALES]
    return [name + "_input_scale", name + "_activation_scale"]


def _dequantize_packed(found: StoredWeight, tensors, scheme: QuantScheme, out) -> np.ndarray:
    for part in ("_zero_point", "_g_idx"):
        if found.name + part in tensors:
            raise QuantError(f"tensor {found.name + part!r}: asymmetric or activation-ordered packed weights "
                             "are not supported")
    packed = np.asarray(tensors[found.data])
    columns = packed.shape[-1] * (32 // scheme.num_bits) if packed.ndim else 0
    if found.shape is not None:
        shape = np.asarray(tensors[found.shape])
        if (shape.ndim != 1 or shape.dtype.kind not in "iu" or len(shape) != packed.ndim
                or tuple(int(s) for s in shape[:-1]) != packed.shape[:-1]):
            raise QuantError(f"tensor {found.shape!r}: {shape.tolist()} is not the dense shape of "
                             f"{found.data!r} {list(packed.shape)}")
        columns = int(shape[-1])
    return codecs.dequantize_int_packed(packed, tensors[found.scale], columns=columns, num_bits=scheme.num_bits,
                                        group_size=scheme.group_size, out_dtype=out, name=found.data,
                                        scale_name=found.scale)
