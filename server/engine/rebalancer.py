"""Online expert-parallel load balancing (EPLB): each layer's expert placement re-planned from the
recent load and swapped in between steps, while the server keeps answering.

What it does, every `--eplb-interval-s` seconds (an asyncio task on the server's loop, started
after warm-up; with an interval of 0 it only keeps the balancedness gauge current, every
MONITOR_PERIOD_S seconds):

1. On the loop (where the batcher records it): each expert-parallel layer's load over the recent
   window, tokens per logical expert [E] (``expert_load.ExpertLoadTracker.recent``).
2. ``expertd_eplb_balancedness{layer}``: mean / max tokens per rank of that load under the current
   placement.
3. On the planner thread (off the loop and off the device-worker thread): ``ep.plan_placement``
   (DeepSeek's policy; hierarchical needs several nodes, so a one-process mesh plans globally).
   The plan is kept only when it beats the current placement on the same window by MIN_GAIN
   (relative balancedness); then the weights move (``ep.relayout``: the ranks whose slots change
   get new buffers, assembled on the host from the slots already holding each expert and put on
   their device; no collective, so the steps running meanwhile are not disturbed) and the new
   placement's device tables are built.
4. On the device-worker thread, between two steps: ``Engine.swap_expert_placement`` replaces the
   layer's params and tables together. Their shapes are those the steps were compiled for, so
   nothing recompiles; a step runs wholly on the old placement or wholly on the new one, and both
   compute the same layer, so no answer changes.
5. ``expertd_eplb_rebalances_total{layer}`` and ``expertd_eplb_rebalance_duration_seconds``.

Online rebalancing moves weights through this process's host memory, so it runs in one process
(a multi-host group keeps its start-up placement). The engine is used through its public methods
only (``layers``, ``mesh``, ``expert_placement``, ``swap_expert_placement``); front ends read the
placements through ``placement`` (GetModelInfo, GetExpertLoad); one that keeps a copy of them (the
native port's GetModelInfo answer) hears of each swap through ``add_swap_listener``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable

import jax

from expertd.kernels import ep
from expertd.kernels.eplb import Placement

log = logging.getLogger(__name__)

MIN_GAIN = 0.02  # relative balancedness gain a new placement must bring to be worth a weight move
MONITOR_PERIOD_S = 5.0  # how often the balancedness gauge is refreshed when rebalancing is off


class Rebalancer:
    """The online load balancer of one engine's expert-parallel layers (see module docstring).

    Args:
      engine: the Engine (its expert-parallel layers have placements).
      metrics: the server's Metrics.
      interval_s: seconds between rebalances; 0 leaves the start-up placements in place.

    ValueError when ``interval_s`` > 0 and there is nothing it could do: no expert-parallel layer,
    or a mesh over several processes.
    """

    def __init__(self, engine, metrics, *, interval_s: float):
        self.engine = engine
        self.metrics = metrics
        self.interval_s = float(interval_s)
        self.layers = [index for index in sorted(engine.layers) if engine.expert_placement(index) is not None]
        self.versions = dict.fromkeys(self.layers, 0)
        if self.interval_s > 0 and not self.layers:
            raise ValueError("--eplb-interval-s needs an expert-parallel mesh: 2 or more devices (--num-devices)")
        if self.interval_s > 0 and jax.process_count() > 1:
            raise ValueError("--eplb-interval-s: online rebalancing moves weights through one process's memory; a "
                             "multi-host group keeps its start-up placement (use --eplb-interval-s 0)")
        self._planner: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._swap_listeners: list[Callable[[], None]] = []

    # -- reading (any thread) --------------------------------------------------------------------
    def placement(self, layer: int) -> Placement | None:
        """Layer ``layer``'s current physical placement (None: not expert-parallel)."""
        return self.engine.expert_placement(layer)

    def version(self, layer: int) -> int:
        """Placements swapped in for ``layer`` since start-up."""
        return self.versions.get(layer, 0)

    # -- running (the server's event loop) -------------------------------------------------------
    def add_swap_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the loop after each placement swapped in (``placement`` and
        ``version`` already give the new one)."""
        self._swap_listeners.append(listener)

    def start(self, loads, run_on_device) -> None:
        """Begin ticking (after warm-up): ``loads`` the batcher's ExpertLoadTracker,
        ``run_on_device(fn, *args)`` the batcher's coroutine running fn on the device-worker thread."""
        if self.layers and self._task is None:
            self._task = asyncio.ensure_future(self._run(loads, run_on_device))

    async def stop(self) -> None:
        """Stop ticking; a weight move in progress finishes (it swaps nothing in)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._planner is not None:
            planner, self._planner = self._planner, None
            await asyncio.get_running_loop().run_in_executor(None, planner.shutdown)

    async def _run(self, loads, run_on_device) -> None:
        period = self.interval_s if self.interval_s > 0 else MONITOR_PERIOD_S
        while True:
            await asyncio.sleep(period)
            try:
                await self.tick(loads, run_on_device)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed rebalance leaves the current placement serving
                log.exception("expert load balancing failed; the current placements stay")

    async def tick(self, loads, run_on_device) -> list[int]:
        """One pass over the layers (steps 1-5 of the module docstring); returns the layers whose
        placement was swapped."""
        windows = {layer: loads.recent(layer) for layer in self.layers}
        swapped = []
        for layer, load in windows.items():
            current = self.placement(layer)
            self.metrics.set_eplb_balancedness(layer, current.balancedness(load))
            if self.interval_s <= 0 or load.sum() <= 0:
                continue
            if self._planner is None:
                self._planner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expertd-eplb")
            start = time.perf_counter()
            moved = await asyncio.get_running_loop().run_in_executor(self._planner, self._prepare, layer, load,
                                                                    current)
            if moved is None:
                continue
            params, placement, tables = moved
            await run_on_device(functools.partial(self.engine.swap_expert_placement, layer, params, placement, tables,
                                                  replaces=current))
            seconds = time.perf_counter() - start
            self.versions[layer] += 1
            self.metrics.observe_rebalance(layer, seconds)
            self.metrics.set_eplb_balancedness(layer, placement.balancedness(load))
            log.info("layer %d: expert placement %d swapped in after %.3fs (balancedness %.3f -> %.3f on the "
                     "recent window)", layer, self.versions[layer], seconds, current.balancedness(load),
                     placement.balancedness(load))
            swapped.append(layer)
            for listener in self._swap_listeners:
                listener()
        return swapped

    def _prepare(self, layer: int, load, current: Placement):
        """Planner thread: (params, placement, tables) of a better placement, or None."""
        placement = plan(load, current)
        if placement is None:
            return None
        mesh = self.engine.mesh
        params = ep.relayout(self.engine.layers[layer].params, current, placement, mesh)
        return params, placement, ep.placement_tables(placement, mesh)


def plan(load, current: Placement) -> Placement | None:
    """The placement `ep.plan_placement` makes of ``load [E]`` with ``current``'s ranks and
    redundant slots, when it beats ``current`` on that load by MIN_GAIN; else None."""
    placement = ep.plan_placement(load, current.num_ranks, current.num_redundant)
    if placement == current or placement.balancedness(load) < current.balancedness(load) * (1 + MIN_GAIN):
        return None
    return placement
