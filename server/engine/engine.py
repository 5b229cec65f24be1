"""The engine: compiles and runs the steps of MoE layers whose weights are already placed.

Its inputs are trusted: the batcher hands it tokens already decoded, validated, cast to the engine
dtype and padded to a bucket (``[B, W]``, B the bucket: the token array's row count), and the
number of valid rows. Nothing is checked or copied again here. Start-up (``expertd.server.engine.build``)
builds what it needs: the mesh (``placement``), the placed and prepared weights (``weights``), the
huge pages (``host_memory``); ``warmup`` compiles every step ahead of time.

Steps (``expertd.server.engine.steps``): forward (gate matmul, router, dispatch, experts, combine, shared
experts; ``steps.ep_forward_step`` on a mesh of several devices), route from hidden states and
route from given logits ``[B, E]``. Layers with the same config and param shapes share
executables; a step not compiled yet compiles on first use. ``num_valid`` is a runtime scalar, so
it never causes a recompilation; rows at and after it are padding (masked out of routing, counts
and the aux loss, their outputs zero). Forward steps compile with ``moe.compiler_options``.

Expert-parallel layers run with a physical expert placement (``placement.expert_placement``; its
run-time tables ride with the params into the forward step). ``swap_expert_placement`` replaces a
layer's params and placement together between two steps; the shapes stay, so nothing recompiles
(``expertd.server.engine.rebalancer`` does this online).

Hash-routed layers (``cfg.hash_routed``, DeepSeek-V4's first layers) need the tokens' ids:
``forward(..., token_ids=)`` / ``route(..., token_ids=)`` take them (int ``[n]``, n >= num_valid),
check them (``moe.check_token_ids``; ``InvalidRequest`` naming ``token_ids`` when missing or out of
the vocabulary), pad them to the bucket and pass them as one more step input. Other layers ignore
them and compile no such input.

Host inputs go to the compiled step as numpy arrays (``placement.step_input``: the step places them
itself) and results come back as numpy (``placement.fetch``), cut to the valid rows. Multi-host:
every process builds the same Engine and runs the same steps in the same order
(``expertd.server.multihost.serve``).

One device-worker thread calls the engine; ``lock`` makes concurrent calls safe but serial.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from expertd.kernels import experts, moe
from expertd.kernels.eplb import Placement
from expertd.server.engine import api, steps
from expertd.server.engine.api import ForwardOutput, RouteOutput
from expertd.server.engine.placement import AXIS, MeshPlacement
from expertd.server.errors import InvalidRequest
from expertd.server.models.presets import LoadedLayer


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One compiled step: ``layers`` share it; ``done`` of ``total`` during warm-up (total 0 outside);
    ``compiler_options`` are the XLA options it was compiled with (see ``moe.compiler_options``);
    ``expert_backend`` is the expert FFN backend a forward step runs (None for routing steps)."""

    layers: tuple[int, ...]
    bucket: int
    kind: str
    seconds: float
    done: int
    total: int
    compiler_options: dict = dataclasses.field(default_factory=dict)
    expert_backend: str | None = None


