"""The typed parameters of one MoE layer: `MoEParams` (and `RouterParams`, the router's part alone).

One place for the tensor names, shapes and dtypes (H hidden, E experts, I expert intermediate, Is
shared intermediate; `param_shapes(cfg)` gives the concrete shapes of a config):

  router_weight  [H, E]     fp32   logits = x @ router_weight (the router runs in fp32)
  w_gate         [E, H, I]  dtype  routed experts' gate projection (act(x @ w_gate[e]))
  w_up           [E, H, I]  dtype  routed experts' up projection
  w_down         [E, I, H]  dtype  routed experts' down projection
  expert_bias    [E]        fp32   selection-only bias (DeepSeek-V3's e_score_correction_bias);
                                   None unless cfg.use_expert_bias
  shared_w_gate  [H, Is]    dtype  shared experts, merged into one MLP; None without shared experts
  shared_w_up    [H, Is]    dtype
  shared_w_down  [Is, H]    dtype
  shared_gate    [H, 1]     dtype  Qwen2-MoE's sigmoid gate on the shared MLP; None unless
                                   cfg.shared_expert_gate

Both are frozen dataclasses registered as JAX pytrees (absent fields are None), so they go
through `jax.jit`, `jax.tree.map` and `jax.device_put` as a dict of arrays would. Loaders build a
dict of host arrays keyed by these names and call `MoEParams.from_dict(d, cfg)`; `to_dict()` and
`items()` give the present (name, array) pairs back.

After `moe.prepare_params`, the routed expert weights (w_gate, w_up, w_down) may be held in a
backend's prepared layout: an object that is not an array and says the shape of the array it was
made from as `logical_shape` (`logical_shape(value)` reads either). Shape checks use that shape.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp

from expertd.kernels.config import MoEConfig

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # routed expert matrices [E, ...]: what EP splits
ROUTER_FIELDS = ("router_weight", "expert_bias")  # kept in fp32 whatever the weight dtype
REQUIRED = ("router_weight",) + EXPERT_WEIGHTS
OPTIONAL = ("expert_bias", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate")
FIELDS = REQUIRED + OPTIONAL
# The shape of every field in shape letters, for errors raised without a config at hand.
SYMBOLIC_SHAPES = {"router_weight": "[H, E]", "w_gate": "[E, H, I]", "w_up": "[E, H, I]", "w_down": "[E, I, H]",
                   "expert_bias": "[E]", "shared_w_gate": "[H, Is]", "shared_w_up": "[H, Is]",
                   "shared_w_down": "[Is, H]", "shared_gate": "[H, 1]"}


def logical_shape(value) -> tuple[int, ...]:
    """The shape of the array `value` stands for: its `logical_shape` when a backend prepared it
    (see the module docstring), else its `shape`."""
    shape = getattr(value, "logical_shape", None)
    if shape is None:
        shape = getattr(value, "shape", None)
    if shape is None:
        raise TypeError(f"expected an array (or prepared expert weights), got {type(value).__name__}")
    return tuple(shape)


def _summary(obj, names) -> str:
    parts = []
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            dtype = getattr(value, "dtype", "?")
            parts.append(f"{name}={list(logical_shape(value))} {dtype}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def _from_mapping(mapping, known: tuple[str, ...], required: tuple[str, ...], shapes: dict, what: str) -> dict:
    """The entries of `mapping` as keyword arguments; errors name the key and its expected shape."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{what}.from_dict needs a mapping of name -> array, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"params has unknown key {unknown[0]!r}; {what} keys are {known}")
    for name in required:
        if mapping.get(name) is None:
            raise ValueError(f"params is missing {name!r} (expected shape {shapes.get(name, SYMBOLIC_SHAPES[name])})")
    return {name: mapping.get(name) for name in known}


@dataclasses.dataclass(frozen=True, repr=False)
class RouterParams:
    """The router's parameters alone (what routing-only steps need).

    Attributes:
      router_weight: fp32 [H, E]; logits = x @ router_weight.
      expert_bias: fp32 [E], added to the scores for selection only; None when the layer has none.
    """

    router_weight: jax.Array
    expert_bias: jax.Array | None = None

    @classmethod
    def from_dict(cls, mapping: Mapping) -> RouterParams:
        """From a mapping with "router_weight" and optionally "expert_bias" (no other keys)."""
        return cls(**_from_mapping(mapping, ROUTER_FIELDS, ("router_weight",), {}, cls.__name__))

    def to_dict(self) -> dict:
        return dict(self.items())

    def items(self) -> Iterator[tuple[str, jax.Array]]:
        """The present (name, array) pairs."""
        return ((name, getattr(self, name)) for name in ROUTER_FIELDS if getattr(self, name) is not None)

    def __repr__(self) -> str:
        return _summary(self, ROUTER_FIELDS)


