"""`expertd inspect DIR`: what a checkpoint is and what `expertd serve --checkpoint DIR` would do.

`inspect_checkpoint(path, layers=None, dtype="auto", expert_weights="dtype") -> dict` reads
config.json and the safetensors headers only (no weights, no JAX computation): family, model type,
MoE layers, per-layer shapes (E, k, H, I, shared), router settings and activation, the tensor
layout found, quantisation (method, scale format, modules left unquantised), the serving dtype and
why, what the routed experts are served as (`expert_weights`: the serving dtype, or "int8" as
`serve --expert-weights int8` quantises them at load on CPU; `int8_from_fp8`: straight from a
block-scaled FP8 checkpoint's codes), the host memory of the served
weights, and either `servable: true` or the refusal `serve` would print. `format_report` renders
it for people; `--json` prints the dict.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from expertd.kernels.config import MoEConfig
from expertd.server import models
from expertd.server.models import quant
from expertd.server.models.checkpoint import keeps_fp8, plan_checkpoint
from expertd.server.models.presets import describe_indices
from expertd.server.models.stored import files_bytes


def inspect_checkpoint(path, *, layers=None, dtype: str = "auto", expert_weights: str = "dtype") -> dict:
    """The report described in the module docstring (a JSON-able dict)."""
    path = Path(path)
    report = {"checkpoint": str(path), "servable": False, "refusal": None, "family": None, "model_type": None,
              "text_model_type": None, "architectures": [], "num_hidden_layers": None, "moe_layers": [],
              "layers": [], "quantization": None, "stored_dtype": None, "dtype": None, "dtype_reason": None,
              "served_bytes": None, "checkpoint_bytes": files_bytes(path) if path.is_dir() else None}
    try:
        config = json.loads((path / "config.json").read_text())
        c = models.reader(config)
        report.update(model_type=c.model_type, text_model_type=c.text_model_type, architectures=c.architectures)
        family = models.family_of(c)
        report["family"] = family.name
        report["router_rule"], report["formats"] = family.router, family.formats
        report["num_hidden_layers"] = c.get("num_hidden_layers", "n_layers")
        reason = models.refusal(c)  # a refused family is still described as far as its config allows
        try:
            report["moe_layers"] = models.moe_layer_indices(c)
            report["layers"] = _layer_groups(c, report["moe_layers"])
            report["quantization"] = _quantization(config)
        except ValueError:
            if reason is None:
                raise
        if reason is not None:
            raise models.ConfigError(reason)
        plan = plan_checkpoint(path, layers=layers, dtype=dtype)
    except (OSError, ValueError) as exc:  # refusals, bad configs, missing or misshapen tensors
        report["refusal"] = str(exc)
        return report
    by_index = {layer.index: layer for layer in plan.layers}
    for group in report["layers"]:
        found = by_index.get(group["indices"][0])
        group["tensors"] = None if found is None else _tensor_summary(found.tensors)
    served_bytes = plan.served_bytes
    if expert_weights == "int8":  # int8 + an fp32 scale per output column instead of the serving dtype
        itemsize = 4 if plan.dtype == "float32" else 2
        for layer in plan.layers:
            e, h, i = layer.cfg.num_experts, layer.cfg.hidden_size, layer.cfg.intermediate_size
            served_bytes -= e * (3 * h * i * (itemsize - 1) - (2 * i + h) * 4)
    report.update(servable=True, stored_dtype=plan.stored_dtype, dtype=plan.dtype, dtype_reason=plan.dtype_reason,
                  served_bytes=served_bytes, served_layers=[layer.index for layer in plan.layers],
                  expert_weights="int8" if expert_weights == "int8" else plan.dtype,
                  int8_from_fp8=expert_weights == "int8" and keeps_fp8(plan))
    return report


def _layer_groups(c, indices) -> list[dict]:
    groups: dict[MoEConfig, list[int]] = {}
    for i in indices:
        groups.setdefault(models.layer_config(c, i), []).append(i)
    return [{"indices": found, **dataclasses.asdict(cfg), "router": describe_router(cfg),
             "experts": describe_experts(cfg)}
            for cfg, found in groups.items()]


def _quantization(config) -> dict | None:
    scheme = quant.parse_quantization_config(config)  # QuantError names an unsupported method
    if scheme is None:
        return None
    return {"method": scheme.method, "description": scheme.describe(), "scale_fmt": scheme.scale_fmt,
            "block_size": list(scheme.block_size) if scheme.block_size else None, "excluded": list(scheme.excluded)}


def _tensor_summary(tensors) -> dict:
    layout = tensors.experts
    own = [tensors.router_bias, tensors.tid2eid]
    if tensors.proj_bias:
        own += [tensors.proj_bias.gate_up, tensors.proj_bias.down]
    if tensors.norms:
        own += list(dataclasses.astuple(tensors.norms))
    return {"router": tensors.router, "bias": tensors.bias, "experts": type(layout).__name__,
            "first_expert_tensor": layout.probe(), "shared": tensors.shared.gate if tensors.shared else None,
            "family_tensors": [name for name in own if name]}


def describe_router(cfg: MoEConfig) -> str:
    """One line for the router settings of `cfg`, e.g. "sigmoid, top-8 of score + bias, 4 of 8 groups, ..."."""
    parts = ["RMS-normed input x scale"] if cfg.router_input_norm else []
    if cfg.router_bias:
        parts.append("logits + router bias")
    bias = " + bias" if cfg.use_expert_bias else ""
    if cfg.hash_routed:
        parts.append(f"{cfg.score_function}, experts tid2eid[token id] (vocabulary {cfg.hash_vocab_size}; needs "
                     "token ids)")
    elif cfg.score_function == "softmax":
        parts.append(f"softmax over E, top-{cfg.topk} of probability{bias}" if cfg.use_pre_softmax
                     else f"softmax over the top-{cfg.topk}")
    else:
        parts.append(f"{cfg.score_function}, top-{cfg.topk}" + (" of score + bias" if cfg.use_expert_bias else ""))
    if cfg.num_groups:
        score = f" (group score: top {cfg.group_score_topk})" if cfg.group_score_topk else ""
        parts.append(f"within the best {cfg.group_topk} of {cfg.num_groups} groups{score}")
    renorm = cfg.norm_topk_prob if cfg.norm_topk_prob is not None else \
        (not cfg.use_pre_softmax if cfg.score_function == "softmax" else cfg.topk > 1)
    floor = f" (sum floored at {cfg.norm_topk_min:g})" if cfg.norm_topk_min is not None else ""
    parts.append(f"renormalised{floor}" if renorm else "not renormalised")
    if cfg.scaling_factor != 1.0:
        parts.append(f"x {cfg.scaling_factor:g}")
    if cfg.per_expert_scale:
        parts.append("x per_expert_scale")
    if cfg.router_weight_on_input:
        parts.append("weight on the expert input, summed unweighted")
    return ", ".join(parts)


def describe_experts(cfg: MoEConfig) -> str:
    """The experts' activation with its clamps, biases and norms, e.g. "silu, clamped (limit 10) before"."""
    parts = [cfg.activation]
    if cfg.swiglu_limit is not None:
        where = "before" if cfg.swiglu_limit_mode == "before_activation" else "after"
        parts.append(f"clamped at {cfg.swiglu_limit:g} {where} the activation")
    if cfg.activation == "swiglu_oai":
        parts.append(f"alpha {cfg.swiglu_alpha:g}")
    if cfg.shared_swiglu_limit is not None:
        parts.append(f"shared clamped at {cfg.shared_swiglu_limit:g}")
    if cfg.expert_proj_bias:
        parts.append("projection biases")
    if cfg.expert_input_norm or cfg.expert_output_norm:
        parts.append("RMSNorm on the experts' input and output")
    return ", ".join(parts)


