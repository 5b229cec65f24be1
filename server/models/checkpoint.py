"""Load the MoE layers of a Hugging Face checkpoint directory (config.json + *.safetensors).

Two steps, both through the model registry (`expertd.server.models`):

1. `plan_checkpoint(path, ...)` reads config.json and the safetensors headers only: the family,
   whether expertd can serve it (else `CheckpointRefused`: an unknown model, semantics expertd
   lacks, or a quantization_config it cannot read, each named), the MoE layers asked for, each
   layer's `MoEConfig` and tensor names (the layer prefix and layout the checkpoint uses), every
   tensor checked to exist with the shape config.json implies, the serving dtype (`--dtype auto`,
   `models.dtypes`) and the bytes the served weights take.
2. `load_checkpoint(path, ...)` loads the planned layers one at a time and one expert at a time
   from memory-mapped files (`models.stored`): each weight is dequantised (`models.quant`) or
   cast into the serving dtype and transposed into expertd's layouts (`router_weight [H, E]` fp32,
   `expert_bias [E]` fp32, `w_gate / w_up [E, H, I]`, `w_down [E, I, H]`, `shared_w_* [H, Is] /
   [Is, H]`, `shared_gate [H, 1]`), and the pages it read are dropped from the process. Host memory
   peaks at the served weights plus, per worker thread, one expert's tensors and the dequantiser's
   chunk temporaries; fused `[E, ...]` tensors are read an expert slice at a time, never copied
   whole. `checkpoint_layer.load_layer` reads one layer (the family semantics' tensors included:
   router and projection biases, hash tables, Gemma 4's norms).

Every problem raises `CheckpointError` (a ValueError) naming the file, tensor, layer or key.
With `keep_fp8` (the engine asks for it on a GPU, `keeps_fp8(plan)`), step 2 keeps block-scaled
FP8 routed experts as stored (codes and scales, `quant.fp8_blocks`) instead of dequantising them;
with `fp8_as_int8` (the engine asks for it on CPU with `--expert-weights int8`) it converts them
to INT8 weights as it reads them.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from expertd.kernels.config import MoEConfig
from expertd.kernels.params import param_dtype, param_shapes
from expertd.server import models
from expertd.server.models import dtypes, quant
from expertd.server.models.checkpoint_layer import CheckpointError, load_layer
from expertd.server.models.family import Family, LayerTensors
from expertd.server.models.presets import LoadedLayer, select_layers
from expertd.server.models.stored import StoredError, StoredTensors

_DENSE_STORED = ("F32", "BF16", "F16", "F64", "F8_E4M3", "I64", "I32")  # stored with their dense shape
# Loader threads: two per core, up to 16. A worker waits on reading cold pages about as long as it
# computes (transposing, dequantising), so two per core keep the cores busy while the disk reads.
DEFAULT_WORKERS = min(16, 2 * (os.cpu_count() or 1))


class CheckpointRefused(CheckpointError):
    """expertd does not serve this checkpoint (unknown model, missing semantics, unreadable
    quantisation): refused at start, before anything is loaded."""


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One MoE layer as the checkpoint holds it: index, description, tensor names (prefixed)."""

    index: int
    cfg: MoEConfig
    tensors: LayerTensors


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """What `load_checkpoint` will do (see the module docstring, step 1).

    moe_layers: every MoE layer of the model; layers: the planned (asked for) ones.
    dtype, dtype_reason: the serving dtype and the one-line reason for it.
    scheme: the quantization scheme (None: unquantised). stored_dtype: a routed expert weight's
    safetensors dtype. served_bytes: host bytes of the planned layers' served weights.
    """

    path: Path
    config: dict
    family: Family
    moe_layers: list[int]
    layers: list[LayerPlan]
    scheme: quant.QuantScheme | None
    stored_dtype: str
    dtype: str
    dtype_reason: str
    served_bytes: int


