"""The serving dtype: what `--dtype auto` (the default) picks, and why, in one line.

Rules (`choose`), first match wins:
1. an explicit `--dtype float32 | bfloat16` is used as given;
2. a preset: bfloat16 (its weights are generated, not stored);
3. a quantised checkpoint (FP8, FP4, MXFP4, INT4: config.json has a quantization_config):
   bfloat16, the weights dequantised into it at load (on one GPU a block-FP8 checkpoint's routed
   experts stay FP8 and compute in bfloat16: `engine.build.keeps_fp8`);
4. the checkpoint's dtype as config.json states it (`dtype`, transformers 4.x `torch_dtype`):
   float32 -> float32; bfloat16 -> bfloat16; float16 -> bfloat16 (expertd computes in float32 or
   bfloat16; `--dtype float32` keeps every float16 value exactly);
5. without that key, the stored dtype of the first routed expert weight (its safetensors header),
   mapped as in 4 (float8 / packed integer bytes -> bfloat16).
"""
from __future__ import annotations

SERVING_DTYPES = ("float32", "bfloat16")
AUTO = "auto"
# config.json / safetensors dtype names -> the serving dtype auto picks for them
_FROM_CHECKPOINT = {
    "float32": "float32", "F32": "float32", "float64": "float32", "F64": "float32",
    "bfloat16": "bfloat16", "BF16": "bfloat16", "float16": "bfloat16", "F16": "bfloat16",
}


def choose(requested: str, *, preset: bool = False, config_dtype: str | None = None,
           quantization: str | None = None, stored_dtype: str | None = None) -> tuple[str, str]:
    """(serving dtype, why) by the rules in the module docstring.

    Args:
      requested: `--dtype`: "auto", "float32" or "bfloat16".
      preset: serving a preset (seeded weights) rather than a checkpoint.
      config_dtype: config.json's `dtype` / `torch_dtype` (None: absent).
      quantization: the quantization scheme's one-line description (None: unquantised).
      stored_dtype: the safetensors dtype of a routed expert weight, e.g. "BF16" (None: unknown).
    """
    if requested != AUTO:
        if requested not in SERVING_DTYPES:
            raise ValueError(f"--dtype must be {AUTO!r} or one of {SERVING_DTYPES}, got {requested!r}")
        return requested, "--dtype " + requested
    if preset:
        return "bfloat16", "--dtype auto: presets are served in bfloat16"
    if quantization is not None:
        return "bfloat16", f"--dtype auto: a quantised checkpoint ({quantization}) is dequantised to bfloat16"
    if config_dtype is not None:
        if config_dtype in _FROM_CHECKPOINT:
            return _FROM_CHECKPOINT[config_dtype], f"--dtype auto: config.json's dtype is {config_dtype}"
    if stored_dtype is not None:
        return _FROM_CHECKPOINT.get(stored_dtype, "bfloat16"), \
            f"--dtype auto: the expert weights are stored as {stored_dtype}"
    return "bfloat16", "--dtype auto: the checkpoint states no dtype"
