"""Where the engine's arrays live: the 1-D "ep" device mesh, weights placed once, inputs and results.

One device: every array on it. Several devices: expert weights `[E, ...]` split over the "ep" axis
(E / R experts per device, as `expertd.kernels.ep.shard_params` lays them out), everything else
replicated. Seeded preset weights are generated straight into that layout (each device makes only
its own shard). With a mesh spanning several processes every process passes the same host values
and gets whole results back (`fetch` gathers with `process_allgather`, a collective).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels.params import MoEParams
from expertd.server.model import ROUTER_PARAMS, LoadedLayer, SeededParams

AXIS = "ep"


def pick_devices(devices=None) -> list:
    """None: all of jax.devices(); an int n: the first n; else the given devices."""
    available = jax.devices()
    if devices is None:
        return list(available)
    if isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ValueError(f"devices: asked for {devices}, {len(available)} available")
        return list(available[:devices])
    devices = list(devices)
    if not devices:
        raise ValueError("devices: the list is empty")
    return devices


class MeshPlacement:
    """The mesh over `devices` and the placement rules above; `ep` is the ep kernel module on a
    mesh of several devices, else None."""

    def __init__(self, devices: Sequence):
        self.devices = list(devices)
        self.mesh = jax.make_mesh((len(self.devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                                  devices=self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.ep = None
        if len(self.devices) > 1:
            from expertd.kernels import ep

            self.ep = ep

    def check_layer(self, layer: LoadedLayer) -> None:
        if self.ep is not None and layer.cfg.num_experts % len(self.devices):
            raise ValueError(
                f"layer {layer.index}: {layer.cfg.num_experts} experts cannot be split evenly over "
                f"{len(self.devices)} devices; use a device count that divides the expert count")

    def place_layer(self, layer: LoadedLayer, dtype) -> dict:
        """One layer's params on the mesh: router tensors fp32, expert weights in `dtype`."""
        def target_dtype(name):
            return jnp.float32 if name in ROUTER_PARAMS else dtype

        params = layer.params
        if self.ep is not None:
            if isinstance(params, SeededParams):  # each device generates only its own shard
                placed = {name: params.generate(name, self._ep_sharding(name), target_dtype(name)) for name in params}
            else:
                placed = {name: np.asarray(value).astype(target_dtype(name), copy=False)
                          for name, value in params.items()}
            return self.ep.shard_params(MoEParams.from_dict(placed), layer.cfg, self.mesh,  # no-op if placed
                                        axis=AXIS).to_dict()
        if isinstance(params, SeededParams):
            # Generated on device (never on the host), then moved to the mesh's device if needed.
            return {name: jax.device_put(params.generate(name, dtype=target_dtype(name)), self.replicated)
                    for name in params}
        return {name: self.put(np.asarray(value).astype(target_dtype(name), copy=False))
                for name, value in params.items()}

    def _ep_sharding(self, name: str) -> NamedSharding:
        return NamedSharding(self.mesh, P(AXIS) if name in self.ep.EXPERT_KEYS else P())

    def put(self, array: np.ndarray) -> jax.Array:
        """A host array replicated over the mesh."""
        if jax.process_count() == 1:
            return jax.device_put(array, self.replicated)
        return jax.make_array_from_callback(array.shape, self.replicated, lambda index: array[index])

    def step_input(self, array: np.ndarray):
        """A host input of a compiled step (tokens, num_valid), replicated over the mesh when called.

        In one process the host array itself: the compiled step places it in C++, about 100 us a
        step less than `jax.device_put` (measured on CPU, BENCHMARKS.md). A mesh over several
        processes needs a global array built from this process's copy.
        """
        if jax.process_count() == 1:
            return array
        return self.put(array)

    def fetch(self, results) -> list[np.ndarray]:
        """Step results on the host, whole (gathered from every process when the mesh spans several)."""
        if all(r.is_fully_addressable for r in results):
            if self.devices[0].platform == "cpu":
                # Already in host memory: np.asarray reads each result where it is, 20-60 us a
                # step less than device_get, which first starts a host copy of each (BENCHMARKS.md).
                return [np.asarray(r) for r in results]
            return list(jax.device_get(tuple(results)))  # one transfer for all results
        from jax.experimental import multihost_utils

        return [np.asarray(multihost_utils.process_allgather(r, tiled=True)) for r in results]


def split_over_ep(array: jax.Array) -> bool:
    """Whether a placed param is split over the ep axis (expert weights on a mesh)."""
    spec = getattr(array.sharding, "spec", ())
    return bool(spec) and spec[0] == AXIS
