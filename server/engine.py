"""The engine: MoE layers on a device mesh, one pre-compiled step per (layer shape, token bucket).

What it does, in order:
1. Mesh: the devices given (default: all of `jax.devices()`; an int n takes the first n) form a
   1-D mesh with axis "ep". One device runs `expertd.kernels.moe.moe_layer`; more run
   `expertd.kernels.ep.ep_moe_layer` over "ep" (E / R experts per rank).
2. Weights (`expertd.server.placement`): each layer's params are placed once (`jax.device_put`,
   or `ep.shard_params` on a mesh); expert weights in the engine dtype, router weight and expert
   bias in fp32. Seeded preset weights are generated straight into their device layout. Where the
   native CPU kernel runs every forward (one CPU process, no expert parallelism, backend auto or
   native_cpu), the params then go through `moe.prepare_params` (the native kernel's layout;
   same outputs, faster reads; `panel_weights=False` keeps the row-major layout, and
   `info()["weight_layout"]` says which is served, `info()["panel_columns"]` the panels' width). On CPU
   devices their buffers are then moved onto transparent huge pages (`expertd.server.host_memory`,
   `huge_pages=False` skips it); `info()["huge_pages"]` reports how many bytes made it, and
   `info()["host_allocator"]` whether this process keeps freed host buffers for reuse
   (`expertd.server.host_allocator`, applied by `expertd serve --retain-freed-memory` before JAX starts).
3. Steps (`expertd.server.steps`): three pure functions of (params, tokens padded to a bucket, number of valid tokens):
   forward (gate matmul, router, dispatch, experts, combine, shared experts), route from hidden
   states (router logits = x @ router_weight in fp32) and route from given logits [T, E]. Layers
   with the same config and param shapes share executables. `warmup()` AOT-compiles every
   (config, bucket, step) with a progress callback; steps not warmed compile on first use.
   The number of valid tokens is a runtime scalar, so it never causes a recompilation; rows at
   and after it are padding: masked out of routing, counts and the aux loss, their outputs zero.
   On a mesh, the forward step is `steps.ep_forward_step` (`ep_moe_layer` traced under the same
   jit: tokens sharded over "ep" inside, expert weights split), AOT-compiled per bucket like the
   others and counted in the same compile metrics. Forward steps compile with
   `moe.compiler_options(cfg, bucket, dtype=...)` (on CPU, YNNPACK off for few rows per large expert:
   measured faster there); `info()["forward_compiler_options"]` lists where any apply, and
   `info()["forward_expert_backends"]` which expert FFN backend each forward bucket runs.
4. Inputs: in one process the padded host tokens and the scalars go to the compiled step as
   numpy arrays, which it places itself (`placement.step_input`: ~100 us a step less than
   `jax.device_put` first). Results come back to the host as numpy, cut to the valid rows; on CPU
   they are read where they are with `np.asarray` (`placement.fetch`: 20-60 us a step less
   than `device_get`).

Multi-host (issue 7): every process builds the same Engine and must call `forward` / `route`
(and `warmup`) with the same arguments in the same order: each step is a pure function of (layer,
bucket, tokens, num_valid). Host inputs become global arrays with `make_array_from_callback`
(every process passes the same values) and results that span processes are gathered with
`process_allgather`, so every process gets the full result.

Interface notes for callers (the batcher / servicer):
- `forward(layer, x, num_valid=None)`: x `[n, H]` float32 / bfloat16 / float16 with n <= the
  largest bucket (rows past n up to the bucket are padded here); only the first `num_valid`
  (default n) rows are real. Computes in the engine dtype; returns the output in x's dtype, every
  result cut to `num_valid` rows.
- `route(layer, hidden=None, logits=None, num_valid=None, aux_loss_coeff=None)`: exactly one of
  hidden `[n, H]` / logits `[n, E]`; the aux-loss coefficient defaults to 1.0 (the unscaled
  Switch loss: 1.0 is perfectly balanced). The result also carries the per-token aux scores
  `[n, E]`, from which the batcher computes each merged request's own aux loss.
- Unknown layers raise `UnknownLayerError` (a LookupError: NOT_FOUND); bad shapes / dtypes /
  counts raise ValueError naming the argument (INVALID_ARGUMENT).
- Metrics without prometheus here: `compilations` and `compile_seconds` attributes, and
  `add_compile_listener(fn)`, called with a `CompileEvent` after every compilation.
- One worker thread calls the engine; an internal lock makes concurrent calls safe but serial.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu, experts, moe
from expertd.server import host_allocator, host_memory, steps
from expertd.server.model import ROUTER_PARAMS, LoadedLayer
from expertd.server.placement import AXIS, MeshPlacement, pick_devices, split_over_ep

STEP_KINDS = ("route_hidden", "route_logits", "forward")
# Route's aux loss unscaled by default: 1.0 is perfectly balanced routing, E / k the worst.
DEFAULT_AUX_LOSS_COEFF = 1.0
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))

log = logging.getLogger(__name__)


class UnknownLayerError(LookupError):
    """The engine holds no layer with this index (the servicer answers NOT_FOUND)."""


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """output [n, H] in the input dtype; topk_ids int32 [n, k] (descending weight); topk_weights
    fp32 [n, k]; tokens_per_expert int32 [E] over the n valid tokens."""

    output: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray


@dataclasses.dataclass(frozen=True)
class RouteResult:
    """topk_ids int32 [n, k]; topk_weights fp32 [n, k]; tokens_per_expert int32 [E]; aux_loss
    (Switch load-balancing loss over the n valid tokens, times the coefficient); aux_scores fp32
    [n, E]: the router's dense per-token aux scores, so that callers merging several requests
    into one step get each request's own loss exactly (`steps.aux_loss_of`)."""

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray
    aux_loss: float
    aux_scores: np.ndarray


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One compiled step: `layers` share it; `done` of `total` during warm-up (total 0 outside);
    `compiler_options` are the XLA options it was compiled with (see `moe.compiler_options`);
    `expert_backend` is the expert FFN backend a forward step runs (None for routing steps)."""

    layers: tuple[int, ...]
    bucket: int
    kind: str
    seconds: float
    done: int
    total: int
    compiler_options: dict = dataclasses.field(default_factory=dict)
    expert_backend: str | None = None


def enable_compile_cache(directory) -> None:
    """Turn on JAX's persistent compilation cache in `directory` for this process.

    The thresholds are lowered so that it also stores the small, fast CPU compilations (by default
    JAX skips anything compiled in under a second); `reset_cache` makes a process that already
    compiled something pick up the new directory.
    """
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()


class Engine:
    """MoE layers placed on devices with compiled steps per token bucket (see module docstring).

    Attributes read by the service: `layers` (index -> LoadedLayer, its params now the placed
    device arrays), `buckets`, `dtype`, `devices`, `mesh`, `warm`, `compilations`,
    `compile_seconds`.
    """

    def __init__(self, layers: Sequence[LoadedLayer], *, buckets: Sequence[int], dtype="bfloat16",
                 devices=None, backend: str = "auto", compile_cache_dir=None, huge_pages: bool = True,
                 panel_weights: bool = True):
        if not layers:
            raise ValueError("layers: the engine needs at least one layer")
        self.layers = {}
        for layer in layers:
            if layer.index in self.layers:
                raise ValueError(f"layers: layer {layer.index} is given twice")
            self.layers[layer.index] = layer
        self.buckets = _check_buckets(buckets)
        try:
            self.dtype = jnp.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype!r}") from None
        if self.dtype not in INPUT_DTYPES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype.name}")
        if backend != "auto" and backend not in experts.BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {experts.BACKENDS}, got {backend!r}")
        self.backend = backend
        if compile_cache_dir is not None:
            enable_compile_cache(compile_cache_dir)
        self.compile_cache_dir = compile_cache_dir
        self.placement = MeshPlacement(pick_devices(devices))
        self.devices, self.mesh = self.placement.devices, self.placement.mesh
        self.replicated = self.placement.replicated
        self._ep = self.placement.ep
        for layer in layers:
            self.placement.check_layer(layer)

        self.compilations = 0
        self.compile_seconds = 0.0
        self._listeners: list[Callable[[CompileEvent], None]] = []
        self._lock = threading.RLock()
        self._executables: dict[tuple, object] = {}
        self.warm = False
        self._params = {index: self.placement.place_layer(layer, self.dtype)
                        for index, layer in self.layers.items()}
        if panel_weights and self._native_cpu_runs_every_forward():  # once, at load: the native kernel's layout
            self._params = {index: moe.prepare_params(moe.MoEParams.from_dict(params), self.layers[index].cfg, "cpu",
                                                      backend=self.backend).to_dict()
                            for index, params in self._params.items()}
        native = self._native_cpu_description()
        self.weight_layout = "row_major" if native is None else native["weight_layout"]
        # From here on the layers carry their placed device arrays: the host copies (a real model's
        # whole weights, for a checkpoint) are released once the caller drops its own references.
        self.layers = {index: dataclasses.replace(layer, params=self._params[index])
                       for index, layer in self.layers.items()}
        self.huge_pages = self._advise_huge_pages() if huge_pages else None
        self._keys = {index: (layer.cfg, tuple(sorted((name, moe.logical_shape(p), str(p.dtype))
                                                       for name, p in self._params[index].items())))
                      for index, layer in self.layers.items()}

    # ------------------------------------------------------------------ public API

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket >= num_tokens; ValueError past the largest bucket."""
        if int(num_tokens) < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        for bucket in self.buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"num_tokens={num_tokens} exceeds the largest bucket {self.buckets[-1]}; split the batch")

    def add_compile_listener(self, listener: Callable[[CompileEvent], None]) -> None:
        """Call `listener(CompileEvent)` after every compilation (metrics hook)."""
        self._listeners.append(listener)

    def warmup(self, progress: Callable[[CompileEvent], None] | None = None, *,
               threads: int | None = None) -> None:
        """Compile every (layer config, bucket, step kind); `progress(event)` after each one.

        Steps are traced one after the other (in plan order, identical on every process of a
        multi-host mesh) and compiled by `threads` worker threads (default: one per CPU core; XLA
        compiles outside the GIL), so `compile_seconds` can exceed the wall time.
        """
        groups = self._shape_groups()
        plan = [(key, bucket, kind) for key in groups for bucket in self.buckets for kind in STEP_KINDS]
        todo = [item for item in plan if item not in self._executables]
        done = len(plan) - len(todo)
        pending: dict[concurrent.futures.Future, tuple] = {}

        def finish(futures):
            nonlocal done
            for future in futures:
                key, bucket, kind = pending.pop(future)
                executable, seconds = future.result()
                done += 1
                event = self._record(key, groups[key], bucket, kind, executable, seconds, done, len(plan))
                if progress is not None:
                    progress(event)

        with self._lock, concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            for key, bucket, kind in todo:
                start = time.perf_counter()
                lowered = self._lower(key, groups[key], bucket, kind)
                pending[pool.submit(_timed_compile, lowered, time.perf_counter() - start)] = (key, bucket, kind)
                finish([f for f in pending if f.done()])  # report what finished while tracing
            finish(list(concurrent.futures.as_completed(pending)))
            self.warm = True

    def forward(self, layer: int, x, num_valid: int | None = None) -> ForwardResult:
        """The MoE layer's output for the first `num_valid` rows of x `[n, H]` (see module docstring)."""
        loaded = self._layer(layer)
        x = _check_tokens(x, "x", loaded.cfg.hidden_size, "H")
        n, bucket, num_valid = self._sizes(x, num_valid)
        padded = steps.pad_tokens(x, bucket, self.dtype)
        out, ids, weights, counts = self._run(loaded, bucket, "forward", padded, num_valid)
        return ForwardResult(out[:num_valid].astype(x.dtype), ids[:num_valid], weights[:num_valid], counts)

    def route(self, layer: int, hidden=None, logits=None, num_valid: int | None = None,
              aux_loss_coeff: float | None = None) -> RouteResult:
        """Top-k routing of the first `num_valid` rows of hidden `[n, H]` or logits `[n, E]`."""
        loaded = self._layer(layer)
        if (hidden is None) == (logits is None):
            raise ValueError("route: give exactly one of hidden [n, H] or logits [n, E]")
        if hidden is not None:
            tokens = _check_tokens(hidden, "hidden", loaded.cfg.hidden_size, "H")
            kind, dtype = "route_hidden", self.dtype
        else:
            tokens = _check_tokens(logits, "logits", loaded.cfg.num_experts, "E")
            kind, dtype = "route_logits", np.dtype(np.float32)
        coeff = DEFAULT_AUX_LOSS_COEFF if aux_loss_coeff is None else float(aux_loss_coeff)
        if not np.isfinite(coeff):
            raise ValueError(f"aux_loss_coeff must be finite, got {aux_loss_coeff}")
        n, bucket, num_valid = self._sizes(tokens, num_valid)
        padded = steps.pad_tokens(tokens, bucket, dtype)
        ids, weights, counts, aux, scores = self._run(loaded, bucket, kind, padded, num_valid, coeff)
        return RouteResult(ids[:num_valid], weights[:num_valid], counts, float(aux), scores[:num_valid])

    def info(self) -> dict:
        """Layers (index, source, full config), dtype, buckets, mesh, backend, compile counters, the
        native CPU expert kernel's status, the weights' huge pages and the process's host_allocator
        state (CPU only), the XLA compiler options of forward steps that have any and each forward
        bucket's expert backend."""
        return {
            "layers": [{"index": index, "source": layer.source, "config": dataclasses.asdict(layer.cfg),
                        "params": {name: {"shape": list(moe.logical_shape(p)), "dtype": str(p.dtype),
                                          "split_over_ep": any(map(split_over_ep, jax.tree.leaves(p)))}
                                   for name, p in self._params[index].items()}}
                       for index, layer in sorted(self.layers.items())],
            "dtype": self.dtype.name,
            "buckets": list(self.buckets),
            "mesh": {"axis": AXIS, "size": len(self.devices), "platform": self.devices[0].platform,
                     "devices": [str(d) for d in self.devices],
                     "expert_parallel": self._ep is not None},
            "backend": self.backend,
            "weight_layout": self.weight_layout,
            "panel_columns": (self._native_cpu_description() or {}).get("panel_columns"),
            "warm": self.warm,
            "compilations": self.compilations,
            "compile_seconds": self.compile_seconds,
            "compile_cache_dir": None if self.compile_cache_dir is None else str(self.compile_cache_dir),
            "native_cpu_kernel": self._native_cpu_kernel(),
            "huge_pages": None if self.huge_pages is None else self.huge_pages.as_dict(),
            "host_allocator": host_allocator.state().as_dict() if self.devices[0].platform == "cpu" else None,
            "forward_compiler_options": [
                {"layers": list(layers), "bucket": bucket, "options": options}
                for key, layers in self._shape_groups().items() for bucket in self.buckets
                if (options := self._step_options(key[0], bucket, "forward"))],
            "forward_expert_backends": [
                {"layers": list(layers), "bucket": bucket, "backend": self._step_backend(key[0], bucket, "forward")}
                for key, layers in self._shape_groups().items() for bucket in self.buckets],
        }

    # ------------------------------------------------------------------ internals

    def _advise_huge_pages(self) -> host_memory.HugePageReport | None:
        """Weights on CPU devices onto huge pages (None on other platforms)."""
        if self.devices[0].platform != "cpu":
            return None
        report = host_memory.advise_huge_pages(jax.tree.leaves(list(self._params.values())))
        log.info("weights: %s", host_memory.summary(report.as_dict()))
        return report

    def _native_cpu_runs_every_forward(self) -> bool:
        """Whether every forward step runs its experts through the native CPU kernel (one CPU
        process, no expert parallelism, backend auto or native_cpu, the kernel built): then the
        params go through `moe.prepare_params` at load)."""
        if self.devices[0].platform != "cpu" or self._ep is not None or jax.process_count() > 1:
            return False
        return self.backend in ("auto", "native_cpu") and cpu.available()

    def _native_cpu_description(self) -> dict | None:
        """On CPU, `cpu.describe` of the served params (the kernel's state, their weight layout and
        panel width); None on other platforms, which never run the native kernel."""
        if self.devices[0].platform != "cpu":
            return None
        return cpu.describe(moe.MoEParams.from_dict(next(iter(self._params.values()))))

    def _native_cpu_kernel(self) -> dict | None:
        """On CPU, whether the C++ expert kernel (`auto`'s choice there) is usable and, if not,
        why, and the instruction-set level it runs at (`cpu.isa()`: avx512_bf16 runs bf16
        layers on the bf16 dot product); None on other platforms, which never run it."""
        described = self._native_cpu_description()
        if described is None:
            return None
        return {key: described[key] for key in ("available", "reason", "isa")}

    def _layer(self, index) -> LoadedLayer:
        try:
            return self.layers[int(index)]
        except (KeyError, TypeError, ValueError):
            raise UnknownLayerError(
                f"layer {index!r} is not served; layers: {sorted(self.layers)}") from None

    def _sizes(self, tokens: np.ndarray, num_valid):
        n = tokens.shape[0]
        num_valid = n if num_valid is None else int(num_valid)
        if not 1 <= num_valid <= n:
            raise ValueError(f"num_valid must be between 1 and the {n} rows given, got {num_valid}")
        return n, self.bucket_for(n), num_valid

    def _shape_key(self, layer: LoadedLayer) -> tuple:
        """Layers with equal keys share compiled steps: same config, param shapes and dtypes."""
        return self._keys[layer.index]

    def _shape_groups(self) -> dict[tuple, tuple[int, ...]]:
        groups: dict[tuple, list[int]] = {}
        for index, layer in sorted(self.layers.items()):
            groups.setdefault(self._shape_key(layer), []).append(index)
        return {key: tuple(indices) for key, indices in groups.items()}

    def _run(self, layer: LoadedLayer, bucket: int, kind: str, tokens: np.ndarray, num_valid: int,
             coeff: float = 0.0) -> list[np.ndarray]:
        """Run step `kind` of `layer` on host tokens padded to `bucket`; results on the host."""
        key = self._shape_key(layer)
        with self._lock:
            self._compile(key, (layer.index,), bucket, kind, done=0, total=0)
            step = self._executables[(key, bucket, kind)]
            params, *inputs = self._step_args(layer, kind, tokens, num_valid, coeff)
            return self.placement.fetch(step(params, *map(self.placement.step_input, inputs)))

    def _step_args(self, layer: LoadedLayer, kind: str, tokens, num_valid: int, coeff: float):
        """Arguments of a compiled step: the placed params it reads, then its host inputs (tokens,
        num_valid, and coeff for routing); `tokens` is abstract (ShapeDtypeStruct) when lowering."""
        params = self._params[layer.index]
        if kind == "forward":
            return params, tokens, np.asarray(num_valid, np.int32)
        router = {name: params[name] for name in ROUTER_PARAMS if name in params}
        return router, tokens, np.asarray(num_valid, np.int32), np.asarray(coeff, np.float32)

    def _compile(self, key, layers: tuple[int, ...], bucket: int, kind: str, *, done: int, total: int):
        """Compile step (key, bucket, kind) unless it is compiled; the CompileEvent, or None."""
        if (key, bucket, kind) in self._executables:
            return None
        start = time.perf_counter()
        lowered = self._lower(key, layers, bucket, kind)
        executable, seconds = _timed_compile(lowered, time.perf_counter() - start)
        return self._record(key, layers, bucket, kind, executable, seconds, done, total)

    def _lower(self, key, layers: tuple[int, ...], bucket: int, kind: str) -> jax.stages.Lowered:
        """Trace and lower one step for abstract tokens [bucket, H] (or [bucket, E] logits)."""
        cfg, layer = key[0], self.layers[layers[0]]
        width = cfg.num_experts if kind == "route_logits" else cfg.hidden_size
        token_dtype = np.float32 if kind == "route_logits" else self.dtype
        tokens = jax.ShapeDtypeStruct((bucket, width), token_dtype, sharding=self.replicated)
        abstract = jax.tree.map(functools.partial(_abstract, host_sharding=self.replicated),
                                self._step_args(layer, kind, tokens, 0, 0.0))
        if kind != "forward":
            step = functools.partial(steps.route_step, cfg=cfg, from_logits=kind == "route_logits")
        elif self._ep is None:
            step = functools.partial(steps.forward_step, cfg=cfg, backend=self.backend)
        else:
            step = functools.partial(steps.ep_forward_step, cfg=cfg, backend=self.backend, mesh=self.mesh,
                                     ep=self._ep, axis=AXIS)
        options = self._step_options(cfg, bucket, kind)
        return jax.jit(step, out_shardings=self.replicated, compiler_options=options or None).lower(*abstract)

    def _step_options(self, cfg, bucket: int, kind: str) -> dict:
        """XLA compiler options of a step: `moe.compiler_options` for forward, none for routing."""
        if kind != "forward":
            return {}
        return moe.compiler_options(cfg, bucket, dtype=self.dtype, backend=self.backend,
                                   platform=self.devices[0].platform)

    def _step_backend(self, cfg, bucket: int, kind: str) -> str | None:
        """The expert FFN backend a forward step runs: the engine's, or what `auto` picks for the
        bucket's rows (`experts.choose_backend`; EP ranks pick by their receive buffer, and no
        platform's rule depends on the row count today). None for routing steps."""
        if kind != "forward":
            return None
        if self.backend != "auto":
            return self.backend
        return experts.choose_backend(bucket * cfg.topk, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                      self.dtype, self.devices[0].platform)

    def _record(self, key, layers, bucket, kind, executable, seconds, done, total) -> CompileEvent:
        self._executables[(key, bucket, kind)] = executable
        self.compilations += 1
        self.compile_seconds += seconds
        event = CompileEvent(layers, bucket, kind, seconds, done, total, self._step_options(key[0], bucket, kind),
                             self._step_backend(key[0], bucket, kind))
        for listener in self._listeners:
            listener(event)
        return event


# ---------------------------------------------------------------------- helpers

def _check_buckets(buckets) -> tuple[int, ...]:
    try:
        values = [int(b) for b in buckets]
    except (TypeError, ValueError):
        raise ValueError(f"buckets must be positive integers, got {buckets!r}") from None
    if not values or min(values) < 1 or any(int(b) != b for b in buckets):
        raise ValueError(f"buckets must be a non-empty list of positive integers, got {list(buckets)!r}")
    return tuple(sorted(set(values)))


def _check_tokens(array, name: str, width: int, width_name: str) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape [n, {width_name}={width}], got {list(array.shape)}")
    if array.shape[0] < 1:
        raise ValueError(f"{name} has no rows")
    if array.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {array.dtype}")
    return array


def _timed_compile(lowered: jax.stages.Lowered, lower_seconds: float):
    """(compiled executable, seconds spent lowering and compiling it)."""
    start = time.perf_counter()
    executable = lowered.compile()
    return executable, lower_seconds + time.perf_counter() - start


def _abstract(value, host_sharding):
    """A step argument's abstract value; host (numpy) inputs are replicated over the mesh."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=getattr(value, "sharding", host_sharding))
