"""The served weights, prepared once at start-up: placed on the mesh, then laid out for the kernel
that reads them.

1. Placement (``expertd.server.placement``): each layer's params on the mesh once; expert weights
   in the engine dtype, router weight and expert bias in fp32; seeded preset weights generated
   straight into their device layout.
2. Layout: where the native CPU kernel runs every forward (one CPU process, no expert parallelism,
   backend auto or native_cpu, the kernel built), the routed expert matrices are relaid out
   panel-major (``expertd.kernels.panels``: same outputs, read faster); ``panel_weights=False``
   keeps the checkpoint's row-major layout.

This module is the server's one caller of the kernels' weight-layout and native-kernel APIs
(``panels.panel_params``, ``panels.is_panels``, ``experts.native_cpu_available``,
``native_cpu.available / unavailable_reason / isa``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from expertd.kernels import experts, native_cpu, panels
from expertd.server.model import LoadedLayer
from expertd.server.placement import MeshPlacement


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """What ``prepare`` made.

    layers: the layers, their params now the placed device arrays (panel-major expert matrices
      where ``layout`` is "panels"); the host copies are released once the caller drops its own.
    layout: "panels" or "row_major".
    panel_columns: the panels' width (None: row-major).
    native_cpu: on CPU, whether the C++ expert kernel (auto's choice there) is usable, why not, and
      the instruction-set level it runs at ({"available", "reason", "isa"}); None elsewhere.
    """

    layers: list[LoadedLayer]
    layout: str
    panel_columns: int | None
    native_cpu: dict | None


def prepare(layers: Sequence[LoadedLayer], placement: MeshPlacement, dtype, *, backend: str = "auto",
            panel_weights: bool = True) -> PreparedWeights:
    """Place ``layers`` on ``placement``'s mesh in ``dtype`` and lay them out (see module docstring).

    ValueError for no layers, a layer given twice, or experts that do not split evenly over the mesh.
    """
    if not layers:
        raise ValueError("layers: the engine needs at least one layer")
    seen: set[int] = set()
    for layer in layers:
        if layer.index in seen:
            raise ValueError(f"layers: layer {layer.index} is given twice")
        seen.add(layer.index)
        placement.check_layer(layer)
    placed = [dataclasses.replace(layer, params=placement.place_layer(layer, dtype)) for layer in layers]
    layout = "panels" if panel_weights and native_cpu_runs_every_forward(placement, backend) else "row_major"
    if layout == "panels":  # once, at load: the layout the native CPU kernel reads fastest
        placed = [dataclasses.replace(layer, params=panels.panel_params(layer.params)) for layer in placed]
    w_gate = placed[0].params["w_gate"]
    return PreparedWeights(placed, layout, w_gate.panel_columns if panels.is_panels(w_gate) else None,
                           native_cpu_status(placement))


def native_cpu_runs_every_forward(placement: MeshPlacement, backend: str) -> bool:
    """Whether every forward step runs its experts through the native CPU kernel: one CPU process,
    no expert parallelism, backend auto or native_cpu, and the kernel built (building it now)."""
    if placement.devices[0].platform != "cpu" or placement.ep is not None or jax.process_count() > 1:
        return False
    return backend in ("auto", "native_cpu") and experts.native_cpu_available()


def native_cpu_status(placement: MeshPlacement) -> dict | None:
    """On CPU, the native kernel's {"available", "reason", "isa"}; None on other platforms, which never run it."""
    if placement.devices[0].platform != "cpu":
        return None
    return {"available": native_cpu.available(), "reason": native_cpu.unavailable_reason() or None,
            "isa": native_cpu.isa()}


def native_cpu_note(status: dict | None, panel_columns: int | None = None) -> str | None:
    """The start-up line about the native CPU expert kernel (``native_cpu_status``'s dict): the
    instruction set it runs at and the weights' panel width, or why it could not be built; None off CPU."""
    if status is None:
        return None
    if status["available"]:
        layout = f", expert weights in {panel_columns}-column panels" if panel_columns else ""
        return f"native CPU expert kernel: {status['isa']} instructions{layout}"
    return (f"note: the native CPU expert kernel is unavailable ({status['reason']}); the experts run "
            "XLA's slower paths")
