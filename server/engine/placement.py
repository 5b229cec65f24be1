"""Where the engine's arrays live: the 1-D "ep" device mesh, weights placed once, inputs and results.

One device: every array on it. Several devices: expert weights split over the "ep" axis in the
layer's physical expert placement (`expert_placement`: E / R experts per device, expert e on slot
e; with N redundant slots, (E + N) / R slots per device holding replicas of the hottest experts,
as `expertd.kernels.ep.shard_params` lays them out), everything else replicated. Seeded preset
weights are generated straight into the plain layout (each device makes only its own shard). With
a mesh spanning several processes every process passes the same host values and gets whole
results back (`fetch` gathers with `process_allgather`, a collective).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels import ep as ep_kernels
from expertd.kernels import experts
from expertd.kernels.config import MoEConfig
from expertd.kernels.eplb import Placement
from expertd.kernels.params import EXPERT_FIELDS, MoEParams, param_dtype
from expertd.server.models.presets import LoadedLayer, SeededParams

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
    mesh of several devices, else None; `num_redundant_experts` the N extra slots per layer."""

    def __init__(self, devices: Sequence, *, num_redundant_experts: int = 0):
        self.devices = list(devices)
        self.mesh = jax.make_mesh((len(self.devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                                  devices=self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.ep = ep_kernels if len(self.devices) > 1 else None
        self.num_redundant_experts = int(num_redundant_experts)

    def check_layer(self, layer: LoadedLayer) -> None:
        redundant = self.num_redundant_experts
        if self.ep is None:
            if redundant:
                raise ValueError(f"--num-redundant-experts {redundant} needs an expert-parallel mesh: 2 or more "
                                 f"devices (--num-devices), {len(self.devices)} given")
            return
        slots = layer.cfg.num_experts + redundant
        if slots % len(self.devices):
            what = f"{layer.cfg.num_experts} experts" + (f" + {redundant} redundant slots" if redundant else "")
            raise ValueError(
                f"layer {layer.index}: {what} cannot be split evenly over {len(self.devices)} devices; use a device "
                "count that divides the expert count" + (" plus --num-redundant-experts" if redundant else ""))

    def expert_placement(self, cfg: MoEConfig) -> Placement | None:
        """A layer's physical expert placement at start-up (None on one device): expert e on slot e
        without redundant slots; with them, `plan_placement` of a uniform load (the replicas spread
        over the ranks until a real load is observed)."""
        if self.ep is None:
            return None
        if not self.num_redundant_experts:
            return Placement.identity(cfg.num_experts, len(self.devices))
        return self.ep.plan_placement(np.ones(cfg.num_experts), len(self.devices), self.num_redundant_experts)

    def place_layer(self, layer: LoadedLayer, dtype) -> MoEParams:
        """One layer's params on the mesh: router tensors fp32, expert weights in `dtype`
        (`params.param_dtype`: also the int32 hash table and fp32 norm weights)."""
        def target_dtype(name):
            return param_dtype(name, dtype)

        params = layer.params
        if self.ep is not None and not isinstance(params, SeededParams) and \
                any(experts.is_fp8(value) for value in params.values()):
            raise ValueError(f"layer {layer.index}: FP8 expert weights are kept on one device only (the "
                             "expert-parallel layer reads dense ones)")
        if self.ep is not None:
            placement = self.expert_placement(layer.cfg)
            split = layer.cfg.num_experts % len(self.devices) == 0
            if isinstance(params, SeededParams):  # each device generates only its own shard (or a copy)
                placed = {name: params.generate(name, self._ep_sharding(name) if split else self.replicated,
                                                target_dtype(name)) for name in params}
            else:
                placed = {name: np.asarray(value).astype(target_dtype(name), copy=False)
                          for name, value in params.items()}
            return self.ep.shard_params(MoEParams.from_dict(placed, layer.cfg), layer.cfg, self.mesh, axis=AXIS,
                                        placement=None if placement.is_identity else placement)
        if isinstance(params, SeededParams):
            # Generated on device (never on the host), then moved to the mesh's device if needed.
            placed = {name: jax.device_put(params.generate(name, dtype=target_dtype(name)), self.replicated)
                      for name in params}
        else:  # structured expert weights go as they are, leaf by leaf: FP8 codes and scales (kept on a
            # GPU), INT8 weights converted from them as they loaded (on CPU)
            placed = {name: jax.tree.map(self.put, value) if _structured(value)
                      else self.put(np.asarray(value).astype(target_dtype(name), copy=False))
                      for name, value in params.items()}
        return MoEParams.from_dict(placed, layer.cfg)

    def _ep_sharding(self, name: str) -> NamedSharding:
        return NamedSharding(self.mesh, P(AXIS) if name in EXPERT_FIELDS else P())

    def put(self, array: np.ndarray) -> jax.Array:
        """A host array replicated over the mesh. On one CPU device in one process, the array itself
        where it is aligned for JAX (the loader's huge-page mappings are): used in place, not copied
        (a copy of a GB-sized weight runs at about 1 GB/s, and would drop its huge pages)."""
        if jax.process_count() == 1:
            alias = len(self.devices) == 1 and self.devices[0].platform == "cpu"
            return jax.device_put(array, self.replicated, may_alias=True if alias else None)
        return jax.make_array_from_callback(array.shape, self.replicated, lambda index: array[index])

    def step_input(self, array: np.ndarray):
        """A host input of a compiled step (tokens, num_valid), replicated over the mesh when called.

        In one process the host array itself: the compiled step places it in C++, cheaper than a
        `jax.device_put` first (BENCHMARKS.md, Engine step cycle). A mesh over several processes needs a
        global array built from this process's copy.
        """
        if jax.process_count() == 1:
            return array
        return self.put(array)

    def fetch(self, results) -> list[np.ndarray]:
        """Step results on the host, whole (gathered from every process when the mesh spans several)."""
        if all(r.is_fully_addressable for r in results):
            if self.devices[0].platform == "cpu":
                # Already in host memory: np.asarray reads each result where it is; device_get
                # would first start a host copy of each (BENCHMARKS.md, Engine step cycle).
                return [np.asarray(r) for r in results]
            return list(jax.device_get(tuple(results)))  # one transfer for all results
        from jax.experimental import multihost_utils

        return [np.asarray(multihost_utils.process_allgather(r, tiled=True)) for r in results]


def split_over_ep(value) -> bool:
    """Whether a placed param (an array, or prepared expert weights holding arrays) is split over
    the ep axis (expert weights on a mesh)."""
    for leaf in jax.tree.leaves(value):
        spec = getattr(getattr(leaf, "sharding", None), "spec", ())
        if spec and spec[0] == AXIS:
            return True
    return False


def _structured(value) -> bool:
    """Whether a param is a pytree of arrays (FP8 or INT8 expert weights) rather than one array."""
    return not isinstance(value, (np.ndarray, jax.Array))
