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

Family semantics (each None unless its MoEConfig switch is on; docs/semantics.md):

  router_bias        [E]     fp32   added to the logits (gpt-oss); cfg.router_bias
  router_input_scale [H]     fp32   scales the router's RMS-normed input (Gemma 4's router.scale
                                    times hidden_size**-0.5); cfg.router_input_norm
  per_expert_scale   [E]     fp32   multiplies each routing weight by its expert's scale (Gemma 4);
                                    cfg.per_expert_scale
  tid2eid            [V, k]  int32  hash routing's expert ids per token id, each in [0, E)
                                    (DeepSeek-V4's ffn.gate.tid2eid); cfg.hash_vocab_size = V > 0
  b_gate             [E, I]  dtype  per-expert bias of the gate projection (gpt-oss); cfg.expert_proj_bias
  b_up               [E, I]  dtype  per-expert bias of the up projection; cfg.expert_proj_bias
  b_down             [E, H]  dtype  per-expert bias of the down projection; cfg.expert_proj_bias
  expert_input_norm_weight  [H]  fp32  RMSNorm weight of the routed experts' input (Gemma 4's
                                    pre_feedforward_layernorm_2); cfg.expert_input_norm
  expert_output_norm_weight [H]  fp32  RMSNorm weight of their weighted sum (Gemma 4's
                                    post_feedforward_layernorm_2); cfg.expert_output_norm

`param_dtype(name, dtype)` is the dtype a field is held in when the expert weights are `dtype`.

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
import numpy as np

from expertd.kernels.config import MoEConfig

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # routed expert matrices [E, ...] (the ones a backend may lay out)
EXPERT_BIASES = ("b_gate", "b_up", "b_down")  # per-expert biases [E, ...]
EXPERT_FIELDS = EXPERT_WEIGHTS + EXPERT_BIASES  # every tensor with a leading expert dim: what EP splits
# The router's part (RouterParams): fp32 whatever the weight dtype, except the int32 hash table.
ROUTER_FIELDS = ("router_weight", "expert_bias", "router_bias", "router_input_scale", "per_expert_scale", "tid2eid")
INDEX_FIELDS = ("tid2eid",)  # int32
NORM_FIELDS = ("expert_input_norm_weight", "expert_output_norm_weight")  # fp32
REQUIRED = ("router_weight",) + EXPERT_WEIGHTS
OPTIONAL = ("expert_bias", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate", "router_bias",
            "router_input_scale", "per_expert_scale", "tid2eid") + EXPERT_BIASES + NORM_FIELDS
FIELDS = REQUIRED + OPTIONAL
# The shape of every field in shape letters, for errors raised without a config at hand.
SYMBOLIC_SHAPES = {"router_weight": "[H, E]", "w_gate": "[E, H, I]", "w_up": "[E, H, I]", "w_down": "[E, I, H]",
                   "expert_bias": "[E]", "shared_w_gate": "[H, Is]", "shared_w_up": "[H, Is]",
                   "shared_w_down": "[Is, H]", "shared_gate": "[H, 1]", "router_bias": "[E]",
                   "router_input_scale": "[H]", "per_expert_scale": "[E]", "tid2eid": "[V, k]",
                   "b_gate": "[E, I]", "b_up": "[E, I]", "b_down": "[E, H]", "expert_input_norm_weight": "[H]",
                   "expert_output_norm_weight": "[H]"}


