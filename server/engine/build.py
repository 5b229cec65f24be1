"""Start-up: from a configuration to an engine ready to warm up, each step applied once.

1. Layers: the preset or checkpoint the config names (``load_layers``), in the serving dtype
   ``serving_dtype`` picks (``--dtype auto``: the checkpoint's; logged with its reason); on one GPU
   a block-scaled FP8 checkpoint's routed experts stay FP8 (``keeps_fp8``), or on CPU with
   ``--expert-weights int8`` become INT8 as they load (``converts_fp8_to_int8``).
2. JAX's persistent compilation cache (``warmup.enable_compile_cache``).
3. Mesh (``placement``): the devices given (default: all; an int n takes the first n) form a 1-D
   mesh with axis "ep"; more than one device runs the expert-parallel layer, each layer's experts
   on E + N physical slots (N = --num-redundant-experts).
4. Weights (``weights.prepare``): placed once, laid out for the kernel that reads them.
5. Host memory (``host_memory``): on CPU, the placed weights onto transparent huge pages.
6. The Engine over them; ``Served.describe`` gives the front ends' read-only ModelDescription.

``Served.info()`` assembles what every part reports (the old ``Engine.info()``); ``Served.notes()``
are the lines ``expertd serve`` prints about the native kernel, huge pages and host malloc.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import jax
import numpy as np

from expertd.kernels import experts, moe
from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig
from expertd.server.engine import weights
from expertd.server.engine.description import MeshDescription, ModelDescription
from expertd.server.engine.engine import Engine
from expertd.server.engine.placement import AXIS, MeshPlacement, pick_devices, split_over_ep
from expertd.server.engine.warmup import enable_compile_cache
from expertd.server.host import allocator, memory
from expertd.server.models import dtypes
from expertd.server.models.checkpoint import keeps_fp8 as keeps_fp8_plan
from expertd.server.models.checkpoint import load_checkpoint, plan_checkpoint
from expertd.server.models.presets import LoadedLayer, load_preset

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Served:
    """What start-up built: the engine, the prepared weights' report, the huge pages' report (None
    off CPU or when skipped) and the compilation cache directory (None: off)."""

    engine: Engine
    weights: weights.PreparedWeights
    huge_pages: memory.HugePageReport | None
    compile_cache_dir: str | None

    def describe(self, name: str, batching: BatchingConfig) -> ModelDescription:
        """The read-only description the front ends validate requests against."""
        engine = self.engine
        return ModelDescription(
            name=name, layers={index: layer.cfg for index, layer in engine.layers.items()}, dtype=engine.dtype,
            buckets=engine.buckets, max_request_tokens=batching.max_request_tokens,
            max_batch_tokens=min(batching.batch_tokens, engine.buckets[-1]),
            mesh=MeshDescription(AXIS, len(engine.devices), engine.platform))

    def info(self) -> dict:
        """Layers (index, source, full config, params), dtype, buckets, mesh, backend, the weights'
        layout, compile counters and options, the native CPU kernel's status, the weights' huge pages
        and the process's host allocator state (CPU only)."""
        engine, on_cpu = self.engine, self.engine.platform == "cpu"
        return {
            "layers": [{"index": index, "source": layer.source, "config": dataclasses.asdict(layer.cfg),
                        "params": {name: {"shape": list(moe.logical_shape(p)), "dtype": _dtype_name(p),
                                          "split_over_ep": split_over_ep(p)} for name, p in layer.params.items()},
                        "expert_placement": _placement_info(engine.expert_placement(index))}
                       for index, layer in sorted(engine.layers.items())],
            "dtype": engine.dtype.name,
            "buckets": list(engine.buckets),
            "mesh": {"axis": AXIS, "size": len(engine.devices), "platform": engine.platform,
                     "devices": [str(d) for d in engine.devices], "expert_parallel": engine.placement.ep is not None},
            "backend": engine.backend,
            "weight_layout": self.weights.layout,
            "panel_columns": self.weights.panel_columns,
            "expert_weights": self.weights.expert_weights,
            "compile_cache_dir": self.compile_cache_dir,
            "native_cpu_kernel": self.weights.native_cpu,
            "huge_pages": None if self.huge_pages is None else self.huge_pages.as_dict(),
            "host_allocator": allocator.state().as_dict() if on_cpu else None,
            **engine.compile_info(),
        }

    def notes(self) -> list[str]:
        """The start-up summary lines about the native CPU kernel, the weights' pages and host malloc (CPU only)."""
        info = self.info()
        lines = (weights.native_cpu_note(info["native_cpu_kernel"], info["panel_columns"], info["expert_weights"]),
                 memory.note(info["huge_pages"]), allocator.note(info["host_allocator"]))
        return [line for line in lines if line]


def _dtype_name(param) -> str:
    """A param's dtype for ``info()``; FP8 expert weights: their codes' and that they are block-scaled."""
    if experts.is_fp8(param):
        return f"{param.codes.dtype} ({param.block}x{param.block} block scales, computed in {param.dtype})"
    return str(param.dtype)


def _placement_info(placement) -> dict | None:
    """A layer's physical expert placement for ``info()`` (None without expert parallelism)."""
    if placement is None:
        return None
    return {"physical_to_logical": placement.physical_to_logical.tolist(),
            "replica_counts": placement.replica_counts.tolist(), "num_redundant": placement.num_redundant}


def serving_dtype(model: ModelConfig) -> tuple[str, str]:
    """(dtype, why) the model is served in: ``--dtype`` as given, or ``auto``'s choice
    (``expertd.server.models.dtypes``; a checkpoint's is planned from config.json and the headers).
    CheckpointRefused (a ValueError) for a checkpoint expertd does not serve."""
    if model.checkpoint is None:
        return dtypes.choose(model.dtype, preset=True)
    plan = plan_checkpoint(model.checkpoint, layers=model.layers, num_layers=model.num_layers, dtype=model.dtype)
    return plan.dtype, plan.dtype_reason


