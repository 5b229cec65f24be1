"""The served weights, prepared once at start-up: placed on the mesh, then laid out for the kernel
that reads them.

1. Placement (``expertd.server.engine.placement``): each layer's params on the mesh once, as
   ``MoEParams``; expert weights in the engine dtype, router weight and expert bias in fp32; seeded
   preset weights generated straight into their device layout.
2. Layout: ``moe.prepare_params`` once per layer (on CPU, where the native kernel runs every
   forward: its own layout, same outputs, read faster; with ``--backend tokamax`` on a GPU, FP8
   expert codes held as its kernels read them; elsewhere the params unchanged).
   ``panel_weights=False`` keeps the layout as loaded. ``expert_weights="int8"`` quantises the
   routed expert weights to INT8 panels instead (W8A16, ``expertd.kernels.cpu.int8``): served on
   one CPU process without expert parallelism only, where the native kernel runs every forward.

This module is the server's one caller of the kernels' weight-preparation and native-kernel
status APIs (``moe.prepare_params``, ``cpu.describe``, the NUMA plan's ``cpu.numa`` for its log line).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np

from expertd.kernels import cpu, moe
from expertd.server.engine.placement import MeshPlacement
from expertd.server.models.presets import LoadedLayer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """What ``prepare`` made.

    layers: the layers, their params now the placed, prepared ``MoEParams`` (the host copies are
      released once the caller drops its own).
    layout: the routed expert weights' layout: "panels" (the native CPU kernel's) or "row_major".
    panel_columns: the panels' width (None: row-major).
    native_cpu: on CPU, whether the C++ expert kernel (auto's choice there) is usable, why not, and
      the instruction-set level it runs at and what the AMX probe found ({"available", "reason",
      "isa", "amx"}); None elsewhere.
    expert_weights: what the routed expert weights are held as: "int8" (INT8 panels, W8A16) or
      their dtype ("bfloat16", "float32").
    """

    layers: list[LoadedLayer]
    layout: str
    panel_columns: int | None
    native_cpu: dict | None
    expert_weights: str = "bfloat16"


def prepare(layers: Sequence[LoadedLayer], placement: MeshPlacement, dtype, *, backend: str = "auto",
            panel_weights: bool = True, expert_weights: str = "dtype") -> PreparedWeights:
    """Place ``layers`` on ``placement``'s mesh in ``dtype`` and lay them out (see module docstring).

    ValueError for no layers, a layer given twice, experts that do not split evenly over the mesh,
    or ``expert_weights="int8"`` where the native CPU kernel does not run every forward.
    """
    if not layers:
        raise ValueError("layers: the engine needs at least one layer")
    if expert_weights != "dtype" and not (panel_weights and native_cpu_runs_every_forward(placement)
                                          and int8_kernel_serves(backend)):
        raise ValueError(f"--expert-weights {expert_weights} is served by the native CPU kernel: one CPU process, "
                         "no expert parallelism, --backend auto or native_cpu, panel weights, the kernel built "
                         f"({cpu.unavailable_reason() or 'it is'})")
    seen: set[int] = set()
    for layer in layers:
        if layer.index in seen:
            raise ValueError(f"layers: layer {layer.index} is given twice")
        seen.add(layer.index)
        placement.check_layer(layer)
    placed = [dataclasses.replace(layer, params=placement.place_layer(layer, dtype)) for layer in layers]
    if backend == "tokamax" or (panel_weights and native_cpu_runs_every_forward(placement)):
        platform = placement.devices[0].platform
        placed = [dataclasses.replace(layer, params=moe.prepare_params(layer.params, layer.cfg, platform,
                                                                       backend=backend, expert_weights=expert_weights))
                  for layer in placed]
    if placement.devices[0].platform != "cpu":  # the native kernel never runs there: not built
        return PreparedWeights(placed, "row_major", None, None, np.dtype(dtype).name)
    status = cpu.describe(placed[0].params)
    log.info("NUMA: %s (the placement a per-node pool would take; the kernel runs on XLA's one pool)",
             cpu.numa.summary(cpu.numa.plan_placement(cpu.numa.read_topology(), placed[0].cfg.intermediate_size)))
    native = {name: status[name] for name in ("available", "reason", "isa", "amx")}
    return PreparedWeights(placed, status["weight_layout"], status["panel_columns"], native, status["expert_weights"])


def int8_kernel_serves(backend: str) -> bool:
    """Whether ``backend`` runs INT8 expert weights through the native CPU kernel, built here
    (``--expert-weights int8`` also needs one CPU process without expert parallelism and panel
    weights)."""
    return backend in cpu.PREPARING_BACKENDS and cpu.available()


def native_cpu_runs_every_forward(placement: MeshPlacement) -> bool:
    """Whether every forward step may run its experts through the native CPU kernel: one CPU
    process, no expert parallelism (``moe.prepare_params`` decides by backend and availability)."""
    return placement.devices[0].platform == "cpu" and placement.ep is None and jax.process_count() == 1


def native_cpu_note(status: dict | None, panel_columns: int | None = None,
                    expert_weights: str | None = None) -> str | None:
    """The start-up line about the native CPU expert kernel (``PreparedWeights.native_cpu``): the
    instruction set it runs at, the weights' panel width and what they are held as (INT8 said so),
    or why it could not be built; None off CPU."""
    if status is None:
        return None
    if status["available"]:
        held = ("INT8 expert weights (W8A16, a scale per output channel)" if expert_weights == "int8"
                else "expert weights")
        layout = f", {held} in {panel_columns}-column panels" if panel_columns else ""
        amx = {"high_first": " (AMX tiles from 16 rows per expert)",
               "low_first": "; AMX tiles present, off: they add a bf16 pair's products low half first, not in k order",
               "other": "; AMX tiles present, off: they do not round as the FMAs do"}.get(status.get("amx"), "")
        return f"native CPU expert kernel: {status['isa']} instructions{amx}{layout}"
    return (f"note: the native CPU expert kernel is unavailable ({status['reason']}); the experts run "
            "XLA's slower paths")
