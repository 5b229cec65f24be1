"""expertd.server.models.quant: each dequantiser against a plain numpy reference written here (loops
over blocks and elements, ml_dtypes / literal tables for the codes), round trips through simple
quantisers, the official quantization_configs, the naming rules, and the refusals."""
import dataclasses
import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest

from expertd.server.models import quant
from expertd.server.models.quant import QuantError, QuantScheme, codecs, fp8_tables

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_DTYPES = [np.dtype(np.float32), BF16]
# e2m1 by the OCP MX spec: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

FP8_BLOCK = QuantScheme("fp8", block_size=(128, 128))
FP8_UE8M0 = QuantScheme("fp8", block_size=(128, 128), scale_fmt="ue8m0")
DSV4 = QuantScheme("fp8", block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4", group_size=32)
MISTRAL = QuantScheme("fp8", block_size=None)
FBGEMM = QuantScheme("fbgemm_fp8")
MXFP4 = QuantScheme("mxfp4", group_size=32)
KIMI = QuantScheme("compressed-tensors", group_size=32, num_bits=4)


@pytest.fixture(params=["small-chunks", "default-chunks"])
def chunks(request, monkeypatch):
    """Run a test with chunks of ~1000 elements (many chunks, partial last ones) and with the default."""
    if request.param == "small-chunks":
        monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 1000)
        monkeypatch.setattr(fp8_tables, "CHUNK_ELEMENTS", 1000)


def random_e4m3(rng, shape):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x7F, 0xFF); 0x38 is 1.0
    return codes.view(E4M3)


def expect(got, ref_f32, dtype):
    """got (in dtype) equals the float32 reference rounded once to dtype."""
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float32), ref_f32.astype(dtype).astype(np.float32))


# -- plain references ------------------------------------------------------------------------------


def ref_fp8_block(weight, scale, bm, bn):
    w = weight.astype(np.float32)
    s = scale.astype(np.float32)
    out = np.zeros(w.shape, np.float32)
    for lead in np.ndindex(w.shape[:-2]):
        for i in range(s.shape[-2]):
            for j in range(s.shape[-1]):
                rows, cols = slice(i * bm, i * bm + bm), slice(j * bn, j * bn + bn)
                out[lead][rows, cols] = w[lead][rows, cols] * s[lead][i, j]
    return out