def read_config(path) -> dict:
    """config.json of checkpoint directory `path`, with its family checked (CheckpointRefused if unknown)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {path}: config.json is missing")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: config.json is not valid JSON ({exc})") from exc
    family_of(config, where=str(path))
    return config


def family_of(config: Mapping, *, where: str = "checkpoint") -> Family:
    """The registry's family of `config`; CheckpointRefused naming what it is otherwise."""
    try:
        return models.family_of(config)
    except models.ConfigError as exc:
        raise CheckpointRefused(f"{where}: {exc}") from exc


def moe_layers_of(path) -> list[int]:
    """The MoE decoder layers of the checkpoint at `path` (config.json only)."""
    config = read_config(path)
    try:
        return models.moe_layer_indices(config)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc


def plan_checkpoint(path, *, layers: Sequence[int] | str | None = None, num_layers: int | None = None,
                    dtype: str = dtypes.AUTO) -> CheckpointPlan:
    """Plan loading the MoE layers of `path` (see the module docstring, step 1); headers only.

    layers: MoE layer indices (a list or a "1,3-5" string); num_layers: the first n MoE layers;
    neither: every MoE layer. dtype: "auto" (see `models.dtypes`), "float32" or "bfloat16".
    """
    path = Path(path)
    config = read_config(path)
    where = f"checkpoint {path}"
    family = family_of(config, where=where)
    reason = models.refusal(config)
    if reason is not None:
        raise CheckpointRefused(f"{where}: {reason}")
    try:
        scheme = quant.parse_quantization_config(config)
    except quant.QuantError as exc:
        raise CheckpointRefused(f"{where}: {exc}") from exc
    try:
        all_moe = models.moe_layer_indices(config)
        chosen = select_layers(all_moe, layers=layers, num_layers=num_layers, what=f"{where} ({family.name})")
        configs = {i: models.layer_config(config, i) for i in chosen}
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    with _open(path) as stored:
        planned = [LayerPlan(i, configs[i], _find_layer(stored, config, family, i, configs[i], scheme, where))
                   for i in chosen]
        stored_dtype = _stored_dtype(stored, planned[0].tensors.experts.probe(), scheme, where)
    try:
        serving, why = dtypes.choose(dtype, config_dtype=models.reader(config).dtype(),
                                     quantization=scheme.describe() if scheme else None, stored_dtype=stored_dtype)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    served = sum(_served_bytes(layer.cfg, serving) for layer in planned)
    return CheckpointPlan(path, config, family, all_moe, planned, scheme, stored_dtype, serving, why, served)


def load_checkpoint(path, *, layers: Sequence[int] | str | None = None, num_layers: int | None = None,
                    dtype: str | None = None, workers: int = DEFAULT_WORKERS,
                    keep_fp8: bool = False, fp8_as_int8: bool = False) -> list[LoadedLayer]:
    """The MoE layers of the checkpoint at `path` (see the module docstring, step 2).

    layers / num_layers: as `plan_checkpoint`. dtype: the expert weights' dtype, "float32" /
    "bfloat16", or None / "auto" for `--dtype auto`'s choice. Router weight and bias are fp32.
    workers: threads reading a layer's experts (each holds one expert's temporaries).
    keep_fp8: routed experts stored as block-scaled FP8 stay FP8 (`experts.Fp8BlockWeights` of
    host arrays: the codes as stored, transposed into expertd's layouts, and fp32 block scales) for
    the GPU's kernels that read them (`keeps_fp8`); other layers load as without it.
    fp8_as_int8: those routed experts become INT8 weights of the native CPU kernel instead, each
    expert converted from its stored codes as it is read (`--expert-weights int8` on CPU; the
    params are then `cpu.int8` PanelWeights, not arrays); other layers load as without it.
    Returns a LoadedLayer per layer in index order, params as numpy arrays in expertd's layouts.
    """
    plan = plan_checkpoint(path, layers=layers, num_layers=num_layers, dtype=dtype or dtypes.AUTO)
    out_dtype = quant.codecs.out_dtype_of(plan.dtype)
    where = f"checkpoint {plan.path}"
    with _open(plan.path) as stored:
        return [LoadedLayer(layer.index, layer.cfg,
                            load_layer(stored, layer.cfg, layer.tensors, plan.scheme, out_dtype, where, workers,
                                       keep_fp8=keep_fp8, fp8_as_int8=fp8_as_int8),
                            source=str(plan.path)) for layer in plan.layers]


