"""What a checkpoint's `quantization_config` (config.json) means for expertd, or why it is refused.

`parse_quantization_config(config)` reads `quantization_config` at the top of config.json or under
`text_config` (older compressed-tensors files call it `compression_config`) and returns a
`QuantScheme`, or None for an unquantised checkpoint. Accepted, by `quant_method`:

- `fp8` with `weight_block_size [bm, bn]` (DeepSeek-V3/V3.2/R1, Kimi-K2, MiniMax-M2, GLM and Qwen3
  FP8): e4m3 weights with a float (`weight_scale_inv`) or e8m0 (`.scale`, `scale_fmt: ue8m0`)
  scale per block;
- `fp8` with `expert_dtype: fp4` (DeepSeek-V4; the key may sit beside the quantization_config):
  as above, routed experts FP4 e2m1 (I8, two per byte) with an e8m0 scale per 32 inputs;
- `fp8` with `weight_block_size: null` (Mistral `.qscale_weight`): e4m3 weights with one float
  scale per tensor or per output row;
- `fbgemm_fp8` (Llama 4 Maverick FP8): e4m3 weights with a float scale per output channel;
- `mxfp4` (gpt-oss): `*_blocks` / `*_scales`, e2m1 with an e8m0 scale per 32 values;
- `compressed-tensors` with format `pack-quantized` (Kimi-K2-Thinking / K2.5 / K2.6 experts):
  symmetric int4 (or int8) packed in int32, a float scale per group of inputs (or per row).

Anything else raises `QuantError` (a ValueError) naming the key and value: other methods (awq,
gptq, bitsandbytes, ...), float8 e5m2, other scale formats, asymmetric (zero-point) or
activation-order (g_idx) int weights, activation quantisation in compressed-tensors, sparsity or
transforms. Unknown extra keys in an accepted config are ignored; activation scales and
`kv_cache_scheme` do not concern expert weights served dequantised.
"""
from __future__ import annotations

import dataclasses
import re

from expertd.server.models.quant.codecs import QuantError

SUPPORTED_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8", "mxfp4")
EXCLUDE_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore")
_CT_ACTORDER_OK = (None, False, "weight", "static")  # no g_idx stored: groups stay in column order


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's weights are quantised (see the module docstring for the accepted configs).

    Attributes:
      method: config.json's quant_method: "fp8", "fbgemm_fp8", "mxfp4" or "compressed-tensors".
      block_size: fp8: `weight_block_size` as (rows, cols), e.g. (128, 128); None means one scale per
        tensor or per output row.
      scale_fmt: fp8: "float" or "ue8m0" (power-of-two scales, stored as F32 or F8_E8M0).
      expert_dtype: DeepSeek-V4 "fp4" (routed experts packed e2m1) or "fp8"; None elsewhere.
      group_size: values per scale along a row for mxfp4 (32), fp4 experts (32) and
        compressed-tensors (its group_size; None for strategy "channel").
      num_bits: compressed-tensors: 4 or 8.
      excluded: module names / patterns config.json leaves unquantised (`modules_to_not_convert`,
        `ignored_layers`, `ignore`; "re:" marks a regular expression).
      source: where in config.json the quantization_config was found.
    """

    method: str
    block_size: tuple[int, int] | None = None
    scale_fmt: str = "float"
    expert_dtype: str | None = None
    group_size: int | None = None
    num_bits: int | None = None
    excluded: tuple[str, ...] = ()
    source: str = "quantization_config"

    def describe(self) -> str:
        """One line for logs and errors, e.g. "fp8: float8 e4m3, 128x128 block scales (ue8m0)"."""
        if self.method == "fp8":
            grid = f"{self.block_size[0]}x{self.block_size[1]} block" if self.block_size else "per-tensor/per-row"
            text = f"fp8: float8 e4m3, {grid} scales ({self.scale_fmt})"
            return text + (", routed experts FP4 e2m1 with e8m0 scales per 32" if self.expert_dtype == "fp4" else "")
        if self.method == "fbgemm_fp8":
            return "fbgemm_fp8: float8 e4m3, per-output-channel scales"
        if self.method == "mxfp4":
            return "mxfp4: e2m1 with e8m0 scales per 32 values"
        grouping = f"groups of {self.group_size}" if self.group_size else "per-row scales"
        return f"compressed-tensors: symmetric int{self.num_bits} packed in int32, {grouping}"

    def excludes(self, module: str) -> bool:
        """Whether config.json lists `module` as not quantised. Entries match as transformers'
        `should_convert_module` matches them (`re.match` of the entry, so "model.layers.*.self_attn"
        and "lm_head" work, or the name ends with the entry); "re:<regex>" entries (compressed-tensors)
        match with `re.match`. Informational: `dequantize` decides by the stored dtypes and companions.
        """
        return any(_matches(pattern, module) for pattern in self.excluded)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    try:
        return re.match(pattern, module) is not None or module.endswith(pattern)
    except re.error:  # not a regular expression: compare as text
        return module == pattern or module.startswith(pattern + ".") or module.endswith(pattern)


def parse_quantization_config(config: dict) -> QuantScheme | None:
    """The QuantScheme of an HF config.json dict, None if unquantised; QuantError if not servable."""
    found = _find(config)
    if found is None:
        return None
    where, qc = found
    if not isinstance(qc, dict):
        raise QuantError(f"{where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None:
        raise QuantError(f"{where} has no quant_method; supported: {', '.join(SUPPORTED_METHODS)}")
    parse = _PARSERS.get(method)
    if parse is None:
        raise QuantError(f"{where}.quant_method {method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)}")
    return parse(qc, config, where)


def _find(config: dict):
    """(where, quantization_config) from config.json, or None."""
    if not isinstance(config, dict):
        raise QuantError(f"config must be a dict, got {type(config).__name__}")
    found = []
    text_config = config.get("text_config")
    for prefix, holder in (("", config), ("text_config.", text_config if isinstance(text_config, dict) else {})):
        for key in ("quantization_config", "compression_config"):
            if holder.get(key) is not None:
                found.append((prefix + key, holder[key]))
    if not found:
        return None
    if any(qc != found[0][1] for _where, qc in found[1:]):
        raise QuantError(f"config.json holds differing quantization configs: {', '.join(w for w, _ in found)}")
    return found[0]


def _excluded(qc: dict, where: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in EXCLUDE_KEYS:
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise QuantError(f"{where}.{key} must be a list of module names, got {value!r}")
        names.extend(value)
    return tuple(names)


def _parse_fp8(qc: dict, config: dict, where: str) -> QuantScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantError(f"{where}.fmt {fmt!r} is not supported; expertd reads float8 e4m3 ('e4m3') weights")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantError(f"{where}.weight_block_size must be two positive integers or null, got {block!r}")
        block = (block[0], block[1])
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise QuantError(f"{where}.scale_fmt {scale_fmt!r} is not supported; supported: 'float', 'ue8m0'")
    expert_dtype = _expert_dtype(qc, config, where)
    return QuantScheme("fp8", block_size=block, scale_fmt=scale_fmt, expert_dtype=expert_dtype,
                       group_size=32 if expert_dtype == "fp4" else None, excluded=_excluded(qc, where),
                       source=where)


def _expert_dtype(qc: dict, config: dict, where: str):
    """DeepSeek-V4's expert_dtype: in the quantization_config or beside it in config.json."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    values = {w: v for w, v in ((f"{where}.expert_dtype", qc.get("expert_dtype")),
                                ("expert_dtype", config.get("expert_dtype")),
                                ("text_config.expert_dtype", text_config.get("expert_dtype"))) if v is not None}
    if len(set(values.values())) > 1:
        raise QuantError(f"config.json gives differing expert_dtype values: {values}")
    value = next(iter(values.values()), None)
    if value not in (None, "fp8", "fp4"):
        key = next(iter(values))
        raise QuantError(f"{key} {value!r} is not supported; supported: 'fp8', 'fp4'")
    return value


