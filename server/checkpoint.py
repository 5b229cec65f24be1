"""Load the MoE layers of a Hugging Face checkpoint directory (config.json + *.safetensors).

Supported families (config.json `architectures[0]` / `model_type`) and their tensors, as named by
transformers' modelling code (`nn.Linear.weight` is `[out_features, in_features]`):

| family | router | routed expert j | shared expert |
|---|---|---|---|
| Mixtral (`mixtral`) | `block_sparse_moe.gate.weight [E,H]` | `block_sparse_moe.experts.j.{w1,w3,w2}.weight` | - |
| Qwen2-MoE (`qwen2_moe`) | `mlp.gate.weight [E,H]` | `mlp.experts.j.{gate,up,down}_proj.weight` | `mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight [1,H]` |
| Qwen3-MoE (`qwen3_moe`) | `mlp.gate.weight [E,H]` | as Qwen2-MoE | - |
| DeepSeek-V3 (`deepseek_v3`) | `mlp.gate.weight [E,H]`, `mlp.gate.e_score_correction_bias [E]` | as Qwen2-MoE | `mlp.shared_experts.{gate,up,down}_proj.weight` |

all under `model.layers.<index>.`. w1 / gate_proj is the gated (activated) projection, w3 / up_proj
the linear one, w2 / down_proj the output. Which layers are MoE follows the modelling code
(`expertd.server.model.moe_layer_indices`): DeepSeek-V3's first `first_k_dense_replace` layers and
Qwen's `mlp_only_layers` are dense MLPs and cannot be served.

Tensors are read through safetensors' `safe_open` (memory-mapped files; the index file of a sharded
checkpoint says which file holds which tensor), one expert at a time, transposed into expertd's
layouts (`router_weight [H,E]` fp32, `w_gate/w_up [E,H,I]`, `w_down [E,I,H]`, `shared_w_* [H,Is] /
[Is,H]`, `shared_gate [H,1]`, `expert_bias [E]` fp32). Only the layers asked for are read.
Every problem raises `CheckpointError` (a ValueError) that names the file or tensor.
"""  # noqa: E501 - the table rows are as long as the tensor names
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from expertd.kernels.moe import MoEConfig, param_shapes
from expertd.server.model import LoadedLayer, moe_layer_indices, select_layers
from expertd.server.models.hf_config import moe_config_from_hf

INDEX_FILE = "model.safetensors.index.json"

# model_type -> (architecture class name, MoE block prefix, routed expert projection names
# for (w_gate, w_up, w_down), shared expert module name or None)
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), None),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_expert"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), None),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts"),
}
_UNREADABLE_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I4", "U4")


class CheckpointError(ValueError):
    """A checkpoint cannot be served as asked; the message names the file, tensor or layer."""


def read_config(path) -> dict:
    """config.json of checkpoint directory `path`, with its family checked (see `family_of`)."""
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