def format_report(report: dict) -> str:
    """`report` as the lines `expertd inspect` prints."""
    lines = [f"checkpoint   {report['checkpoint']}"]
    if report["family"] or report["model_type"]:
        text = f", text_config {report['text_model_type']}" if report["text_model_type"] else ""
        lines.append(f"family       {report['family'] or '(unknown)'} (model_type {report['model_type']}{text}; "
                     f"{', '.join(report['architectures']) or 'no architectures'})")
    if report["moe_layers"]:
        lines.append(f"MoE layers   {describe_indices(report['moe_layers'])} ({len(report['moe_layers'])} of "
                     f"{report['num_hidden_layers']} decoder layers)")
    for group in report["layers"]:
        shared = (f", shared {group['shared_intermediate_size']}"
                  + (" sigmoid-gated" if group["shared_expert_gate"] else " ungated")) if group["num_shared_experts"] \
            else ", no shared expert"
        lines.append(f"layers {describe_indices(group['indices'])}: E={group['num_experts']} k={group['topk']} "
                     f"H={group['hidden_size']} I={group['intermediate_size']}{shared}, {group['experts']}")
        lines.append(f"  router     {group['router']}")
        if group.get("tensors"):
            t = group["tensors"]
            lines.append(f"  tensors    {t['router']}; experts {t['experts']} ({t['first_expert_tensor']}, ...)"
                         + "".join(f"; {name}" for name in t["family_tensors"]))
    q = report["quantization"]
    if q is not None:
        lines.append(f"quantised    {q['description']}" + (f"; left unquantised: {', '.join(q['excluded'])}"
                                                          if q["excluded"] else ""))
    if report["servable"]:
        lines.append(f"dtype        {report['dtype']} ({report['dtype_reason']}; experts stored as "
                     f"{report['stored_dtype']})")
        if report.get("expert_weights") == "int8":
            source = "converted from the FP8 codes as they load" if report.get("int8_from_fp8") else \
                "quantised at load"
            lines.append(f"experts      served as INT8 (--expert-weights int8: {source}, a scale per output "
                         f"channel, activations {report['dtype']}; CPU with the native kernel)")
        files = _size(report["checkpoint_bytes"])
        lines.append(f"memory       {_size(report['served_bytes'])} of served weights for "
                     f"{len(report['served_layers'])} MoE layers (checkpoint files {files})")
        lines.append(f"serve        would serve MoE layers {describe_indices(report['served_layers'])}")
    else:
        lines.append(f"serve        refused: {report['refusal']}")
    return "\n".join(lines) + "\n"


def _size(count: int) -> str:
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
