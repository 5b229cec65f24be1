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
   whole.

Every problem raises `CheckpointError` (a ValueError) naming the file, tensor, layer or key.
A native FP8 path on GPU would keep step 1 and, instead of step 2's dequantisation, take each
weight's stored codes and scales as `quant.locate` names them.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from expertd.kernels.config import MoEConfig
from expertd.kernels.params import ROUTER_FIELDS, param_shapes
from expertd.server import models
from expertd.server.model import LoadedLayer, select_layers
from expertd.server.models import dtypes, quant
from expertd.server.models.family import Family, LayerTensors
from expertd.server.models.stored import StoredError, StoredTensors

_DENSE_STORED = ("F32", "BF16", "F16", "F64", "F8_E4M3")  # stored with their dense shape
TILE = 256  # rows and columns of the blocks a transposing copy moves at a time
_INTEGER_VIEWS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
DEFAULT_WORKERS = min(16, os.cpu_count() or 1)
HUGE_ALLOCATION = 16 << 20  # outputs at least this large get their own huge-page mapping


class CheckpointError(ValueError):
    """A checkpoint cannot be served as asked; the message names the file, tensor or layer."""


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
                    dtype: str | None = None, workers: int = DEFAULT_WORKERS) -> list[LoadedLayer]:
    """The MoE layers of the checkpoint at `path` (see the module docstring, step 2).

    layers / num_layers: as `plan_checkpoint`. dtype: the expert weights' dtype, "float32" /
    "bfloat16", or None / "auto" for `--dtype auto`'s choice. Router weight and bias are fp32.
    workers: threads reading a layer's experts (each holds one expert's temporaries).
    Returns a LoadedLayer per layer in index order, params as numpy arrays in expertd's layouts.
    """
    plan = plan_checkpoint(path, layers=layers, num_layers=num_layers, dtype=dtype or dtypes.AUTO)
    out_dtype = quant.codecs.out_dtype_of(plan.dtype)
    where = f"checkpoint {plan.path}"
    with _open(plan.path) as stored:
        return [LoadedLayer(layer.index, layer.cfg, _load_layer(stored, layer, plan.scheme, out_dtype, where, workers),
                            source=str(plan.path)) for layer in plan.layers]


def _open(path: Path) -> StoredTensors:
    try:
        return StoredTensors(path)
    except StoredError as exc:
        raise CheckpointError(str(exc)) from exc