@dataclasses.dataclass(frozen=True, repr=False)
class MoEParams:
    """The parameters of one MoE layer (shapes and dtypes in the module docstring).

    Attributes:
      router_weight: fp32 [H, E], the router's projection.
      w_gate: [E, H, I], every routed expert's gate projection (or prepared weights).
      w_up: [E, H, I], every routed expert's up projection (or prepared weights).
      w_down: [E, I, H], every routed expert's down projection (or prepared weights).
      expert_bias: fp32 [E], selection-only bias; None unless cfg.use_expert_bias.
      shared_w_gate: [H, Is], the shared MLP's gate projection; None without shared experts.
      shared_w_up: [H, Is], the shared MLP's up projection; None without shared experts.
      shared_w_down: [Is, H], the shared MLP's down projection; None without shared experts.
      shared_gate: [H, 1], sigmoid(x @ shared_gate) scales the shared MLP; None unless
        cfg.shared_expert_gate.
    """

    router_weight: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    expert_bias: jax.Array | None = None
    shared_w_gate: jax.Array | None = None
    shared_w_up: jax.Array | None = None
    shared_w_down: jax.Array | None = None
    shared_gate: jax.Array | None = None

    @classmethod
    def from_dict(cls, mapping: Mapping, cfg: MoEConfig | None = None) -> MoEParams:
        """From a mapping name -> array (the names of the module docstring; absent optional
        fields become None). With `cfg`, every field the config needs must be there with its
        shape (`check_params`). ValueError naming the key and the shape expected otherwise."""
        shapes = param_shapes(cfg) if cfg is not None else {}
        params = cls(**_from_mapping(mapping, FIELDS, REQUIRED, shapes, cls.__name__))
        if cfg is not None:
            check_params(params, cfg)
        return params

    def to_dict(self) -> dict:
        """{name: array} of the present fields."""
        return dict(self.items())

    def items(self) -> Iterator[tuple[str, jax.Array]]:
        """The present (name, array) pairs, in field order."""
        return ((name, getattr(self, name)) for name in FIELDS if getattr(self, name) is not None)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the present fields (prepared expert weights: their logical shape)."""
        return {name: logical_shape(value) for name, value in self.items()}

    @property
    def router(self) -> RouterParams:
        """The router's part (router_weight, expert_bias)."""
        return RouterParams(self.router_weight, self.expert_bias)

    def replace(self, **changes) -> MoEParams:
        """A copy with the given fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return _summary(self, FIELDS)


for _cls, _fields in ((RouterParams, ROUTER_FIELDS), (MoEParams, FIELDS)):
    jax.tree_util.register_dataclass(_cls, data_fields=list(_fields), meta_fields=[])


def param_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every field `cfg` needs (absent: the fields it has no use for)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    shapes = {"router_weight": (h, e), "w_gate": (e, h, i), "w_up": (e, h, i), "w_down": (e, i, h)}
    if cfg.use_expert_bias:
        shapes["expert_bias"] = (e,)
    if cfg.has_shared:
        s = cfg.shared_intermediate_size
        shapes.update(shared_w_gate=(h, s), shared_w_up=(h, s), shared_w_down=(s, h))
        if cfg.shared_expert_gate:
            shapes["shared_gate"] = (h, 1)
    return shapes


def check_params(params: MoEParams, cfg: MoEConfig) -> None:
    """TypeError unless `params` is a MoEParams; ValueError naming the first field `cfg` needs
    that is missing or misshapen."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be a MoEParams (MoEParams.from_dict(d, cfg) builds one from a dict of "
                        f"arrays), got {type(params).__name__}")
    for name, shape in param_shapes(cfg).items():
        value = getattr(params, name)
        if value is None:
            raise ValueError(f"params is missing {name!r} (expected shape {shape})")
        if logical_shape(value) != shape:
            raise ValueError(f"params.{name} must have shape {shape}, got {logical_shape(value)}")


def init_params(cfg: MoEConfig, key, dtype=jnp.float32) -> MoEParams:
    """Seeded random parameters of `cfg` (the fields it needs; the others None).

    Fan-in scaled normals so activations stay O(1): router and input projections ~ N(0, 1/H),
    down projections ~ N(0, 1/I). router_weight and expert_bias (~ N(0, 0.1^2), so that the bias
    really steers selection) are fp32; the rest are `dtype`.
    """
    shapes = param_shapes(cfg)
    keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
    values = {}
    for name, shape in shapes.items():
        fan_in = shape[-2] if len(shape) >= 2 else 1
        std = 0.1 if name == "expert_bias" else fan_in ** -0.5
        value = std * jax.random.normal(keys[name], shape, jnp.float32)
        values[name] = value if name in ROUTER_FIELDS else value.astype(dtype)
    return MoEParams(**values)