def _parse_fbgemm_fp8(qc: dict, config: dict, where: str) -> QuantScheme:
    return QuantScheme("fbgemm_fp8", excluded=_excluded(qc, where), source=where)


def _parse_mxfp4(qc: dict, config: dict, where: str) -> QuantScheme:
    return QuantScheme("mxfp4", group_size=32, excluded=_excluded(qc, where), source=where)


def _parse_compressed_tensors(qc: dict, config: dict, where: str) -> QuantScheme:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantError(f"{where}.quantization_status {status!r} is not supported: expertd reads "
                         "'compressed' (packed) checkpoints")
    for key in ("sparsity_config", "transform_config"):
        value = qc.get(key)
        dense_sparsity = key == "sparsity_config" and isinstance(value, dict) and value.get("format") in (None, "dense")
        if value and not dense_sparsity:
            raise QuantError(f"{where}.{key} is not supported (got {value!r})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantError(f"{where}.config_groups must be a non-empty object, got {groups!r}")
    parsed = {_parse_ct_group(group, qc.get("format"), f"{where}.config_groups.{key}")
              for key, group in groups.items()}
    if len(parsed) > 1:
        raise QuantError(f"{where}.config_groups: groups with different weight schemes {sorted(parsed)} are not "
                         "supported")
    num_bits, group_size = parsed.pop()
    return QuantScheme("compressed-tensors", group_size=group_size, num_bits=num_bits,
                       excluded=_excluded(qc, where), source=where)


def _parse_ct_group(group, top_format, where: str) -> tuple[int, int | None]:
    """(num_bits, group_size) of one compressed-tensors config group, or QuantError."""
    if not isinstance(group, dict):
        raise QuantError(f"{where} must be an object, got {group!r}")
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise QuantError(f"{where}: format {fmt!r} is not supported; supported: 'pack-quantized' (int weights)")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise QuantError(f"{where}.{key} is set: activation quantisation is not supported "
                             "(expertd serves weight-only compressed-tensors)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise QuantError(f"{where}.weights must be an object, got {weights!r}")

    strategy = weights.get("strategy")
    size = weights.get("group_size")
    checks = (
        ("type", weights.get("type", "int") == "int", "'int'"),
        ("num_bits", weights.get("num_bits") in (4, 8), "4, 8"),
        ("symmetric", weights.get("symmetric", True) is True, "true (zero-point weights are not supported)"),
        ("dynamic", weights.get("dynamic", False) is False, "false"),
        ("actorder", weights.get("actorder") in _CT_ACTORDER_OK,
         "null, 'weight' (activation-ordered groups with g_idx are not supported)"),
        ("block_structure", weights.get("block_structure") is None, "null"),
        ("strategy", strategy in ("group", "channel"), "'group', 'channel'"),
        ("group_size", strategy != "group" or (isinstance(size, int) and not isinstance(size, bool) and size > 0),
         "a positive integer"),
    )
    for key, ok, expected in checks:
        if not ok:
            raise QuantError(f"{where}.weights.{key} {weights.get(key)!r} is not supported; supported: {expected}")
    return weights["num_bits"], (size if strategy == "group" else None)


_PARSERS = {
    "fp8": _parse_fp8,
    "fbgemm_fp8": _parse_fbgemm_fp8,
    "mxfp4": _parse_mxfp4,
    "compressed-tensors": _parse_compressed_tensors,
}