def keeps_fp8(plan: CheckpointPlan) -> bool:
    """Whether the plan's routed experts can stay FP8: an FP8 checkpoint with square block scales
    of a power-of-two size (DeepSeek-V3 / Kimi / Qwen FP8: 128 x 128), e4m3 experts."""
    scheme = plan.scheme
    if scheme is None or scheme.method != "fp8" or scheme.block_size is None or scheme.expert_dtype == "fp4":
        return False
    block = scheme.block_size[0]
    return plan.stored_dtype == "F8_E4M3" and scheme.block_size[1] == block and block >= 16 and not block & (block - 1)


def _open(path: Path) -> StoredTensors:
    try:
        return StoredTensors(path)
    except StoredError as exc:
        raise CheckpointError(str(exc)) from exc


def _served_bytes(cfg: MoEConfig, dtype: str) -> int:
    out = quant.codecs.out_dtype_of(dtype)
    return sum(int(np.prod(shape)) * np.dtype(param_dtype(name, out)).itemsize
               for name, shape in param_shapes(cfg).items())


# ------------------------------------------------------------------------------- planning


def _holds(stored: StoredTensors, name: str, scheme) -> bool:
    try:
        quant.locate(name, stored, scheme)
        return True
    except quant.QuantError:
        return False


def _find_layer(stored, config, family: Family, index: int, cfg: MoEConfig, scheme, where) -> LayerTensors:
    """The prefixed LayerTensors of layer `index` the checkpoint holds, with every tensor checked."""
    try:
        candidates = models.layer_tensors(config, index)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    found = None
    for prefix in family.prefixes:
        for candidate in candidates:
            named = candidate.with_prefix(prefix.format(i=index))
            if named.router in stored and _holds(stored, named.experts.probe(), scheme):
                found = named
                break
        if found:
            break
    if found is None:
        looked = sorted({(p.format(i=index) + c.router) for p in family.prefixes for c in candidates})
        raise CheckpointError(f"{where}: MoE layer {index} ({family.name}): none of its router tensors is stored "
                              f"with its experts (looked for {', '.join(map(repr, looked))})")
    try:
        shapes = found.shapes(cfg)
    except ValueError as exc:
        raise CheckpointError(f"{where}: MoE layer {index}: {exc}") from exc
    for name, shape in shapes.items():
        try:
            located = quant.locate(name, stored, scheme)
        except quant.QuantError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        _check_header(stored, located, shape, name, where)
    return found


def _check_header(stored, located: quant.StoredWeight, shape, name, where) -> None:
    """A weight stored with its dense shape (float or e4m3, plain) must have `shape` (bias: [E] or [1, E])."""
    if located.layout != "plain":
        return
    try:
        dtype, found = stored.header(located.data)
    except StoredError as exc:
        raise CheckpointError(str(exc)) from exc
    if dtype not in _DENSE_STORED:
        return
    ok = found == tuple(shape) or (len(shape) == 1 and found == (1, shape[0]))
    if not ok:
        raise CheckpointError(f"{where}: tensor {name!r} has shape {list(found)}, expected {list(shape)} "
                              "from config.json")


def _stored_dtype(stored, name, scheme, where) -> str:
    try:
        return stored.header(quant.locate(name, stored, scheme).data)[0]
    except (quant.QuantError, StoredError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