class Engine:
    """Compiled steps of placed layers (see module docstring).

    Args:
      layers: the served layers, their params the placed (and prepared) device arrays.
      placement: the mesh they are placed on.
      dtype: the compute dtype (expert weights and hidden states).
      buckets: the token buckets, ascending (what warm-up compiles).
      backend: the expert FFN backend, "auto" or one of ``experts.BACKENDS``.
    """

    def __init__(self, layers: Sequence[LoadedLayer], placement: MeshPlacement, *, dtype, buckets: Sequence[int],
                 backend: str = "auto"):
        self.layers = {layer.index: layer for layer in layers}
        self.placement = placement
        self.devices, self.mesh = placement.devices, placement.mesh
        self.platform = self.devices[0].platform
        self.dtype = np.dtype(dtype)
        self.buckets = tuple(buckets)
        self.backend = backend
        self.compilations = 0
        self.compile_seconds = 0.0
        self.warm = False
        self.lock = threading.RLock()
        self._listeners: list[Callable[[CompileEvent], None]] = []
        self._executables: dict[tuple, object] = {}
        self._keys = {index: self._key(layer) for index, layer in self.layers.items()}
        # Expert-parallel layers: the host placement and its device tables (read by forward steps).
        self._placements = {index: placement.expert_placement(layer.cfg) for index, layer in self.layers.items()
                            if placement.ep is not None}
        self._tables = {index: placement.ep.placement_tables(p, self.mesh) for index, p in self._placements.items()}

    @staticmethod
    def _key(layer: LoadedLayer) -> tuple:
        # the kind of each param too: FP8 expert weights (a pytree of codes and scales) compile apart
        return (layer.cfg, tuple(sorted((name, moe.logical_shape(p), str(p.dtype), experts.is_fp8(p))
                                        for name, p in layer.params.items())))

    # ------------------------------------------------------------------ running steps

    def forward(self, layer: int, tokens: np.ndarray, num_valid: int, token_ids: np.ndarray | None = None
                ) -> ForwardOutput:
        """The MoE layer's output for the first ``num_valid`` rows of ``tokens [B, H]`` (engine dtype).
        ``token_ids``: int ``[n]`` (n >= num_valid; the first num_valid are the rows' ids), required
        by hash-routed layers (``InvalidRequest`` naming ``token_ids`` otherwise), ignored by others."""
        out, ids, weights, counts = self._run(layer, api.FORWARD, tokens, num_valid, token_ids=token_ids)
        return ForwardOutput(out[:num_valid], ids[:num_valid], weights[:num_valid], counts)

    def route(self, layer: int, tokens: np.ndarray, num_valid: int, *, from_logits: bool = False,
              aux_loss_coeff: float = 1.0, token_ids: np.ndarray | None = None) -> RouteOutput:
        """Top-k routing of the first ``num_valid`` rows of hidden states ``[B, H]`` (engine dtype) or,
        ``from_logits``, router logits ``[B, E]`` (fp32); ``token_ids`` as for ``forward``."""
        kind = api.ROUTE_LOGITS if from_logits else api.ROUTE_HIDDEN
        ids, weights, counts, aux, scores = self._run(layer, kind, tokens, num_valid, aux_loss_coeff, token_ids)
        return RouteOutput(ids[:num_valid], weights[:num_valid], counts, float(aux), scores[:num_valid])

    def expert_placement(self, layer: int) -> Placement | None:
        """Layer ``layer``'s current physical expert placement (None without expert parallelism)."""
        return self._placements.get(layer)

    def swap_expert_placement(self, layer: int, params: moe.MoEParams, placement: Placement, tables, *,
                              replaces: Placement) -> None:
        """Serve layer ``layer`` with ``params`` laid out for ``placement`` (and its device
        ``tables``, ``ep.placement_tables``) from the next step on; ``replaces`` must be the
        current placement. Waits for a running step. ValueError when anything would recompile."""
        with self.lock:
            if self._placements.get(layer) != replaces:
                raise ValueError(f"layer {layer}: the placement to replace is not the current one")
            new = dataclasses.replace(self.layers[layer], params=params)
            if _layout((params, tables)) != _layout((self.layers[layer].params, self._tables[layer])):
                raise ValueError(f"layer {layer}: the new placement's params or tables differ in shape, dtype or "
                                 "sharding from the compiled steps'")
            self.layers[layer] = new
            self._placements[layer], self._tables[layer] = placement, tables

    def executable(self, layer: int, bucket: int, kind: str):
        """Layer ``layer``'s compiled step ``kind`` for ``bucket`` rows (compiled now if need be)."""
        key = self._keys[layer]
        with self.lock:
            step = self._executables.get((key, bucket, kind))
            return step if step is not None else self._compile(key, (layer,), bucket, kind)

    def _run(self, index: int, kind: str, tokens: np.ndarray, num_valid: int, coeff: float = 0.0,
             token_ids: np.ndarray | None = None) -> list[np.ndarray]:
        with self.lock:
            step = self.executable(index, tokens.shape[0], kind)
            params, *inputs = self._step_args(index, kind, tokens, num_valid, coeff, token_ids)
            return self.placement.fetch(step(params, *map(self.placement.step_input, inputs)))

    def _step_args(self, index: int, kind: str, tokens, num_valid: int, coeff: float, token_ids=None):
        """A compiled step's arguments: the placed params it reads, then its host inputs (tokens,
        num_valid, coeff for routing, then token_ids int32 [B] for hash-routed layers); ``tokens`` is
        abstract (ShapeDtypeStruct) when lowering, and so are the token ids then."""
        layer = self.layers[index]
        extra = ()
        if layer.cfg.hash_routed:
            extra = (self._token_ids(layer, token_ids, tokens, num_valid),)
        if kind == api.FORWARD:
            return (self.step_params(index, kind), tokens, np.asarray(num_valid, np.int32)) + extra
        return (self.step_params(index, kind), tokens, np.asarray(num_valid, np.int32),
                np.asarray(coeff, np.float32)) + extra

    def step_params(self, index: int, kind: str = api.FORWARD):
        """The placed params layer ``index``'s compiled step ``kind`` reads as its first argument:
        MoEParams (with the placement's device tables on an expert-parallel mesh:
        ``(params, tables)``) for a forward step, RouterParams for a routing step."""
        layer = self.layers[index]
        if kind != api.FORWARD:
            return layer.params.router
        return layer.params if self.placement.ep is None else (layer.params, self._tables[index])

    @staticmethod
    def _token_ids(layer: LoadedLayer, token_ids, tokens, num_valid: int):
        """A hash-routed layer's token ids as the step input int32 [B]: checked (InvalidRequest
        naming ``token_ids``), the first num_valid kept, the padding rows 0."""
        bucket = tokens.shape[0]
        if isinstance(tokens, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((bucket,), np.int32, sharding=tokens.sharding)
        if token_ids is None:
            raise InvalidRequest("token_ids", f"required: layer {layer.index} is hash-routed (expert ids come "
                                 f"from tid2eid[token_id], vocabulary {layer.cfg.hash_vocab_size}); send one "
                                 "token id per row")
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or not num_valid <= ids.shape[0] <= bucket:
            raise InvalidRequest("token_ids", f"must be [n] with {num_valid} <= n <= {bucket} (one id per row), "
                                 f"got shape {list(ids.shape)}")
        try:
            moe.check_token_ids(ids[:num_valid], layer.cfg)
        except ValueError as exc:
            raise InvalidRequest("token_ids", getattr(exc, "description", str(exc))) from exc
        padded = np.zeros(bucket, np.int32)
        padded[:num_valid] = ids[:num_valid]
        return padded

    # ------------------------------------------------------------------ compiling steps

    def add_compile_listener(self, listener: Callable[[CompileEvent], None]) -> None:
        """Call ``listener(CompileEvent)`` after every compilation (metrics hook)."""
        self._listeners.append(listener)

    def shape_groups(self) -> dict[tuple, tuple[int, ...]]:
        """Shape key -> the layers sharing its compiled steps (same config, param shapes and dtypes)."""
        groups: dict[tuple, list[int]] = {}
        for index in sorted(self.layers):
            groups.setdefault(self._keys[index], []).append(index)
        return {key: tuple(indices) for key, indices in groups.items()}

    def is_compiled(self, key, bucket: int, kind: str) -> bool:
        return (key, bucket, kind) in self._executables

    def lower(self, key, layers: tuple[int, ...], bucket: int, kind: str) -> jax.stages.Lowered:
        """Trace and lower step ``kind`` of the layers of ``key`` for abstract tokens ``[bucket, H]``
        (``[bucket, E]`` fp32 logits for route_logits)."""
        cfg = key[0]
        replicated = self.placement.replicated
        width = cfg.num_experts if kind == api.ROUTE_LOGITS else cfg.hidden_size
        token_dtype = np.float32 if kind == api.ROUTE_LOGITS else self.dtype
        tokens = jax.ShapeDtypeStruct((bucket, width), token_dtype, sharding=replicated)
        abstract = jax.tree.map(functools.partial(_abstract, host_sharding=replicated),
                                self._step_args(layers[0], kind, tokens, 0, 0.0))
        if kind != api.FORWARD:
            step = functools.partial(steps.route_step, cfg=cfg, from_logits=kind == api.ROUTE_LOGITS)
        elif self.placement.ep is None:
            step = functools.partial(steps.forward_step, cfg=cfg, backend=self.backend)
        else:
            step = functools.partial(steps.ep_forward_step, cfg=cfg, backend=self.backend, mesh=self.mesh,
                                     ep=self.placement.ep, axis=AXIS)
        options = self.step_options(cfg, bucket, kind)
        return jax.jit(step, out_shardings=replicated, compiler_options=options or None).lower(*abstract)

    def record(self, key, layers: tuple[int, ...], bucket: int, kind: str, executable, seconds: float,
               done: int = 0, total: int = 0) -> CompileEvent:
        """Keep a compiled step, count it and tell the listeners."""
        self._executables[(key, bucket, kind)] = executable
        self.compilations += 1
        self.compile_seconds += seconds
        event = CompileEvent(layers, bucket, kind, seconds, done, total, self.step_options(key[0], bucket, kind),
                             self.step_backend(key[0], bucket, kind))
        for listener in self._listeners:
            listener(event)
        return event

    def _compile(self, key, layers: tuple[int, ...], bucket: int, kind: str):
        start = time.perf_counter()
        executable, seconds = timed_compile(self.lower(key, layers, bucket, kind), time.perf_counter() - start)
        self.record(key, layers, bucket, kind, executable, seconds)
        return executable

    def step_options(self, cfg, bucket: int, kind: str) -> dict:
        """XLA compiler options of a step: ``moe.compiler_options`` for forward, none for routing."""
        if kind != api.FORWARD:
            return {}
        return moe.compiler_options(cfg, bucket, dtype=self.dtype, backend=self.backend, platform=self.platform)

    def step_backend(self, cfg, bucket: int, kind: str) -> str | None:
        """The expert FFN backend a forward step runs: the engine's, or what ``auto`` picks for the
        bucket's rows (``experts.choose_backend``; EP ranks pick by their receive buffer, and no
        platform's rule depends on the row count today). None for routing steps."""
        if kind != api.FORWARD:
            return None
        if self.backend != "auto":
            return self.backend
        fp8 = any(experts.is_fp8(layer.params.w_gate) for layer in self.layers.values() if layer.cfg == cfg)
        return experts.choose_backend(bucket * cfg.topk, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                      self.dtype, self.platform, fp8_weights=fp8)

    def compile_info(self) -> dict:
        """Compile counters, and per (layers, bucket) of the forward steps their XLA options (where
        any apply) and expert backend."""
        groups = self.shape_groups()
        return {
            "warm": self.warm, "compilations": self.compilations, "compile_seconds": self.compile_seconds,
            "forward_compiler_options": [
                {"layers": list(layers), "bucket": bucket, "options": options}
                for key, layers in groups.items() for bucket in self.buckets
                if (options := self.step_options(key[0], bucket, api.FORWARD))],
            "forward_expert_backends": [
                {"layers": list(layers), "bucket": bucket, "backend": self.step_backend(key[0], bucket, api.FORWARD)}
                for key, layers in groups.items() for bucket in self.buckets],
        }


def timed_compile(lowered: jax.stages.Lowered, lower_seconds: float):
    """(compiled executable, seconds spent lowering and compiling it)."""
    start = time.perf_counter()
    executable = lowered.compile()
    return executable, lower_seconds + time.perf_counter() - start


def _layout(tree) -> list[tuple]:
    """(shape, dtype, sharding) of every array of ``tree``: what a compiled step was built for."""
    return [(leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) for leaf in jax.tree.leaves(tree)]


def _abstract(value, host_sharding):
    """A step argument's abstract value; host (numpy) inputs are replicated over the mesh."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=getattr(value, "sharding", host_sharding))