def ref_e2m1(codes, scale_codes, group):
    """codes [..., R, n] bytes (low nibble first), scale_codes [..., R, 2n / group] e8m0 -> [..., R, 2n]."""
    codes = np.asarray(codes).view(np.uint8)
    scale_codes = np.asarray(scale_codes).view(np.uint8)
    out = np.zeros((*codes.shape[:-1], 2 * codes.shape[-1]), np.float32)
    for index in np.ndindex(codes.shape):
        *row, k = index
        byte = int(codes[index])
        for element, nibble in ((2 * k, byte & 0xF), (2 * k + 1, byte >> 4)):
            exponent = int(scale_codes[(*row, element // group)]) - 127
            out[(*row, element)] = E2M1[nibble] * 2.0 ** exponent
    return out


def ref_int_packed(packed, scale, columns, bits, group):
    """compressed-tensors' unpack_from_int32, element by element, times the group's scale."""
    per_word = 32 // bits
    s = scale.astype(np.float32)
    out = np.zeros((packed.shape[0], columns), np.float32)
    for r in range(packed.shape[0]):
        for c in range(columns):
            word = int(packed[r, c // per_word]) & 0xFFFFFFFF
            unsigned = (word >> (bits * (c % per_word))) & ((1 << bits) - 1)
            out[r, c] = (unsigned - (1 << (bits - 1))) * s[r, c // group]
    return out


def pack_int32(q, bits):
    """compressed-tensors' pack_to_int32 (packed_dim 1), element by element: q [R, C] signed ints."""
    per_word = 32 // bits
    rows, cols = q.shape
    packed = np.zeros((rows, -(-cols // per_word)), np.int64)
    for r in range(rows):
        for c in range(cols):
            packed[r, c // per_word] |= (int(q[r, c]) + (1 << (bits - 1))) << (bits * (c % per_word))
    return packed.astype(np.uint32).view(np.int32)


# -- FP8 block scales --------------------------------------------------------------------------------

FP8_SHAPES = [((192, 200), (128, 128)), ((128, 256), (128, 128)), ((1, 1), (128, 128)), ((300, 129), (128, 128)),
              ((3, 130, 257), (128, 128)), ((192, 200), (64, 32))]


class _WithoutNativeLibrary:
    """`kernels.cpu` as fp8_tables sees it on a machine without the native library."""

    @staticmethod
    def block_lookup(*args) -> bool:
        return False


@pytest.fixture(params=["block-tables", "numpy-tables", "per-chunk"])
def fp8_path(request, monkeypatch):
    """Run a test through each FP8 block path: per-block look-up tables (blocks of 1024 elements or
    more) by the native library and by numpy, and the per-chunk multiply (forced by raising the
    tables' threshold)."""
    if request.param == "numpy-tables":
        monkeypatch.setattr(fp8_tables, "cpu", _WithoutNativeLibrary)
    if request.param == "per-chunk":
        monkeypatch.setattr(fp8_tables, "MIN_BLOCK_ELEMENTS", 1 << 40)


@pytest.mark.parametrize("shape,block", FP8_SHAPES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("scale_kind", ["float32", "bfloat16", "e8m0", "e8m0-raw"])
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_fp8_block_matches_plain_reference(shape, block, scale_kind, dtype, chunks, fp8_path):
    rng = np.random.default_rng(0)
    weight = random_e4m3(rng, shape)
    scale_shape = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    if scale_kind.startswith("e8m0"):
        scale = rng.integers(110, 140, scale_shape, dtype=np.uint8)
        scale = scale if scale_kind == "e8m0-raw" else scale.view(E8M0)
        reference = ref_fp8_block(weight, scale.view(E8M0), *block)
    else:
        scale = rng.uniform(1e-3, 2.0, scale_shape).astype(scale_kind)
        reference = ref_fp8_block(weight, scale, *block)
    expect(quant.dequantize_fp8_block(weight, scale, block, out_dtype=dtype), reference, dtype)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
@pytest.mark.parametrize("at", [0, 1, 7, 8, 8 * fp8_tables.NAN_SCAN_WORDS + 3, -1])
def test_a_nan_code_anywhere_is_refused_by_either_path(code, at, fp8_path):
    """The tables' NaN scan reads eight codes at a time (and in chunks): every byte lane and chunk
    edge is seen; the error names the index."""
    codes = np.full((8 * fp8_tables.NAN_SCAN_WORDS + 512), 0x38, np.uint8).reshape(-1, 256)  # 1.0 everywhere
    flat = codes.reshape(-1)
    flat[at] = code
    row, col = np.unravel_index(at % flat.size, codes.shape)
    scale = np.ones((-(-codes.shape[0] // 128), 2), np.float32)
    with pytest.raises(quant.QuantError, match=rf"index \[{row}, {col}\] is not finite"):
        quant.dequantize_fp8_block(codes.view(E4M3), scale)


def test_a_scale_that_overflows_only_unused_codes_is_served():
    """A block whose scale would overflow large codes, holding only small ones: every value finite."""
    codes = np.full((128, 128), 0x38, np.uint8)  # 1.0
    scale = np.array([[1e37]], np.float32)  # 448 * 1e37 overflows float32
    out = quant.dequantize_fp8_block(codes.view(E4M3), scale)
    assert np.all(out == np.float32(1e37))


def test_fp8_block_edge_blocks_are_counted_by_ceiling():
    """192 rows of 128-blocks are 128 + 64 rows (DeepSeek), not 96 + 96 (transformers' dim / grid)."""
    weight = np.full((192, 200), 1.0, np.float32).astype(E4M3)
    scale = np.array([[1.0, 3.0], [2.0, 4.0]], np.float32)
    out = quant.dequantize_fp8_block(weight, scale)
    assert out[100, 0] == 1.0 and out[127, 127] == 1.0 and out[128, 0] == 2.0 and out[191, 199] == 4.0
    assert out[100, 128] == 3.0 and out[150, 150] == 4.0


def test_fp8_block_round_trip_within_e4m3_resolution():
    """Quantise as DeepSeek's weight_quant does (block amax / 448), dequantise: within half an e4m3 step."""
    rng = np.random.default_rng(1)
    x = rng.normal(0, 0.05, (300, 200)).astype(np.float32)
    scale = np.zeros((3, 2), np.float32)
    codes = np.zeros(x.shape, E4M3)
    for i in range(3):
        for j in range(2):
            block = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = np.abs(block).max() / 448.0
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(E4M3)
    back = quant.dequantize_fp8_block(codes, scale)
    per_element_scale = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:300, :200]
    # e4m3: 3 mantissa bits (half step 2**-4 relative); subnormal step 2**-9
    assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * per_element_scale + 1e-12)


# -- FP8 per channel (fbgemm, Mistral) ---------------------------------------------------------------


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1), (70,), (70, 1)], ids=str)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_fp8_per_row_and_per_tensor(scale_shape, dtype, chunks):
    rng = np.random.default_rng(2)
    weight = random_e4m3(rng, (70, 50))
    scale = rng.uniform(0.01, 2.0, scale_shape).astype(np.float32)
    per_row = np.broadcast_to(scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(1, 1), (70, 1))
    reference = np.zeros((70, 50), np.float32)
    for r in range(70):
        reference[r] = weight[r].astype(np.float32) * per_row[r, 0]
    expect(quant.dequantize_fp8_per_channel(weight, scale, out_dtype=dtype), reference, dtype)


@pytest.mark.parametrize("inner,outer", [(12, 20), (16, 16)], ids=["I!=H", "I==H"])
@pytest.mark.parametrize("stored_as", ["E1O", "EO1"], ids=["gate_up_proj_scale[E,1,O]", "down_proj_scale[E,O,1]"])
def test_fbgemm_fused_experts_scale_the_last_axis(inner, outer, stored_as, chunks):
    """Llama 4 fused experts [E, in, out]: both scale layouts scale output channel o (the last axis),
    also when in == out, where broadcasting [E, O, 1] as stored would scale rows instead."""
    rng = np.random.default_rng(3)
    experts = 3
    weight = random_e4m3(rng, (experts, inner, outer))
    per_channel = rng.uniform(0.1, 2.0, (experts, outer)).astype(np.float32)
    scale = per_channel[:, None, :] if stored_as == "E1O" else per_channel[:, :, None]
    reference = np.zeros(weight.shape, np.float32)
    for e in range(experts):
        for o in range(outer):
            reference[e, :, o] = weight[e, :, o].astype(np.float32) * per_channel[e, o]
    name = "language_model.model.layers.1.feed_forward.experts.down_proj"
    got = quant.dequantize(name, {name: weight, name + "_scale": scale}, FBGEMM, "float32")
    expect(got, reference, np.dtype(np.float32))


def test_fbgemm_linear_and_mistral_qscale_by_name():
    rng = np.random.default_rng(4)
    weight = random_e4m3(rng, (8, 6))
    row_scale = rng.uniform(0.1, 1.0, (8, 1)).astype(np.float32)
    linear = "model.layers.0.feed_forward.shared_expert.up_proj.weight"
    got = quant.dequantize(linear, {linear: weight, linear + "_scale": row_scale}, FBGEMM, "float32")
    expect(got, weight.astype(np.float32) * row_scale, np.dtype(np.float32))
    mistral = "layers.2.experts.5.w1.weight"
    tensors = {mistral: weight, "layers.2.experts.5.w1.qscale_weight": np.array(0.25, np.float32),
               "layers.2.experts.5.w1.qscale_act": np.array(1.0, np.float32)}
    got = quant.dequantize(mistral, tensors, MISTRAL, "bfloat16")
    expect(got, weight.astype(np.float32) * 0.25, BF16)


# -- MXFP4 (gpt-oss) and FP4 experts (DeepSeek-V4) ------------------------------------------------------


def test_e2m1_table_is_the_ocp_one():
    np.testing.assert_array_equal(codecs.E2M1_VALUES, np.array(E2M1, np.float32))
    np.testing.assert_array_equal(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32),
                                  np.array(E2M1, np.float32))


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_mxfp4_matches_plain_reference(dtype, chunks):
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (2, 5, 3, 16), dtype=np.uint8)
    scales = rng.integers(115, 135, (2, 5, 3), dtype=np.uint8)
    reference = ref_e2m1(blocks.reshape(2, 5, 48), scales, 32)
    expect(quant.dequantize_mxfp4(blocks, scales, out_dtype=dtype), reference, dtype)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = {name + "_blocks": blocks, name + "_scales": scales.view(E8M0),
               name + "_bias": np.zeros((2, 5), BF16)}
    expect(quant.dequantize(name, tensors, MXFP4, dtype), reference, dtype)


def test_mxfp4_round_trip_of_representable_values():
    """Values e2m1 * 2**k packed by element index (even element in the low nibble) come back exactly."""
    rng = np.random.default_rng(6)
    nibbles = rng.integers(0, 16, (4, 64))
    exponents = rng.integers(-6, 6, (4, 2))
    dense = np.array(E2M1, np.float32)[nibbles] * 2.0 ** np.repeat(exponents, 32, axis=1)
    blocks = np.zeros((4, 2, 16), np.uint8)
    for r in range(4):
        for c in range(64):
            blocks[r, c // 32, (c % 32) // 2] |= nibbles[r, c] << (4 * (c % 2))
    got = quant.dequantize_mxfp4(blocks, (exponents + 127).astype(np.uint8))
    np.testing.assert_array_equal(got.reshape(4, 64), dense)


@pytest.mark.parametrize("shape", [(6, 96), (2, 3, 64)], ids=str)
@pytest.mark.parametrize("stored", ["int8", "uint8"])
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_fp4_experts_match_plain_reference(shape, stored, dtype, chunks):
    rng = np.random.default_rng(7)
    *lead, rows, cols = shape
    packed = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=np.uint8).view(stored)
    scale = rng.integers(118, 134, (*lead, rows, cols // 32), dtype=np.uint8).view(E8M0)
    reference = ref_e2m1(packed, scale, 32)
    expect(quant.dequantize_fp4(packed, scale, out_dtype=dtype), reference, dtype)


def test_deepseek_v4_layer_by_name():
    """Routed experts: I8 FP4 + e8m0 `.scale` per 32; other weights: e4m3 + e8m0 `.scale` per 128x128."""
    rng = np.random.default_rng(8)
    expert = "layers.5.ffn.experts.3.w1.weight"
    packed = rng.integers(-128, 128, (64, 80), dtype=np.int8)
    expert_scale = rng.integers(120, 130, (64, 5), dtype=np.uint8).view(E8M0)
    shared = "layers.5.ffn.shared_experts.w2.weight"
    weight = random_e4m3(rng, (200, 130))
    block_scale = rng.integers(120, 130, (2, 2), dtype=np.uint8).view(E8M0)
    tensors = {expert: packed, "layers.5.ffn.experts.3.w1.scale": expert_scale,
               shared: weight, "layers.5.ffn.shared_experts.w2.scale": block_scale,
               "layers.5.ffn.gate.bias": np.zeros(8, np.float32)}
    expect(quant.dequantize(expert, tensors, DSV4, "float32"), ref_e2m1(packed, expert_scale, 32),
           np.dtype(np.float32))
    expect(quant.dequantize(shared, tensors, DSV4, "bfloat16"), ref_fp8_block(weight, block_scale, 128, 128), BF16)
    assert quant.dequantize("layers.5.ffn.gate.bias", tensors, DSV4, "float32") is tensors["layers.5.ffn.gate.bias"]


# -- INT4 / INT8 compressed-tensors pack-quantized (Kimi K2.5) ------------------------------------------


@pytest.mark.parametrize("bits,group,columns", [(4, 32, 96), (4, 4, 100), (8, 16, 48), (4, None, 40)],
                         ids=["int4-g32", "int4-g4-padded", "int8-g16", "int4-channel"])
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
def test_int_packed_matches_plain_reference(bits, group, columns, dtype, chunks):
    rng = np.random.default_rng(9)
    rows = 7
    packed = rng.integers(-2 ** 31, 2 ** 31, (rows, -(-columns // (32 // bits))), dtype=np.int64).astype(np.int32)
    scale = rng.uniform(0.001, 0.1, (rows, -(-columns // (group or columns)))).astype(BF16)
    reference = ref_int_packed(packed, scale, columns, bits, group or columns)
    got = quant.dequantize_int_packed(packed, scale, columns=columns, num_bits=bits, group_size=group,
                                      out_dtype=dtype)
    expect(got, reference, dtype)


def test_int4_round_trip_through_compressed_tensors_packing():
    """Symmetric int4 per 32 inputs, packed as compressed-tensors packs, read back by name (Kimi)."""
    rng = np.random.default_rng(10)
    x = rng.normal(0, 0.02, (5, 100)).astype(np.float32)
    groups = x.reshape(5, -1, 4)  # group_size 4 keeps the padded last word (100 = 12 words + 4 nibbles)
    scale = (np.abs(groups).max(axis=-1) / 7.0).astype(BF16)
    q = np.clip(np.round(groups / scale.astype(np.float32)[..., None]), -8, 7).astype(np.int8).reshape(5, 100)
    name = "language_model.model.layers.1.mlp.experts.9.down_proj.weight"
    tensors = {name + "_packed": pack_int32(q, 4), name + "_scale": scale,
               name + "_shape": np.array([5, 100], np.int64)}
    got = quant.dequantize(name, tensors, QuantScheme("compressed-tensors", group_size=4, num_bits=4), "float32")
    exact = q.astype(np.float32) * np.repeat(scale.astype(np.float32), 4, axis=1)
    np.testing.assert_array_equal(got, exact)
    assert np.all(np.abs(got - x) <= np.repeat(scale.astype(np.float32), 4, axis=1) / 2 + 1e-6)


# -- memory maps and safetensors files ---------------------------------------------------------------------


def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]):
    """A safetensors file: name -> (header dtype, array); raw little-endian bytes."""
    header, offset, payload = {}, 0, []
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        payload.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(payload))


def memory_map_safetensors(path) -> dict[str, np.memmap]:
    """Every tensor of a safetensors file as a read-only memory map, float8 ones included."""
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + length])
    return {name: np.memmap(path, dtype=quant.numpy_dtype(info["dtype"]), mode="r",
                            offset=8 + length + info["data_offsets"][0], shape=tuple(info["shape"]))
            for name, info in header.items() if name != "__metadata__"}


def test_dequantize_reads_memory_mapped_safetensors(tmp_path, chunks):
    rng = np.random.default_rng(11)
    name = "model.layers.3.mlp.experts.0.gate_proj.weight"
    weight = random_e4m3(rng, (192, 200))
    scale = rng.uniform(0.5, 2.0, (2, 2)).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", {name: ("F8_E4M3", weight),
                                                       name + "_scale_inv": ("F32", scale)})
    mapped = memory_map_safetensors(tmp_path / "model.safetensors")
    assert isinstance(mapped[name], np.memmap) and mapped[name].dtype == E4M3
    got = quant.dequantize(name, mapped, FP8_BLOCK, "bfloat16")
    expect(got, ref_fp8_block(weight, scale, 128, 128), BF16)


def test_numpy_dtype_of_safetensors_names():
    assert quant.numpy_dtype("F8_E4M3") == E4M3 and quant.numpy_dtype("F8_E8M0") == E8M0
    assert quant.numpy_dtype("BF16") == BF16 and quant.numpy_dtype("I8") == np.int8
    with pytest.raises(QuantError, match="'F4'"):
        quant.numpy_dtype("F4")


# -- refusals that name the tensor -------------------------------------------------------------------------

W = "model.layers.3.mlp.experts.0.up_proj.weight"


def fp8_tensors(scale=None, weight=None):
    rng = np.random.default_rng(12)
    weight = random_e4m3(rng, (192, 200)) if weight is None else weight
    scale = np.ones((2, 2), np.float32) if scale is None else scale
    return {W: weight, W + "_scale_inv": scale}


def with_code(array, index, code):
    array = array.copy()
    array.view(np.uint8)[index] = code
    return array


CORRUPT = {
    "floor-shaped block scale": (FP8_BLOCK, lambda: fp8_tensors(np.ones((1, 1), np.float32)), W + "_scale_inv",
                                 r"shape \[1, 1\], expected \[2, 2\]"),
    "transposed block scale": (FP8_BLOCK, lambda: fp8_tensors(np.ones((2, 3), np.float32)), W + "_scale_inv",
                               "expected"),
    "NaN scale": (FP8_BLOCK, lambda: fp8_tensors(np.array([[1, 1], [np.nan, 1]], np.float32)), W + "_scale_inv",
                  r"index \[1, 0\] is not finite"),
    "infinite scale": (FP8_BLOCK, lambda: fp8_tensors(np.array([[1, np.inf], [1, 1]], np.float32)),
                       W + "_scale_inv", "not finite"),
    "negative scale": (FP8_BLOCK, lambda: fp8_tensors(np.array([[1, 1], [1, -2]], np.float32)), W + "_scale_inv",
                       "negative"),
    "e8m0 NaN code": (FP8_UE8M0, lambda: fp8_tensors(np.array([[127, 127], [255, 127]], np.uint8).view(E8M0)),
                      W + "_scale_inv", r"0xFF \(NaN\) at index \[1, 0\]"),
    "integer scale": (FP8_BLOCK, lambda: fp8_tensors(np.ones((2, 2), np.int32)), W + "_scale_inv", "dtype int32"),
    "NaN code in the weight": (FP8_BLOCK, lambda: fp8_tensors(weight=with_code(random_e4m3(
        np.random.default_rng(13), (192, 200)), (150, 7), 0x7F)), W, r"index \[150, 7\] is not finite"),
    "float16 weight with scale": (FP8_BLOCK, lambda: fp8_tensors(weight=np.ones((192, 200), np.float16)), W,
                                  "has a scale tensor"),
    "float8 e5m2 weight": (FP8_BLOCK, lambda: fp8_tensors(weight=np.ones((192, 200), ml_dtypes.float8_e5m2)), W,
                           "float8_e5m2"),
    "per-row scale of the wrong length": (MISTRAL, lambda: {W: random_e4m3(np.random.default_rng(1), (8, 4)),
                                                            "model.layers.3.mlp.experts.0.up_proj.qscale_weight":
                                                                np.ones(9, np.float32)},
                                          "model.layers.3.mlp.experts.0.up_proj.qscale_weight", "does not fit"),
}


@pytest.mark.parametrize("case", CORRUPT, ids=list(CORRUPT))
def test_corrupt_or_misshaped_fp8_is_refused_naming_the_tensor(case):
    scheme, make, tensor, detail = CORRUPT[case]
    with pytest.raises(QuantError, match=re.escape(repr(tensor))) as info:
        quant.dequantize(W, make(), scheme, "bfloat16")
    assert re.search(detail, str(info.value)), str(info.value)


def test_corrupt_packed_formats_are_refused_naming_the_tensor():
    name = "model.layers.0.mlp.experts.down_proj"
    blocks = np.zeros((2, 4, 3, 16), np.uint8)
    with pytest.raises(QuantError, match=re.escape(repr(name + "_scales")) + ".*expected \\[2, 4, 3\\]"):
        quant.dequantize(name, {name + "_blocks": blocks, name + "_scales": np.zeros((2, 4, 2), np.uint8)}, MXFP4)
    bad = np.full((2, 4, 3), 127, np.uint8)
    bad[1, 2, 0] = 255
    with pytest.raises(QuantError, match=re.escape(repr(name + "_scales")) + r".*0xFF.*\[1, 2, 0\]"):
        quant.dequantize(name, {name + "_blocks": blocks, name + "_scales": bad}, MXFP4)
    with pytest.raises(QuantError, match=re.escape(repr(name + "_blocks")) + ".*16 bytes"):
        quant.dequantize(name, {name + "_blocks": np.zeros((2, 4, 3, 8), np.uint8),
                                name + "_scales": np.zeros((2, 4, 3), np.uint8)}, MXFP4)
    expert = "layers.1.ffn.experts.0.w2.weight"
    with pytest.raises(QuantError, match=re.escape(repr("layers.1.ffn.experts.0.w2.scale")) + r".*\[4, 2\]"):
        quant.dequantize(expert, {expert: np.zeros((4, 32), np.int8),
                                  "layers.1.ffn.experts.0.w2.scale": np.zeros((4, 3), np.uint8)}, DSV4)
    packed = "model.layers.1.mlp.experts.0.up_proj.weight"
    ok = {packed + "_packed": np.zeros((4, 12), np.int32), packed + "_scale": np.ones((4, 3), BF16),
          packed + "_shape": np.array([4, 96])}
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_scale")) + r".*negative"):
        quant.dequantize(packed, {**ok, packed + "_scale": -np.ones((4, 3), BF16)}, KIMI)
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_scale")) + r".*expected \[4, 3\]"):
        quant.dequantize(packed, {**ok, packed + "_scale": np.ones((4, 2), BF16)}, KIMI)
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_packed")) + r".*int32"):
        quant.dequantize(packed, {**ok, packed + "_packed": np.zeros((4, 12), np.int64)}, KIMI)
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_shape"))):
        quant.dequantize(packed, {**ok, packed + "_shape": np.array([5, 96])}, KIMI)
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_packed")) + r".*expected 13 int32 words"):
        quant.dequantize(packed, {**ok, packed + "_shape": np.array([4, 100])}, KIMI)
    with pytest.raises(QuantError, match=re.escape(repr(packed + "_zero_point")) + ".*not supported"):
        quant.dequantize(packed, {**ok, packed + "_zero_point": np.zeros((1, 3), np.int32)}, KIMI)


def test_naming_and_scheme_mismatches_are_refused():
    rng = np.random.default_rng(14)
    weight = random_e4m3(rng, (4, 4))
    with pytest.raises(QuantError, match=re.escape(repr(W)) + ".*declares no quantization_config"):
        quant.dequantize(W, {W: weight}, None)
    with pytest.raises(QuantError, match=re.escape(repr(W)) + r".*has no scale tensor.*weight_scale_inv"):
        quant.dequantize(W, {W: weight}, FP8_BLOCK)
    with pytest.raises(QuantError, match=re.escape(repr(W)) + ".*is missing"):
        quant.dequantize(W, {}, FP8_BLOCK)
    module = W[:-len(".weight")]
    with pytest.raises(QuantError, match="several scale tensors"):
        quant.dequantize(W, {W: weight, W + "_scale_inv": np.ones((1, 1)), module + ".scale": np.ones((1, 1))},
                         FP8_BLOCK)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    mxfp4 = {fused + "_blocks": np.zeros((1, 2, 1, 16), np.uint8), fused + "_scales": np.zeros((1, 2, 1), np.uint8)}
    with pytest.raises(QuantError, match=re.escape(repr(fused + "_blocks")) + ".*declares 'fp8'"):
        quant.dequantize(fused, mxfp4, FP8_BLOCK)
    with pytest.raises(QuantError, match="declares no expert_dtype 'fp4'"):
        quant.dequantize(W, {W: np.zeros((4, 16), np.int8), module + ".scale": np.zeros((4, 1), np.uint8)}, FP8_UE8M0)
    with pytest.raises(QuantError, match="out_dtype must be float32 or bfloat16"):
        quant.dequantize(W, {W: weight}, FP8_BLOCK, out_dtype="float16")


def test_dense_tensors_pass_through():
    router = np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16)
    name = "model.layers.3.mlp.gate.weight"
    assert quant.dequantize(name, {name: router}, FP8_BLOCK, "bfloat16") is router
    got = quant.dequantize(name, {name: router}, None, "float32")
    assert got.dtype == np.float32 and np.array_equal(got, router.astype(np.float32))


# -- companion and dense names ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme,stored,dense", [
    (FP8_BLOCK, ["model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
                 "model.layers.3.mlp.experts.0.down_proj.weight",
                 "model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"],
     ["model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
      "model.layers.3.mlp.experts.0.down_proj.weight"]),
    (DSV4, ["layers.3.ffn.experts.0.w1.weight", "layers.3.ffn.experts.0.w1.scale", "layers.3.ffn.gate.weight",
            "layers.3.ffn.gate.bias", "layers.3.ffn.gate.tid2eid"],
     ["layers.3.ffn.experts.0.w1.weight", "layers.3.ffn.gate.weight", "layers.3.ffn.gate.bias",
      "layers.3.ffn.gate.tid2eid"]),
    (MXFP4, ["model.layers.0.mlp.router.weight", "model.layers.0.mlp.experts.gate_up_proj_blocks",
             "model.layers.0.mlp.experts.gate_up_proj_scales", "model.layers.0.mlp.experts.gate_up_proj_bias"],
     ["model.layers.0.mlp.router.weight", "model.layers.0.mlp.experts.gate_up_proj",
      "model.layers.0.mlp.experts.gate_up_proj_bias"]),
    (KIMI, ["m.layers.1.mlp.experts.0.up_proj.weight_packed", "m.layers.1.mlp.experts.0.up_proj.weight_scale",
            "m.layers.1.mlp.experts.0.up_proj.weight_shape", "m.layers.1.mlp.shared_experts.up_proj.weight"],
     ["m.layers.1.mlp.experts.0.up_proj.weight", "m.layers.1.mlp.shared_experts.up_proj.weight"]),
    (MISTRAL, ["layers.1.experts.0.w1.weight", "layers.1.experts.0.w1.qscale_weight",
               "layers.1.experts.0.w1.qscale_act"], ["layers.1.experts.0.w1.weight"]),
    (FBGEMM, ["l.0.feed_forward.experts.down_proj", "l.0.feed_forward.experts.down_proj_scale"],
     ["l.0.feed_forward.experts.down_proj"]),
    (None, ["model.language_model.layers.0.router.proj.weight", "model.language_model.layers.0.router.scale",
            "model.language_model.layers.0.router.per_expert_scale"],
     ["model.language_model.layers.0.router.proj.weight", "model.language_model.layers.0.router.scale",
      "model.language_model.layers.0.router.per_expert_scale"]),
], ids=["deepseek_v3", "deepseek_v4", "gpt_oss", "kimi_k25", "mistral", "llama4_fbgemm", "gemma4_bf16"])
def test_companion_and_dense_names(scheme, stored, dense):
    assert quant.dense_names(stored, scheme) == dense
    assert quant.companion_names(stored, scheme) == frozenset(stored) - frozenset(dense)
    for name in dense:
        assert set(quant.locate(name, set(stored), scheme).names) <= set(stored)


# -- quantization_config parsing ---------------------------------------------------------------------------


def test_deepseek_v3_and_qwen3_fp8_configs():
    config = {"model_type": "deepseek_v3", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}
    scheme = quant.parse_quantization_config(config)
    assert scheme == QuantScheme("fp8", block_size=(128, 128))
    assert scheme.describe() == "fp8: float8 e4m3, 128x128 block scales (float)"
    nested = {"model_type": "qwen3_5_moe", "text_config": {"quantization_config": config["quantization_config"]}}
    assert quant.parse_quantization_config(nested).source == "text_config.quantization_config"
    assert quant.parse_quantization_config({"model_type": "mixtral"}) is None
    assert quant.parse_quantization_config({"quantization_config": None}) is None


def test_minimax_and_mistral_fp8_configs():
    minimax = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                       "activation_scheme": "dynamic",
                                       "ignored_layers": ["gate", "e_score_correction_bias", "lm_head"]}}
    scheme = quant.parse_quantization_config(minimax)
    assert scheme.excludes("model.layers.4.block_sparse_moe.gate") and scheme.excludes("lm_head")
    assert not scheme.excludes("model.layers.4.block_sparse_moe.experts.0.w1")
    mistral = {"quantization_config": {"activation_scheme": "static", "quant_method": "fp8",
                                       "weight_block_size": None, "modules_to_not_convert": ["lm_head"]}}
    assert quant.parse_quantization_config(mistral).block_size is None


def test_deepseek_v4_config():
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
          "weight_block_size": [128, 128]}
    beside = quant.parse_quantization_config({"model_type": "deepseek_v4", "expert_dtype": "fp4",
                                              "quantization_config": qc})
    inside = quant.parse_quantization_config({"quantization_config": {**qc, "expert_dtype": "fp4"}})
    assert beside == inside == DSV4
    assert "FP4 e2m1" in beside.describe()
    with pytest.raises(QuantError, match="differing expert_dtype"):
        quant.parse_quantization_config({"expert_dtype": "fp8", "quantization_config": {**qc, "expert_dtype": "fp4"}})


def test_gpt_oss_and_llama4_configs():
    gpt_oss = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    scheme = quant.parse_quantization_config(gpt_oss)
    assert (scheme.method, scheme.group_size) == ("mxfp4", 32)
    assert scheme.excludes("model.layers.7.mlp.router") and not scheme.excludes("model.layers.7.mlp.experts")
    maverick = {"model_type": "llama4", "quantization_config": {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["language_model.model.layers.0.self_attn", "vision_model", "lm_head"]}}
    assert quant.parse_quantization_config(maverick).method == "fbgemm_fp8"


KIMI_QC = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None}}},
}


