"""Official quantised weight formats, dequantised at load on the host into the serving dtype.

The door of the quantisation subsystem; a checkpoint loader uses these names only:

1. `scheme = parse_quantization_config(config)` once, at start, from config.json (top level or
   `text_config`): a `QuantScheme`, None for an unquantised checkpoint, or `QuantError` (a
   ValueError) that names the key and value of anything expertd cannot serve exactly (an unknown
   `quant_method` such as awq is refused with the supported list). Nothing is served wrong.
2. Per dense weight the family needs (e.g. `model.layers.3.mlp.experts.7.gate_proj.weight`, or the
   fused `model.layers.0.mlp.experts.gate_up_proj`), call
   `dequantize(name, tensors, scheme, out_dtype)` with `tensors` a mapping of the checkpoint's stored
   names to numpy arrays / memory maps (only `in` and `[]` are used, so a lazy view over the
   safetensors files of one layer works). It finds the companion tensors by the format's naming rules
   (`<m>.weight_scale_inv`, `<m>.scale`, `<m>.qscale_weight`, `<m>.weight_scale`, `n_blocks` +
   `n_scales`, `<m>.weight_packed` + `_scale` + `_shape`; table in `names.py`), decodes by the stored
   dtypes, checks shapes and scales, and returns the dense array, shaped as stored, in float32 or
   bfloat16; dense float tensors come back cast (or as stored). The family's loader then transposes
   into expertd's layouts as it does for bf16 checkpoints (gpt-oss MXFP4 comes back `[E, R, C]`,
   transformers' parameter is its transpose). `locate(name, names, scheme)` tells which stored
   tensors hold a weight without reading them.
3. `companion_names(names, scheme)` / `dense_names(names, scheme)`: the stored names a loader skips
   when it enumerates a checkpoint (scales, blocks, packed parts, activation scales) and the dense
   weights it holds.
4. safetensors' numpy backend cannot read float8 tensors (F8_E4M3, F8_E8M0: it looks for
   np.float8_*); a loader memory-maps their bytes and views them with `numpy_dtype(header dtype)`.

Memory: each decoder writes its output row chunk by row chunk, so a call holds the output plus
O(`codecs.CHUNK_ELEMENTS`) float32 temporaries and reads memory-mapped inputs once (FP8 in large
blocks goes through `fp8_tables`: per-block look-up tables, the same values). Work is on the
host in numpy; weights reach the devices dense, in the serving dtype, except where a loader keeps
FP8: `fp8_blocks(name, tensors, scheme)` gives a block-scaled FP8 weight's stored codes and fp32
scales as they are (None where the weight is not stored so), which the GPU's expert kernels read.

What each format means, exactly, is in the docstrings of `codecs.py` (the math) and `scheme.py`
(the accepted configs).
"""
from expertd.server.models.quant.codecs import (
    CHUNK_ELEMENTS,
    E2M1_VALUES,
    QuantError,
    dequantize_fp4,
    dequantize_fp8_block,
    dequantize_fp8_per_channel,
    dequantize_int_packed,
    dequantize_mxfp4,
    fp8_block_codes,
)
from expertd.server.models.quant.names import (
    StoredWeight,
    companion_names,
    dense_names,
    dequantize,
    fp8_blocks,
    locate,
    numpy_dtype,
)
from expertd.server.models.quant.scheme import SUPPORTED_METHODS, QuantScheme, parse_quantization_config

__all__ = [
    "CHUNK_ELEMENTS", "E2M1_VALUES", "SUPPORTED_METHODS", "QuantError", "QuantScheme", "StoredWeight",
    "companion_names", "dense_names", "dequantize", "dequantize_fp4", "dequantize_fp8_block",
    "dequantize_fp8_per_channel", "dequantize_int_packed", "dequantize_mxfp4", "fp8_block_codes", "fp8_blocks",
    "locate", "numpy_dtype",
    "parse_quantization_config",
]