def family_of(config: dict, *, where: str = "checkpoint") -> str:
    """The supported family (model_type) of an HF config, or CheckpointError naming what it is."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    by_arch = {arch: family for family, (arch, *_rest) in FAMILIES.items()}
    family = model_type if model_type in FAMILIES else next(
        (by_arch[a] for a in architectures if a in by_arch), None)
    if family is None:
        supported = ", ".join(f"{arch} ({family})" for family, (arch, *_r) in FAMILIES.items())
        raise CheckpointError(
            f"{where}: unsupported architecture {architectures or None} (model_type {model_type!r}); "
            f"supported: {supported}")
    return family


def load_checkpoint(path, *, layers: Sequence[int] | str | None = None, dtype=None) -> list[LoadedLayer]:
    """Load MoE layers of the HF checkpoint directory `path`.

    Args:
      path: directory with config.json and model.safetensors, or model-*.safetensors shards (with
        model.safetensors.index.json, or without it: then every *.safetensors file is scanned).
      layers: MoE layer indices to load (a list or a "1,3-5" string); default all MoE layers.
      dtype: dtype of the expert weights (e.g. "bfloat16"); default as stored. The router weight
        and the expert bias are always fp32.

    Returns:
      LoadedLayer per layer, in index order, params as numpy arrays in expertd's layouts.
    """
    path = Path(path)
    config = read_config(path)
    family = family_of(config, where=str(path))
    try:
        chosen = select_layers(moe_layer_indices(config), layers=layers, num_layers=None,
                               what=f"checkpoint {path} ({family})")
        cfg = moe_config_from_hf({**config, "model_type": family})
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # bad layer selection or config.json values
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    with _TensorFiles(path) as files:
        return [LoadedLayer(index, cfg, _load_layer(files, family, index, cfg, dtype), source=str(path))
                for index in chosen]


def _load_layer(files: _TensorFiles, family: str, index: int, cfg: MoEConfig, dtype) -> dict:
    _arch, block_name, expert_names, shared_name = FAMILIES[family]
    block = f"model.layers.{index}.{block_name}"
    shapes = param_shapes(cfg)
    h, e = cfg.hidden_size, cfg.num_experts
    params = {"router_weight": files.read(f"{block}.gate.weight", (e, h), np.float32).T.copy()}
    if "expert_bias" in shapes:
        params["expert_bias"] = files.read(f"{block}.gate.e_score_correction_bias", (e,), np.float32)
    first = f"{block}.experts.0.{expert_names[0]}.weight"
    store = files.dtype_of(first) if dtype is None else jnp.dtype(dtype)
    for param, hf_name in zip(("w_gate", "w_up", "w_down"), expert_names):
        shape = shapes[param]
        stacked = np.empty(shape, store)
        for j in range(e):  # one expert at a time: the host holds the result plus one expert
            stacked[j] = files.read(f"{block}.experts.{j}.{hf_name}.weight", tuple(reversed(shape[1:])), store).T
        params[param] = stacked
    if shared_name is not None and "shared_w_gate" in shapes:
        for param, proj in (("shared_w_gate", "gate_proj"), ("shared_w_up", "up_proj"),
                            ("shared_w_down", "down_proj")):
            shape = shapes[param]
            params[param] = files.read(f"{block}.{shared_name}.{proj}.weight", shape[::-1], store).T.copy()
        if "shared_gate" in shapes:
            params["shared_gate"] = files.read(f"{block}.shared_expert_gate.weight", (1, h), store).T.copy()
    return params


class _TensorFiles:
    """Tensor name -> safetensors file of one checkpoint, with the files opened lazily (mmap)."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[Path, object] = {}
        index_file = path / INDEX_FILE
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint {path}: {INDEX_FILE} has no valid weight_map ({exc})") from exc
            self.location = {name: path / file for name, file in weight_map.items()}
            for file in sorted(set(self.location.values())):
                if not file.is_file():
                    raise CheckpointError(f"checkpoint {path}: {file.name} (listed in {INDEX_FILE}) is missing")
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"checkpoint {path}: no *.safetensors files")
            self.location = {name: shard for shard in shards for name in self._open(shard).keys()}

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="np").__enter__()
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"checkpoint {self.path}: cannot read {file.name}: {exc}") from exc
        return self._handles[file]

    def _slice(self, name: str):
        if name not in self.location:
            raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} is missing")
        return self._open(self.location[name]).get_slice(name)

    def dtype_of(self, name: str):
        stored = self._slice(name).get_dtype()
        self._check_readable(name, stored)
        return {"BF16": jnp.dtype(jnp.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
                "F64": np.dtype(np.float64)}.get(stored, np.dtype(np.float32))

    def _check_readable(self, name: str, stored: str):
        if stored in _UNREADABLE_DTYPES:
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {name!r} is stored as {stored} (a quantized checkpoint); "
                "expertd loads float32 / bfloat16 / float16 weights: dequantize the checkpoint first")

    def read(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """Tensor `name`, checked to have `shape`, converted to `dtype`."""
        tensor_slice = self._slice(name)
        found = tuple(tensor_slice.get_shape())
        if found != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {name!r} has shape {list(found)}, expected "
                f"{list(shape)} from config.json")
        self._check_readable(name, tensor_slice.get_dtype())
        file = self.location[name]
        return np.asarray(self._open(file).get_tensor(name)).astype(dtype, copy=False)