def test_kimi_compressed_tensors_config():
    config = {"model_type": "kimi_k25", "text_config": {"quantization_config": KIMI_QC}}
    scheme = quant.parse_quantization_config(config)
    assert (scheme.method, scheme.num_bits, scheme.group_size) == ("compressed-tensors", 4, 32)
    assert scheme.excludes("language_model.model.layers.3.self_attn.q_a_proj")
    assert scheme.excludes("language_model.model.layers.0.mlp.gate_proj")
    assert not scheme.excludes("language_model.model.layers.3.mlp.experts.7.gate_proj")
    assert quant.parse_quantization_config({"compression_config": KIMI_QC}) == dataclasses.replace(
        scheme, source="compression_config")


def kimi_with(**weights):
    group = {**KIMI_QC["config_groups"]["group_0"], "weights": {**KIMI_QC["config_groups"]["group_0"]["weights"],
                                                                 **weights}}
    return {"quantization_config": {**KIMI_QC, "config_groups": {"group_0": group}}}


REFUSED = {
    "awq": ({"quantization_config": {"quant_method": "awq", "bits": 4}},
            "quantization_config.quant_method 'awq' is not supported; supported: compressed-tensors, fbgemm_fp8, "
            "fp8, mxfp4"),
    "gptq": ({"quantization_config": {"quant_method": "gptq"}}, "'gptq' is not supported"),
    "bitsandbytes in text_config": ({"text_config": {"quantization_config": {"quant_method": "bitsandbytes"}}},
                                    "text_config.quantization_config.quant_method 'bitsandbytes'"),
    "no quant_method": ({"quantization_config": {"bits": 4}}, "has no quant_method"),
    "fp8 e5m2": ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2' is not supported"),
    "bad block size": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
                       "weight_block_size must be two positive integers"),
    "unknown scale_fmt": ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue4m3"}},
                          "scale_fmt 'ue4m3' is not supported"),
    "unknown expert_dtype": ({"expert_dtype": "fp2", "quantization_config": {"quant_method": "fp8"}},
                             "expert_dtype 'fp2' is not supported"),
    "float-quantized compressed-tensors": (
        {"quantization_config": {**KIMI_QC, "format": "float-quantized"}}, "format 'float-quantized'"),
    "asymmetric int4": (kimi_with(symmetric=False), "weights.symmetric False is not supported"),
    "int3": (kimi_with(num_bits=3), "weights.num_bits 3 is not supported"),
    "g_idx activation order": (kimi_with(actorder="group"), "weights.actorder 'group' is not supported"),
    "tensor strategy": (kimi_with(strategy="tensor"), "weights.strategy 'tensor' is not supported"),
    "W4A8": ({"quantization_config": {**KIMI_QC, "config_groups": {"group_0": {
        **KIMI_QC["config_groups"]["group_0"], "input_activations": {"num_bits": 8, "type": "int"}}}}},
        "input_activations is set"),
    "not packed": ({"quantization_config": {**KIMI_QC, "quantization_status": "frozen"}},
                   "quantization_status 'frozen'"),
    "2:4 sparsity": ({"quantization_config": {**KIMI_QC, "sparsity_config": {"format": "sparse-24-bitmask"}}},
                     "sparsity_config is not supported"),
    "differing configs": ({"quantization_config": {"quant_method": "fp8"},
                           "text_config": {"quantization_config": {"quant_method": "mxfp4"}}}, "differing"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_unsupported_quantization_configs_are_refused_naming_them(case):
    config, message = REFUSED[case]
    with pytest.raises(QuantError, match=re.escape(message)):
        quant.parse_quantization_config(config)
    assert issubclass(QuantError, ValueError)


# -- memory: the output plus a chunk of temporaries ------------------------------------------------------


def test_memory_mapped_inputs_are_dequantised_in_bounded_memory(tmp_path, monkeypatch):
    """tracemalloc sees numpy's allocations: peak = the output + O(CHUNK_ELEMENTS) temporaries, never a
    float32 copy of the whole weight (which alone would be 8 MiB here)."""
    import tracemalloc

    monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 1 << 15)  # 128 KiB of float32 per chunk
    rows, cols = 1024, 2048
    rng = np.random.default_rng(15)
    files = {}
    for key, array in {"fp8": random_e4m3(rng, (rows, cols)),
                       "blocks": rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8),
                       "packed": rng.integers(0, 2 ** 31, (rows, cols // 8), dtype=np.int64).astype(np.int32)}.items():
        array.tofile(tmp_path / key)
        files[key] = np.memmap(tmp_path / key, dtype=array.dtype, mode="r", shape=array.shape)
    calls = {
        "fp8 block": lambda: quant.dequantize_fp8_block(files["fp8"], np.ones((8, 16), np.float32),
                                                        out_dtype="bfloat16"),
        "mxfp4": lambda: quant.dequantize_mxfp4(files["blocks"], np.full((rows, cols // 32), 127, np.uint8),
                                                out_dtype="bfloat16"),
        "int4": lambda: quant.dequantize_int_packed(files["packed"], np.ones((rows, cols // 32), BF16),
                                                    columns=cols, group_size=32, out_dtype="bfloat16"),
    }
    output_bytes = rows * cols * 2
    for what, call in calls.items():
        tracemalloc.start()
        try:
            call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < output_bytes + (1 << 20), f"{what}: peak {peak} bytes for a {output_bytes}-byte output"