# The expert backends that read FP8 expert weights in their kernels (the others would dequantise
# them on every step: dequantising at load is then cheaper).
FP8_READING_BACKENDS = ("auto", "pallas", "tokamax")


def keeps_fp8(model: ModelConfig, devices: Sequence) -> bool:
    """Whether the routed experts of ``model``'s checkpoint are served in FP8 as stored: ``--dtype
    auto``, a block-scaled FP8 checkpoint (``checkpoint.keeps_fp8``), one GPU (the expert-parallel
    layer and the CPU's kernels read dense weights: the CPU dequantises at load) and a backend of
    FP8_READING_BACKENDS ("auto" runs "pallas" on FP8 weights, ``experts.choose_backend``)."""
    if model.checkpoint is None or model.dtype != dtypes.AUTO or model.backend not in FP8_READING_BACKENDS:
        return False
    if len(devices) != 1 or devices[0].platform != "gpu":
        return False
    return keeps_fp8_plan(plan_checkpoint(model.checkpoint, layers=model.layers, num_layers=model.num_layers))


def converts_fp8_to_int8(model: ModelConfig, devices: Sequence) -> bool:
    """Whether the routed experts of ``model``'s checkpoint become INT8 weights as they load,
    converted from their FP8 codes (never dequantised to ``--dtype``): ``--expert-weights int8``
    where it is served (one CPU device in one process, panel weights, ``weights.int8_kernel_serves``)
    on a block-scaled FP8 checkpoint (``checkpoint.keeps_fp8``)."""
    if model.checkpoint is None or model.expert_weights != "int8" or not model.panel_weights:
        return False
    if len(devices) != 1 or devices[0].platform != "cpu" or jax.process_count() != 1:
        return False
    if not weights.int8_kernel_serves(model.backend):
        return False
    return keeps_fp8_plan(plan_checkpoint(model.checkpoint, layers=model.layers, num_layers=model.num_layers))


def load_layers(config: ServerConfig, dtype: str | None = None, keep_fp8: bool = False,
                fp8_as_int8: bool = False) -> list[LoadedLayer]:
    """The LoadedLayers the config asks for, in ``dtype`` (default: ``serving_dtype``'s choice;
    ``keep_fp8``: block-scaled FP8 routed experts as stored, see ``keeps_fp8``; ``fp8_as_int8``:
    converted to INT8 as they load, see ``converts_fp8_to_int8``); ValueError naming the option on
    bad input."""
    model = config.model
    dtype = dtype or serving_dtype(model)[0]
    if model.checkpoint is not None:
        return load_checkpoint(model.checkpoint, layers=model.layers, num_layers=model.num_layers, dtype=dtype,
                               keep_fp8=keep_fp8, fp8_as_int8=fp8_as_int8)
    return load_preset(model.preset or "tiny", num_layers=model.num_layers, layers=model.layers,
                       dtype=dtype, seed=model.seed)


def build_served(config: ServerConfig, layers: Sequence[LoadedLayer] | None = None) -> Served:
    """Start-up steps 1-6 for ``config`` (``layers`` instead of loading ``config.model``)."""
    model = config.model
    cache = os.path.expanduser(config.compile_cache_dir) if config.compile_cache_dir else None
    dtype, why = serving_dtype(model)
    log.info("serving dtype %s (%s)", dtype, why)
    devices = pick_devices(model.num_devices)
    keep = layers is None and keeps_fp8(model, devices)
    as_int8 = layers is None and converts_fp8_to_int8(model, devices)
    if keep:
        log.info("routed experts kept in FP8 as stored (block-scaled e4m3; the GPU's expert kernels read them)")
    if as_int8:
        log.info("routed experts converted from their FP8 codes to INT8 as they load (never dequantised)")
    return build_engine(load_layers(config, dtype, keep, as_int8) if layers is None else layers,
                        buckets=config.batching.bucket_sizes,
                        dtype=dtype, devices=model.num_devices, backend=model.backend, compile_cache_dir=cache,
                        huge_pages=model.huge_pages, panel_weights=model.panel_weights,
                        num_redundant_experts=model.num_redundant_experts, expert_weights=model.expert_weights)


def build_engine(layers: Sequence[LoadedLayer], *, buckets: Sequence[int], dtype="bfloat16", devices=None,
                 backend: str = "auto", compile_cache_dir=None, huge_pages: bool = True,
                 panel_weights: bool = True, num_redundant_experts: int = 0, expert_weights: str = "dtype") -> Served:
    """Start-up steps 2-6 for ``layers`` (values as the config has checked them: buckets ascending
    and unique, dtype float32 / bfloat16, backend "auto" or a kernel backend)."""
    if compile_cache_dir is not None:
        enable_compile_cache(compile_cache_dir)
    placement = MeshPlacement(pick_devices(devices), num_redundant_experts=num_redundant_experts)
    prepared = weights.prepare(layers, placement, np.dtype(dtype), backend=backend, panel_weights=panel_weights,
                               expert_weights=expert_weights)
    log.info("expert weights served as %s", prepared.expert_weights)
    pages = None
    if huge_pages and placement.devices[0].platform == "cpu":
        pages = memory.advise_huge_pages(jax.tree.leaves([layer.params for layer in prepared.layers]))
        log.info("weights: %s", memory.summary(pages.as_dict()))
    engine = Engine(prepared.layers, placement, dtype=dtype, buckets=buckets, backend=backend)
    return Served(engine, prepared, pages, None if compile_cache_dir is None else str(compile_cache_dir))