def param_dtype(name: str, dtype):
    """The dtype field `name` is held in when the expert weights are `dtype`: int32 for the hash
    table, fp32 for the router's tensors and the norm weights, `dtype` for the rest."""
    if name in INDEX_FIELDS:
        return jnp.int32
    if name in ROUTER_FIELDS or name in NORM_FIELDS:
        return jnp.float32
    return dtype


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
      router_bias, router_input_scale, per_expert_scale, tid2eid: the family fields of the module
        docstring (None when the config has no use for them).
    """

    router_weight: jax.Array
    expert_bias: jax.Array | None = None
    router_bias: jax.Array | None = None
    router_input_scale: jax.Array | None = None
    per_expert_scale: jax.Array | None = None
    tid2eid: jax.Array | None = None

    @classmethod
    def from_dict(cls, mapping: Mapping) -> RouterParams:
        """From a mapping with "router_weight" and optionally the other ROUTER_FIELDS (no other keys)."""
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
      router_bias, router_input_scale, per_expert_scale, tid2eid, b_gate, b_up, b_down,
      expert_input_norm_weight, expert_output_norm_weight: the family fields of the module
        docstring, None unless the config switches their semantic on.
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
    router_bias: jax.Array | None = None
    router_input_scale: jax.Array | None = None
    per_expert_scale: jax.Array | None = None
    tid2eid: jax.Array | None = None
    b_gate: jax.Array | None = None
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None
    expert_input_norm_weight: jax.Array | None = None
    expert_output_norm_weight: jax.Array | None = None

    @classmethod
    def from_dict(cls, mapping: Mapping, cfg: MoEConfig | None = None) -> MoEParams:
        """From a mapping name -> array (the names of the module docstring; absent optional
        fields become None). With `cfg`, every field the config needs must be there with its
        shape (`check_params`). ValueError naming the key and the shape expected otherwise."""
        shapes = param_shapes(cfg) if cfg is not None else {}
        params = cls(**_from_mapping(mapping, FIELDS, REQUIRED, shapes, cls.__name__))
        if cfg is not None:
            check_params(params, cfg)
            check_hash_table(params.tid2eid, cfg)
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
        """The router's part (the ROUTER_FIELDS)."""
        return RouterParams(**{name: getattr(self, name) for name in ROUTER_FIELDS})

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
    if cfg.router_bias:
        shapes["router_bias"] = (e,)
    if cfg.router_input_norm:
        shapes["router_input_scale"] = (h,)
    if cfg.per_expert_scale:
        shapes["per_expert_scale"] = (e,)
    if cfg.hash_routed:
        shapes["tid2eid"] = (cfg.hash_vocab_size, cfg.topk)
    if cfg.expert_proj_bias:
        shapes.update(b_gate=(e, i), b_up=(e, i), b_down=(e, h))
    if cfg.expert_input_norm:
        shapes["expert_input_norm_weight"] = (h,)
    if cfg.expert_output_norm:
        shapes["expert_output_norm_weight"] = (h,)
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
    if params.tid2eid is not None and not jnp.issubdtype(params.tid2eid.dtype, jnp.integer):
        raise ValueError(f"params.tid2eid must be an integer array (int32 expert ids), got {params.tid2eid.dtype}")


def check_hash_table(tid2eid, cfg: MoEConfig) -> None:
    """ValueError unless every entry of a concrete hash table is an expert id in [0, E) (a traced
    table is left alone: its values are not known). Loaders get this from `MoEParams.from_dict(d, cfg)`."""
    if tid2eid is None or isinstance(tid2eid, jax.core.Tracer):
        return
    table = np.asarray(tid2eid)
    bad = np.flatnonzero((table < 0) | (table >= cfg.num_experts))
    if bad.size:
        row, slot = np.unravel_index(bad[0], table.shape)
        raise ValueError(f"params.tid2eid[{row}, {slot}] = {table[row, slot]} is not an expert id in "
                         f"[0, {cfg.num_experts})")


def init_params(cfg: MoEConfig, key, dtype=jnp.float32) -> MoEParams:
    """Seeded random parameters of `cfg` (the fields it needs; the others None).

    Fan-in scaled normals so activations stay O(1): router and input projections ~ N(0, 1/H),
    down projections ~ N(0, 1/I). expert_bias, router_bias and the projection biases ~ N(0, 0.1^2)
    (so that a bias really steers selection), the scales and norm weights ~ 1 + N(0, 0.1^2), the
    hash table k distinct random experts per token id. Dtypes are `param_dtype(name, dtype)`.
    """
    shapes = param_shapes(cfg)
    keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
    values = {}
    for name, shape in shapes.items():
        if name == "tid2eid":  # k distinct experts per token id
            order = jnp.argsort(jax.random.uniform(keys[name], (shape[0], cfg.num_experts)), axis=-1)
            values[name] = order[:, :cfg.topk].astype(jnp.int32)
            continue
        value = jax.random.normal(keys[name], shape, jnp.float32)
        if name in ("router_input_scale", "per_expert_scale") + NORM_FIELDS:
            value = 1.0 + 0.1 * value
        elif name in ("expert_bias", "router_bias") + EXPERT_BIASES:
            value = 0.1 * value
        else:
            value = value * (shape[-2] if len(shape) >= 2 else 1) ** -0.5
        values[name] = value.astype(param_dtype(name, dtype))
    return MoEParams(**values)
