"""Load one planned MoE layer of a checkpoint into expertd's layouts (the second step of
`expertd.server.models.checkpoint`, which plans it and is the door; this module only reads).

`load_layer(stored, plan, scheme, out_dtype, where, workers) -> {param name: numpy array}`: every
MoEParams field the layer's config needs (`expertd.kernels.params.param_shapes`), read through the
family's tensor names (`models.family.LayerTensors`):
  router_weight [H, E] fp32            the router Linear `[E, H]`, transposed
  expert_bias [E] fp32                 the selection bias (stored `[E]` or `[1, E]`)
  router_bias [E] fp32                 the router Linear's bias (gpt-oss)
  tid2eid [V, k] int32                 a hash-routed layer's table (stored any int dtype; every
                                       entry checked to be an expert id in [0, E))
  w_gate, w_up [E, H, I], w_down [E, I, H]   out_dtype, one expert at a time on `workers` threads
                                       (`keep_fp8`: block-scaled FP8 experts as stored, Fp8BlockWeights;
                                       `fp8_as_int8`: INT8 weights converted from them, cpu.int8)
  b_gate, b_up [E, I], b_down [E, H]   out_dtype; gate / up split from `gate_up [E, 2I]` (halves
                                       or interleaved columns, as the weight's)
  router_input_scale [H] fp32          Gemma 4's router.scale * H**-0.5
  per_expert_scale [E] fp32, expert_input_norm_weight, expert_output_norm_weight [H] fp32
  shared_w_gate, shared_w_up [H, Is], shared_w_down [Is, H], shared_gate [H, 1]   out_dtype
Host memory peaks at the outputs plus, per worker thread, one expert's tensors and the
dequantiser's chunk temporaries; the pages read are dropped from the process (`stored.release`).
Problems raise `CheckpointError` naming the tensor.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from expertd.kernels import cpu, experts
from expertd.kernels.config import MoEConfig
from expertd.server.models import quant
from expertd.server.models.family import LayerTensors
from expertd.server.models.host_arrays import copy_into, copy_new, host_empty
from expertd.server.models.stored import StoredError, StoredTensors


class CheckpointError(ValueError):
    """A checkpoint cannot be served as asked; the message names the file, tensor or layer."""


class NotKept(Exception):
    """A routed expert weight that cannot stay FP8 (not stored block-scaled FP8, or cut off its
    blocks): the layer is loaded dense instead."""


class KeptFp8:
    """A block-scaled FP8 weight kept as stored: `codes` float8_e4m3fn `[R, C]` (a view of the
    stored tensor), `scales` float32 `[ceil(R / block), ceil(C / block)]`. Stands in for the dense
    array a family layout reads: `.T` and block-aligned slices keep codes and scales together."""

    def __init__(self, codes, scales, block: int):
        self.codes, self.scales, self.block = codes, scales, block

    @property
    def shape(self):
        return self.codes.shape

    @property
    def T(self):  # noqa: N802 (numpy's name)
        return KeptFp8(self.codes.T, self.scales.T, self.block)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        cut = []
        for dim, part in zip(self.codes.shape, index):
            if not isinstance(part, slice):
                raise NotKept(f"an index {part!r} into FP8 codes")
            start, stop, step = part.indices(dim)
            if step != 1 or start % self.block or (stop % self.block and stop != dim):
                raise NotKept(f"a slice {part!r} that cuts FP8 scale blocks of {self.block}")
            cut.append((slice(start, stop), slice(start // self.block, -(-stop // self.block))))
        return KeptFp8(self.codes[tuple(c for c, _ in cut)], self.scales[tuple(b for _, b in cut)], self.block)


class _Reader:
    """Dense weights of one layer for the layouts of `models.family` (see its `reader` contract).
    One reader per thread: it remembers the stored tensors (or expert slices) it read, and
    `release` drops their pages from the process. `keep_fp8`: block-scaled FP8 weights come back
    as `KeptFp8` (NotKept for any other)."""

    def __init__(self, stored: StoredTensors, scheme, out_dtype, where: str, keep_fp8: bool = False):
        self.stored, self.scheme, self.out_dtype, self.where = stored, scheme, out_dtype, where
        self.keep_fp8 = keep_fp8
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
            kept = quant.fp8_blocks(name, view, self.scheme) if self.keep_fp8 else None
            if self.keep_fp8 and kept is None:
                raise NotKept(f"tensor {name!r} is not stored as block-scaled FP8")
            if kept is not None:
                array = KeptFp8(*kept)
            elif dense_stored and dtype is None:
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


def load_layer(stored: StoredTensors, cfg: MoEConfig, names: LayerTensors, scheme, out_dtype, where: str,
               workers: int, keep_fp8: bool = False, fp8_as_int8: bool = False) -> dict:
    """The params of one layer (see the module docstring). `keep_fp8`: routed experts stored as
    block-scaled FP8 stay so, as `experts.Fp8BlockWeights` of host arrays (codes `[E, H, I]` /
    `[E, I, H]` e4m3, fp32 block scales). `fp8_as_int8`: they become the native CPU kernel's INT8
    weights instead, each expert converted from its stored codes as it is read
    (`cpu.int8.Int8FromFp8`: never dense, never copied as FP8). Either way a layer whose experts
    are not all stored so is loaded dense as without it."""
    e, h = cfg.num_experts, cfg.hidden_size
    reader = _Reader(stored, scheme, out_dtype, where)
    params = {"router_weight": copy_new(reader.dense(names.router, (e, h), dtype=np.float32).T, np.float32)}
    if cfg.use_expert_bias:
        params["expert_bias"] = np.array(reader.dense(names.bias, (e,), dtype=np.float32), np.float32).reshape(e)
    try:
        routed = _routed_experts(stored, cfg, names, scheme, out_dtype, where, workers, keep_fp8 or fp8_as_int8,
                                 fp8_as_int8)
    except NotKept:
        routed = _routed_experts(stored, cfg, names, scheme, out_dtype, where, workers, False)
    params.update(routed)
    if cfg.has_shared:
        s, shared = cfg.shared_intermediate_size, names.shared
        params["shared_w_gate"] = copy_new(reader.dense(shared.gate, (s, h)).T, out_dtype)
        params["shared_w_up"] = copy_new(reader.dense(shared.up, (s, h)).T, out_dtype)
        params["shared_w_down"] = copy_new(reader.dense(shared.down, (h, s)).T, out_dtype)
        if cfg.shared_expert_gate:
            params["shared_gate"] = copy_new(reader.dense(shared.gate_weight, (1, h)).T, out_dtype)
    params.update(_semantic_params(reader, cfg, names, out_dtype))
    reader.release()
    return params


def _routed_experts(stored, cfg: MoEConfig, names: LayerTensors, scheme, out_dtype, where: str, workers: int,
                    keep_fp8: bool, as_int8: bool = False) -> dict:
    """w_gate, w_up, w_down: dense in out_dtype, or with `keep_fp8` Fp8BlockWeights, or with
    `as_int8` too INT8 panels converted from the codes (NotKept where an expert weight is not
    block-scaled FP8)."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    shapes = ((e, h, i), (e, h, i), (e, i, h))
    if keep_fp8:
        first = names.experts.expert(_Reader(stored, scheme, out_dtype, where, keep_fp8=True), 0, e, h, i)
        block = first[0].block
        if any(w.block != block for w in first):
            raise NotKept("the projections' FP8 blocks differ")
    if as_int8:
        outs = [cpu.int8.Int8FromFp8(*shape, block, empty=host_empty) for shape in shapes]
    elif keep_fp8:
        outs = [(host_empty(shape, quant.codecs.E4M3), np.empty((e, -(-shape[1] // block), -(-shape[2] // block)),
                                                                  np.float32)) for shape in shapes]
    else:
        outs = [host_empty(shape, out_dtype) for shape in shapes]

    def load_expert(j: int) -> None:  # the host holds the outputs plus one expert's tensors per worker
        expert_reader = _Reader(stored, scheme, out_dtype, where, keep_fp8=keep_fp8)
        for out, weight in zip(outs, names.experts.expert(expert_reader, j, e, h, i)):
            if keep_fp8 and weight.block != block:
                raise NotKept("the experts' FP8 blocks differ")
            if as_int8:  # the stored [out, in] codes, read once (no GIL held)
                try:
                    out.add(j, weight.codes.T, weight.scales)
                except ValueError as exc:
                    raise CheckpointError(f"{where}: {exc}") from exc
            elif keep_fp8:
                out[0][j] = weight.codes  # 1-byte codes: numpy's strided copy
                out[1][j] = weight.scales
            else:
                copy_into(out[j], weight)
        expert_reader.release()

    if workers > 1 and e > 1:
        with ThreadPoolExecutor(min(workers, e)) as pool:
            list(pool.map(load_expert, range(e)))  # numpy releases the GIL in the decoders and copies
    else:
        for j in range(e):
            load_expert(j)
    if as_int8:
        outs = [out.weights() for out in outs]
    elif keep_fp8:
        outs = [experts.Fp8BlockWeights(codes, scales, block) for codes, scales in outs]
    return dict(zip(("w_gate", "w_up", "w_down"), outs))


def _semantic_params(reader: _Reader, cfg: MoEConfig, names: LayerTensors, out_dtype) -> dict:
    """The family-semantics fields of the module docstring that `cfg` switches on."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    out = {}

    def vector(name, size):
        return np.array(reader.dense(name, (size,), dtype=np.float32), np.float32).reshape(size)

    if cfg.router_bias:
        out["router_bias"] = vector(names.router_bias, e)
    if cfg.hash_routed:
        out["tid2eid"] = _hash_table(reader, names.tid2eid, (cfg.hash_vocab_size, cfg.topk), e)
    if cfg.expert_proj_bias:
        gate_up = reader.dense(names.proj_bias.gate_up, (e, 2 * i))
        gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if names.proj_bias.interleaved else \
            (gate_up[:, :i], gate_up[:, i:])
        out.update(b_gate=copy_new(gate, out_dtype), b_up=copy_new(up, out_dtype),
                   b_down=copy_new(reader.dense(names.proj_bias.down, (e, h)), out_dtype))
    if cfg.router_input_norm:
        scale = vector(names.norms.router_scale, h)
        out["router_input_scale"] = (scale * np.float32(h ** -0.5)).astype(np.float32)
    if cfg.per_expert_scale:
        out["per_expert_scale"] = vector(names.norms.per_expert_scale, e)
    if cfg.expert_input_norm:
        out["expert_input_norm_weight"] = vector(names.norms.input_norm, h)
    if cfg.expert_output_norm:
        out["expert_output_norm_weight"] = vector(names.norms.output_norm, h)
    return out


def _hash_table(reader: _Reader, name: str, shape: tuple[int, int], num_experts: int) -> np.ndarray:
    """tid2eid `[V, k]` as int32, every entry an expert id in [0, E) (CheckpointError naming the first bad one)."""
    try:
        table = reader.stored[name]
    except StoredError as exc:
        raise CheckpointError(f"{reader.where}: {exc}") from exc
    if not np.issubdtype(table.dtype, np.integer) or table.shape != shape:
        raise CheckpointError(f"{reader.where}: tensor {name!r} must be an integer table {list(shape)} (token id -> "
                              f"k expert ids), got {table.dtype} {list(table.shape)}")
    bad = np.argwhere((table < 0) | (table >= num_experts))
    if len(bad):
        r, col = (int(v) for v in bad[0])
        raise CheckpointError(f"{reader.where}: tensor {name!r}: entry [{r}, {col}] = {int(table[r, col])} is not an "
                              f"expert id in [0, {num_experts})")
    reader.touched.append((name, None, 1))
    return table.astype(np.int32)