def _served_bytes(cfg: MoEConfig, dtype: str) -> int:
    size = np.dtype(quant.codecs.out_dtype_of(dtype)).itemsize
    return sum(int(np.prod(shape)) * (4 if name in ROUTER_FIELDS else size)
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


# ------------------------------------------------------------------------------- loading


class _Reader:
    """Dense weights of one layer for the layouts of `models.family` (see its `reader` contract).
    One reader per thread: it remembers the stored tensors (or expert slices) it read, and
    `release` drops their pages from the process."""

    def __init__(self, stored: StoredTensors, scheme, out_dtype, where: str):
        self.stored, self.scheme, self.out_dtype, self.where = stored, scheme, out_dtype, where
        self.touched: list[tuple[str, int | None, int]] = []

    def dense(self, name: str, shape, expert: int | None = None, num_experts: int | None = None,
              dtype=None, in_out: bool = False) -> np.ndarray:
        try:
            found = quant.locate(name, self.stored, self.scheme)
            parts = num_experts or shape[0]
            self.touched += [(n, expert, parts) for n in found.names]
            view = self.stored if expert is None else _ExpertSlice(self.stored, found, expert, parts)
            data = view[found.data]
            dense_stored = found.layout == "plain" and data.dtype in quant.names.DENSE_DTYPES
            if num_experts and not dense_stored:
                raise CheckpointError(f"{self.where}: tensor {name!r}: quantised flat [E * rows, columns] expert "
                                      "tensors are not supported (their scale blocks may straddle experts)")
            if dense_stored and dtype is None:
                array = data  # cast by the copy into the served array
            else:
                array = quant.dequantize(name, view, self.scheme, dtype or self.out_dtype)
                if found.layout == "mxfp4" and in_out:  # MXFP4 rows are outputs; the parameter is [.., in, out]
                    array = np.swapaxes(array, -1, -2)
        except (quant.QuantError, StoredError) as exc:
            raise CheckpointError(f"{self.where}: {exc}") from exc
        expected = tuple(shape) if expert is None else \
            ((shape[0] // num_experts, *shape[1:]) if num_experts else tuple(shape[1:]))
        if array.shape != expected and not (len(expected) == 1 and array.shape == (1, *expected)):
            what = f"tensor {name!r}" + ("" if expert is None else f" (expert {expert})")
            raise CheckpointError(f"{self.where}: {what} has shape {list(array.shape)} once read, expected "
                                  f"{list(expected)} from config.json")
        return array

    def release(self) -> None:
        for name, part, parts in self.touched:
            whole = part is None or len(self.stored.header(name)[1]) < 2
            self.stored.release(name, None if whole else part, parts)
        self.touched.clear()


class _ExpertSlice(Mapping):
    """The stored tensors of one weight, sliced to expert `j` on their leading expert axis."""

    def __init__(self, stored: StoredTensors, found: quant.StoredWeight, j: int, num_experts: int):
        self.stored, self.names, self.j, self.e = stored, set(found.names), j, num_experts

    def __contains__(self, name) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> np.ndarray:
        array = self.stored[name]
        if name.endswith("_shape") and array.ndim == 1:  # compressed-tensors' dense shape: drop the E
            return array[1:]
        if array.ndim >= 2 and array.shape[0] == self.e:
            return array[self.j]
        if array.ndim >= 2 and array.shape[0] % self.e == 0:  # flat [E*R, C]
            return array.reshape(self.e, -1, *array.shape[1:])[self.j]
        return array  # one scale for the whole tensor

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _load_layer(stored: StoredTensors, layer: LayerPlan, scheme, out_dtype, where: str, workers: int) -> dict:
    cfg, names = layer.cfg, layer.tensors
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    reader = _Reader(stored, scheme, out_dtype, where)
    params = {"router_weight": _copy(reader.dense(names.router, (e, h), dtype=np.float32).T, np.float32)}
    if cfg.use_expert_bias:
        params["expert_bias"] = np.array(reader.dense(names.bias, (e,), dtype=np.float32), np.float32).reshape(e)
    w_gate, w_up, w_down = (host_empty(shape, out_dtype) for shape in ((e, h, i), (e, h, i), (e, i, h)))

    def load_expert(j: int) -> None:  # the host holds the outputs plus one expert's tensors per worker
        expert_reader = _Reader(stored, scheme, out_dtype, where)
        gate, up, down = names.experts.expert(expert_reader, j, e, h, i)
        copy_into(w_gate[j], gate)
        copy_into(w_up[j], up)
        copy_into(w_down[j], down)
        expert_reader.release()

    if workers > 1 and e > 1:
        with ThreadPoolExecutor(min(workers, e)) as pool:
            list(pool.map(load_expert, range(e)))  # numpy releases the GIL in the decoders and copies
    else:
        for j in range(e):
            load_expert(j)
    params.update(w_gate=w_gate, w_up=w_up, w_down=w_down)
    if cfg.has_shared:
        s, shared = cfg.shared_intermediate_size, names.shared
        params["shared_w_gate"] = _copy(reader.dense(shared.gate, (s, h)).T, out_dtype)
        params["shared_w_up"] = _copy(reader.dense(shared.up, (s, h)).T, out_dtype)
        params["shared_w_down"] = _copy(reader.dense(shared.down, (h, s)).T, out_dtype)
        if cfg.shared_expert_gate:
            params["shared_gate"] = _copy(reader.dense(shared.gate_weight, (1, h)).T, out_dtype)
    reader.release()
    return params


def host_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array; a large one in its own anonymous mapping marked MADV_HUGEPAGE, so
    writing it faults in 2 MiB pages rather than 4 KiB ones (where THP is in "madvise" mode)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    if count * dtype.itemsize < HUGE_ALLOCATION or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype, count).reshape(shape)


def _copy(array, dtype) -> np.ndarray:
    out = np.empty(array.shape, dtype)
    copy_into(out, array)
    return out


def copy_into(out: np.ndarray, src: np.ndarray) -> None:
    """`out[...] = src` for 2-D arrays of any strides (a transposed view), cast to out's dtype.

    A transposed source is copied TILE x TILE at a time, so reads and writes both stay in cache, and
    equal dtypes move as same-size integers (numpy's strided copy of ml_dtypes' bfloat16 is slow)."""
    if src.ndim != 2 or src.flags.c_contiguous:
        out[...] = src
        return
    if src.dtype == out.dtype and src.dtype.itemsize in _INTEGER_VIEWS:
        out, src = out.view(_INTEGER_VIEWS[src.dtype.itemsize]), src.view(_INTEGER_VIEWS[src.dtype.itemsize])
    rows, cols = out.shape
    for r in range(0, rows, TILE):
        for c in range(0, cols, TILE):
            out[r:r + TILE, c:c + TILE] = src[r:r + TILE, c:c + TILE]
