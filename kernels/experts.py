"""Grouped expert FFN: every expert's gated MLP over its block of expert-major rows.

    y = (act(x @ W_gate[e]) * (x @ W_up[e])) @ W_down[e]      (SwiGLU with act = silu)

Public API (the expert-parallel layer reuses it; T tokens, H hidden, I intermediate, E experts,
N rows):

  grouped_ffn(xs [N, H], group_sizes int32 [E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H],
              *, activation="silu", backend="auto", capacity=None) -> [N, H] xs.dtype
      Rows are expert-major: expert e owns rows [offset_e, offset_e + group_sizes[e]) with
      offset = exclusive cumsum(group_sizes) (the layout of `dispatch.permute`, pad rows included).
      Rows at or past sum(group_sizes) are not read as data (they may hold NaN garbage) and come
      back as exact zeros; experts with no rows produce nothing. bf16 inputs run with fp32
      accumulation (preferred_element_type); the activation product is taken in fp32 and rounded
      to xs.dtype before the down projection (as the Hugging Face models do in bf16).
      `capacity` (static int, "capacity" backend only): rows per expert in the padded [E, C, H]
      buffer; None = dropless (C = N, or pass the largest possible group, e.g. T for a top-k
      layout). Rows past the capacity of their expert are dropped (zeros). Each call runs the
      smallest of `capacity_buckets(capacity)` that holds its largest group (same results).

  Backends:
      "reference"   per-expert loop over all rows, selecting each expert's rows (clarity, E x FLOPs)
      "ragged_dot"  jax.lax.ragged_dot (a real grouped GEMM on GPU/TPU; E x FLOPs on CPU)
      "capacity"    rows scattered into [E, C, H], one batched matmul per projection (C chosen
                    per call from a few compiled sizes, see capacity_buckets)
      "expert_loop" loop over the experts that have rows, each running only its rows in row
                    tiles (dropless, <= 63 masked rows per expert; fp32 compute, see there)
      "native_cpu"  a C++ XLA:CPU custom call (native_cpu.py) per projection: few rows per
                    expert stream each used expert's weights once in place (bf16 widened in
                    registers), many rows run a packed register-blocked GEMM; CPU only, built
                    with the system compiler on first use
      "pallas"      fused grouped-GEMM Pallas kernel (experts_pallas.py): compiled with
                    Pallas-Triton on GPU, interpret mode on CPU
      "auto"        chosen per platform and shape by `choose_backend` (measured, see there)

  compiler_options(num_rows, E, H, I, *, dtype, backend="auto", platform=None) -> dict
      XLA compiler options for the jit of a program running the grouped FFN at that shape and
      weight dtype (per compiled shape: a server passes them per token bucket). Non-empty only on
      CPU for few rows per large expert, where they turn YNNPACK off (measured faster, see
      SMALL_ROWS_CPU_OPTIONS).

ACTIVATIONS: "silu" (default), "gelu" (exact erf), "gelu_tanh" (tanh approximation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels import panels

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
BACKENDS = ("reference", "ragged_dot", "capacity", "expert_loop", "native_cpu", "pallas")


def activation_fn(name: str):
    """The elementwise activation `name` (one of ACTIVATIONS), applied in fp32."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda v: jax.nn.gelu(v, approximate=False)
    if name == "gelu_tanh":
        return lambda v: jax.nn.gelu(v, approximate=True)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def matmul_precision(*operands) -> lax.Precision:
    """The precision of a product of `operands`: HIGHEST where one is fp32, DEFAULT otherwise.

    fp32 weights are computed in fp32: left at DEFAULT, GPUs run fp32 products as TF32 (or bf16
    passes), ~1e-3 relative error. bf16 operands are exact in any mode (their products accumulate
    in fp32 through preferred_element_type). On CPU both settings compute the same fp32 product.
    """
    return lax.Precision.HIGHEST if any(jnp.dtype(o.dtype) == jnp.float32 for o in operands) else lax.Precision.DEFAULT


def matmul_f32(a, b):
    """a @ b (batched over leading dims of both) with fp32 accumulation and fp32 result."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32, precision=matmul_precision(a, b))


def gated_mlp(x, w_gate, w_up, w_down, activation: str = "silu"):
    """One (or a batch of) dense gated MLP(s): `x [..., M, H]` -> `[..., M, H]` in x.dtype."""
    act = activation_fn(activation)
    h = act(matmul_f32(x, w_gate)) * matmul_f32(x, w_up)
    return matmul_f32(h.astype(x.dtype), w_down).astype(x.dtype)


def row_experts(group_sizes, num_rows: int):
    """Expert of every row `int32 [N]` (E for rows past the last block) and the row's validity."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return expert, rows < ends[-1]


def check_ffn_args(xs, group_sizes, w_gate, w_up, w_down):
    """ValueError naming the argument whose shape does not fit the grouped FFN contract."""
    if xs.ndim != 2:
        raise ValueError(f"xs must be [N, H], got shape {xs.shape}")
    h = xs.shape[1]
    if w_gate.ndim != 3 or w_gate.shape[1] != h:
        raise ValueError(f"w_gate must be [E, H={h}, I], got shape {w_gate.shape}")
    e, _, i = w_gate.shape
    if w_up.shape != (e, h, i):
        raise ValueError(f"w_up must be [E, H, I] = {(e, h, i)}, got shape {w_up.shape}")
    if w_down.shape != (e, i, h):
        raise ValueError(f"w_down must be [E, I, H] = {(e, i, h)}, got shape {w_down.shape}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes must be int32 [E={e}], got shape {group_sizes.shape}")


def grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu"):
    """Per-expert reference: run expert e on every row, keep the rows of its block."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    expert, valid = row_experts(group_sizes, xs.shape[0])
    xs = jnp.where(valid[:, None], xs, 0)

    def one_expert(e, out):
        y = gated_mlp(xs, w_gate[e], w_up[e], w_down[e], activation)
        return jnp.where((expert == e)[:, None], y, out)

    return lax.fori_loop(0, w_gate.shape[0], one_expert, jnp.zeros_like(xs))


def grouped_ffn_ragged_dot(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu"):
    """Grouped FFN through `jax.lax.ragged_dot` (rows past sum(group_sizes) come back zero)."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    _, valid = row_experts(group_sizes, xs.shape[0])
    xs = jnp.where(valid[:, None], xs, 0)
    gs = group_sizes.astype(jnp.int32)
    act = activation_fn(activation)

    def rdot(a, w):
        return lax.ragged_dot(a, w, gs, preferred_element_type=jnp.float32, precision=matmul_precision(a, w))

    h = act(rdot(xs, w_gate)) * rdot(xs, w_up)
    y = rdot(h.astype(xs.dtype), w_down).astype(xs.dtype)
    return jnp.where(valid[:, None], y, 0)


def capacity_slots(group_sizes, capacity: int):
    """Row index `int32 [E, C]` feeding each capacity slot; N (out of range) for empty slots."""
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs
    slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    return jnp.where(slot < gs[:, None], offsets[:, None] + slot, jnp.iinfo(jnp.int32).max)


# The "capacity" backend compiles its batched FFN for a few capacities and runs the smallest that
# holds the largest group (lax.switch on max(group_sizes)): capacity / 2^j for j < this many, rounded
# up to a multiple of 8 and no smaller than 8. Results are those of the full capacity (every bucket
# holds every row it runs, and rows past the full capacity are dropped as before); only the padded
# work shrinks: with C = T dropless, T=16 and 8 experts ran 16 rows per expert where ~4-9 are used.
CAPACITY_BUCKETS = 6


def capacity_buckets(capacity: int) -> tuple[int, ...]:
    """The capacities, ascending and ending in `capacity`, that the capacity backend chooses from."""
    sizes = {capacity}
    for j in range(1, CAPACITY_BUCKETS):
        size = -(-capacity // (8 << j)) * 8  # ceil(capacity / 2^j) rounded up to a multiple of 8
        if size < capacity:
            sizes.add(size)
        if size <= 8:
            break
    return tuple(sorted(sizes))


def _capacity_ffn(xs, group_sizes, w_gate, w_up, w_down, activation, capacity: int):
    """Grouped FFN through a `[E, capacity, H]` buffer; rows past the capacity of their expert -> 0."""
    n = xs.shape[0]
    slots = capacity_slots(group_sizes, capacity)  # [E, C]
    buf = xs.at[slots].get(mode="fill", fill_value=0)  # [E, C, H]; empty slots are 0
    out = gated_mlp(buf, w_gate, w_up, w_down, activation)  # [E, C, H]
    expert, valid = row_experts(group_sizes, n)
    gs = group_sizes.astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32) - jnp.take(jnp.cumsum(gs) - gs, jnp.minimum(expert, gs.shape[0] - 1))
    kept = valid & (pos < capacity)
    y = out.at[jnp.minimum(expert, gs.shape[0] - 1), jnp.minimum(pos, capacity - 1)].get()
    return jnp.where(kept[:, None], y, 0)


def grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", capacity=None):
    """Capacity-padded grouped FFN: gather rows into `[E, C, H]`, batched matmuls, gather back.

    C is chosen per call from `capacity_buckets(capacity)`: the smallest that holds the largest
    group (the full capacity when a group exceeds it, whose extra rows are dropped), so a dropless
    capacity costs the padding of the batch at hand, not of the worst case. On GPU the switch reads
    max(group_sizes) on the host (a sync per call)."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    capacity = xs.shape[0] if capacity is None else int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    buckets = capacity_buckets(capacity)
    branches = [functools.partial(_capacity_ffn, activation=activation, capacity=c) for c in buckets]
    if len(branches) == 1:
        return branches[0](xs, group_sizes, w_gate, w_up, w_down)
    largest = jnp.max(group_sizes.astype(jnp.int32))
    index = jnp.minimum(jnp.sum(largest > jnp.asarray(buckets, jnp.int32)), len(buckets) - 1)
    return lax.switch(index, branches, xs, group_sizes, w_gate, w_up, w_down)


# Row tiles of the "expert_loop" backend, largest first. An expert's rows run as full tiles of a
# size, plus one masked tile of that size when at least 3/4 of it would be used; what is left goes
# to the next size, and the last size covers the rest with masked tiles (so at most 63 masked rows
# per expert). XLA:CPU's dot does ~2-3x more work per second from 64 rows up than at 8-32, so a
# quarter of masked rows costs less than smaller tiles; small decode groups run in 8-row tiles.
# Chosen by A/B timing on the CPU dev box (256/64/8 beat 256/64/16, 256/64/16/4 and 256/32/4 over
# T in {16, 256}); three sizes keep the compiled program small (each is one copy of the MLP).
LOOP_TILES = (256, 64, 8)


def _widen(bits_or_w):
    """fp32 from raw bf16 bits (uint16) or from any float array."""
    if bits_or_w.dtype == jnp.uint16:
        return lax.bitcast_convert_type(bits_or_w.astype(jnp.uint32) << 16, jnp.float32)
    return bits_or_w.astype(jnp.float32)


def _raw(w):
    """bf16 weights as their uint16 bit patterns (slicing those is never widened whole by XLA)."""
    return lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w


def expert_weights_f32(w, e):
    """fp32 copy of expert e's weights `w[e]`, converting only that expert.

    XLA:CPU rewrites convert(dynamic_slice(bf16)) as a slice of the whole array converted, i.e.
    it would convert every expert's weights on every call; slicing the raw 16-bit pattern and
    widening it by hand (bf16 is the top half of an fp32) keeps the work to the one expert."""
    return _widen(lax.dynamic_index_in_dim(_raw(w), e, keepdims=False))


def grouped_ffn_expert_loop(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu"):
    """Grouped FFN as a loop over the experts that have rows, each running only its own rows.

    XLA:CPU has no grouped GEMM (ragged_dot costs E x the FLOPs there) and no bf16 matmul unit
    on AVX2 machines (its bf16 ops convert whole operands to fp32), so this path computes in
    fp32: the rows are converted once, each expert's weights once per call and only for experts
    that have rows (see expert_weights_f32), and the output buffer stays fp32 inside the loops (a
    bf16 loop-carried buffer gets converted whole on every update). `h` is rounded to xs.dtype
    before the down projection, as in the other backends. Rows past sum(group_sizes) are never
    read as data.
    """
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    n, h = xs.shape
    act = activation_fn(activation)
    pad = LOOP_TILES[0]  # masked tiles may read up to pad - 1 rows past the last one
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs
    _, valid = row_experts(gs, n)
    x32 = jnp.concatenate([jnp.where(valid[:, None], xs, 0).astype(jnp.float32), jnp.zeros((pad, h), jnp.float32)])

    # bf16 operands widened to fp32 are exact at any precision; fp32 ones need HIGHEST (no TF32)
    precision = matmul_precision(xs, w_gate, w_up, w_down)

    def tile(out, weights, start, size, keep):
        g, u, d = (functools.partial(jnp.matmul, b=w, precision=precision) for w in weights)
        x = lax.dynamic_slice(x32, (start, 0), (size, h))
        y = d((act(g(x)) * u(x)).astype(xs.dtype).astype(jnp.float32))
        # a partial tile must not overwrite the next expert's rows
        y = jnp.where(keep[:, None], y, lax.dynamic_slice(out, (start, 0), (size, h)))
        return lax.dynamic_update_slice(out, y, (start, 0))

    def tiles(out, weights, start, count, size, remaining):
        """`count` tiles of `size` rows from `start`, rows past `remaining` masked."""
        def body(i, o):
            keep = jnp.arange(size) < remaining - i * size
            return tile(o, weights, start + i * size, size, keep)
        return lax.fori_loop(0, count, body, out)

    def one_expert(e, out):
        weights = tuple(expert_weights_f32(w, e) for w in (w_gate, w_up, w_down))
        start, rest = offsets[e], gs[e]
        for size in LOOP_TILES[:-1]:
            count = rest // size + ((rest % size) * 4 >= 3 * size)
            out = tiles(out, weights, start, count, size, rest)
            covered = jnp.minimum(count * size, rest)
            start, rest = start + covered, rest - covered
        small = LOOP_TILES[-1]
        return tiles(out, weights, start, (rest + small - 1) // small, small, rest)

    def maybe_expert(e, out):
        return lax.cond(gs[e] > 0, one_expert, lambda _, o: o, e, out)

    out = lax.fori_loop(0, w_gate.shape[0], maybe_expert, jnp.zeros((n + pad, h), jnp.float32))
    return jnp.where(valid[:, None], out[:n], 0).astype(xs.dtype)


def grouped_ffn_native_cpu(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", source=None):
    """Grouped FFN through the C++ grouped matmul (`native_cpu.grouped_matmul`), one call per
    projection, fp32 accumulation; `h` is rounded to xs.dtype before the down projection as in the
    other backends. The kernel never reads rows past sum(group_sizes) nor experts without rows, and
    writes zeros there, so no mask is needed.

    With `source int32 [N]` (a Permutation's token_of_row), `xs` is the `[T, H]` token rows and the
    gate / up projections gather their rows by it inside the kernel (moe_layer's CPU path: the
    permuted `[N, H]` copy of x is never written); the result is `[N, H]` either way."""
    from expertd.kernels import native_cpu

    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    act = activation_fn(activation)
    x32 = xs.astype(jnp.float32)
    h = (act(native_cpu.grouped_matmul(x32, group_sizes, w_gate, source=source))
         * native_cpu.grouped_matmul(x32, group_sizes, w_up, source=source))
    y = native_cpu.grouped_matmul(h.astype(xs.dtype).astype(jnp.float32), group_sizes, w_down)
    return y.astype(xs.dtype)


def expected_touched_fraction(num_rows: int, num_experts: int) -> float:
    """Expected fraction of the experts that get at least one of `num_rows` rows, each row routed to
    an expert uniformly at random (a top-k layout of T*k rows is within 0.03 of this for T >= 4)."""
    return 1.0 - (1.0 - 1.0 / num_experts) ** num_rows


# CPU backend and XLA options for few rows per large expert (all measured on the CPU dev box,
# BENCHMARKS.md "MoE layer"; `benchmarks/moe_layer.py --options-ab` re-measures them on any CPU).
# - jaxlib lowers every dot to YNNPACK by default. With fewer than 64 rows per expert and 8 MiB fp32
#   expert matrices ([1024, 2048]) XLA's own dot emitter ran expert_loop 1.25-2.18x faster (E=8, T in
#   1..128, bf16 and fp32, three A/B runs; 1.2-1.9x on Qwen3-30B-A3B / Mixtral-8x7B layer shapes),
#   while for 2 MiB matrices ([1024, 512], E=64) it was 0.80-1.02x and at 64 rows per expert about
#   even. The 4 MiB cut lies between the two measured sizes.
# - With fp32 weights, fewer than 16 rows per expert and most experts in use, the capacity backend
#   (one batched dot per projection over every expert, C from capacity_buckets) beats expert_loop:
#   its dots read the weights in place at ~12 GB/s where expert_loop copies each expert's slice
#   first and streams ~4-5 GB/s (E=8, T 4-16: 1.36-2.11x; E=128 [2048, 768], T 16-128: 1.03-1.89x;
#   two A/B runs).
#   It reads every expert, so with under half of them in use it lost (0.28-0.55x at E=8, T=1 and
#   E=128, T=4); with 16 rows per expert its padded rows (C = 32) make it compute-bound, and it
#   won at E=8 (T 64-128: 1.25-1.35x) but lost at E=128, T=256 (0.86x), so the cut is 16.
#   bf16 weights stay on expert_loop: a batched dot over bf16 weights converts all of them per call.
# - Above all of these, when its C++ kernel builds (native_cpu.py), the "native_cpu" backend at
#   every batch size: below 32 rows per expert it reads each used expert's weights once in place
#   and widens bf16 in registers; from 32 rows it packs them into panels for a register-blocked
#   GEMM micro-kernel. Against expert_loop with the better of its two options (interleaved A/B) it
#   ran the layer 1.5-5.2x faster below 64 rows per expert (E in {8, 64, 128}, T 1-256, bf16 and
#   fp32; session 5's streaming kernel), and with the packed path 1.57-1.65x at 32-64 rows,
#   1.20-1.36x at 128-256 and 1.05-1.08x at 512-1024 (E in {8, 64}, T 256-4096).
# Compiler options are per compiled program, so a server applies them per token bucket.
SMALL_ROWS_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SMALL_ROWS_PER_EXPERT = 64
SMALL_ROWS_MIN_MATRIX_BYTES = 4 << 20
CAPACITY_MIN_TOUCHED = 0.5
# GPU, bf16 weights: from this many rows (T*k) on, the Pallas grouped GEMM beats ragged_dot
# (BENCHMARKS.md, GPU section); below it ragged_dot is faster.
GPU_PALLAS_MIN_ROWS = 2048
CAPACITY_ROWS_PER_EXPERT = 16


def few_rows_per_large_expert(num_rows: int, num_experts: int, hidden: int, intermediate: int) -> bool:
    """Fewer than SMALL_ROWS_PER_EXPERT rows per expert, and fp32 expert matrices of at least
    SMALL_ROWS_MIN_MATRIX_BYTES: the regime of the CPU rules above."""
    return (num_rows < SMALL_ROWS_PER_EXPERT * num_experts
            and hidden * intermediate * 4 >= SMALL_ROWS_MIN_MATRIX_BYTES)


def choose_backend(num_rows: int, num_experts: int, hidden: int, intermediate: int, dtype,
                   platform: str | None = None) -> str:
    """The backend "auto" runs for `num_rows` (= T*k) rows of this shape on this platform.

    `dtype` is the expert weights' dtype. CPU: "native_cpu" whenever its kernel is available (see
    the comment above SMALL_ROWS_CPU_OPTIONS); without it, "capacity" for fp32 weights with fewer than
    CAPACITY_ROWS_PER_EXPERT rows per large expert (`few_rows_per_large_expert`) when at least
    CAPACITY_MIN_TOUCHED of the experts are expected in use (measured faster there, see the
    comment above SMALL_ROWS_CPU_OPTIONS);
    otherwise "expert_loop", measured fastest at every other benchmarked shape when compiled with
    `compiler_options` (benchmarks/moe_layer.py: T in {16, 256, 4096}, E in {8, 64}, bf16 and
    fp32). ragged_dot and the reference do E x the FLOPs on CPU, capacity pays E/k x at large T,
    and Pallas runs interpreted. GPU: the Pallas grouped GEMM for bf16 weights from
    GPU_PALLAS_MIN_ROWS rows on (H and I multiples of 16), "ragged_dot" (XLA's grouped GEMM)
    below that, for fp32 weights and on other accelerators. "capacity" is never chosen on GPU:
    its dropless buffer is E x the rows.
    """
    platform = platform or jax.default_backend()
    if platform == "gpu" and (jnp.dtype(dtype) == jnp.bfloat16 and num_rows >= GPU_PALLAS_MIN_ROWS
                              and hidden % 16 == 0 and intermediate % 16 == 0):
        return "pallas"
    if platform != "cpu":
        return "ragged_dot"
    if native_cpu_available():
        return "native_cpu"
    if (jnp.dtype(dtype) == jnp.float32 and num_rows < CAPACITY_ROWS_PER_EXPERT * num_experts
            and few_rows_per_large_expert(num_rows, num_experts, hidden, intermediate)
            and expected_touched_fraction(num_rows, num_experts) >= CAPACITY_MIN_TOUCHED):
        return "capacity"
    return "expert_loop"


def native_cpu_available() -> bool:
    """Whether the C++ kernel of the "native_cpu" backend is built and usable (builds it once)."""
    from expertd.kernels import native_cpu

    return native_cpu.available()


@functools.cache
def small_rows_cpu_options() -> dict:
    """SMALL_ROWS_CPU_OPTIONS if this jaxlib's compiler knows them, else {} (debug option names
    change across XLA releases; an unknown one fails the compile)."""
    try:
        jax.jit(lambda v: v + 1, compiler_options=SMALL_ROWS_CPU_OPTIONS).lower(jnp.zeros((), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - an unknown option name raises a version-specific error type
        return {}
    return dict(SMALL_ROWS_CPU_OPTIONS)


def compiler_options(num_rows: int, num_experts: int, hidden: int, intermediate: int, *, dtype,
                     backend: str = "auto", platform: str | None = None) -> dict:
    """XLA compiler options for a program running the grouped FFN on `num_rows` rows of this shape.

    Pass them to `jax.jit(..., compiler_options=...)` of the program that calls `grouped_ffn` (or
    `moe.moe_layer`, see `moe.compiler_options`); `dtype` is the expert weights' dtype. On CPU with
    few rows per large expert (`few_rows_per_large_expert`) this is SMALL_ROWS_CPU_OPTIONS (YNNPACK
    off, measured faster, see there) for "expert_loop", and for "capacity" with fp32 weights, if
    this jaxlib accepts it; otherwise (other platforms, shapes and backends) an empty dict.
    """
    platform = platform or jax.default_backend()
    if backend == "auto":
        backend = choose_backend(num_rows, num_experts, hidden, intermediate, dtype, platform)
    wants_no_ynn = backend == "expert_loop" or (backend == "capacity" and jnp.dtype(dtype) == jnp.float32)
    if platform != "cpu" or not wants_no_ynn or not few_rows_per_large_expert(num_rows, num_experts, hidden, intermediate):
        return {}
    return small_rows_cpu_options()


def grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", backend="auto",
                capacity=None):
    """Grouped gated-MLP over expert-major rows; see the module docstring for the contract."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    activation_fn(activation)  # validate early
    if backend == "auto":
        e, h, i = w_gate.shape
        backend = choose_backend(xs.shape[0], e, h, i, w_gate.dtype)
    if backend != "native_cpu":  # only the native kernel reads panel-major weights in place
        w_gate, w_up, w_down = (panels.dense(w) for w in (w_gate, w_up, w_down))
    if backend == "reference":
        return grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "ragged_dot":
        return grouped_ffn_ragged_dot(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "capacity":
        return grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, activation=activation,
                                    capacity=capacity)
    if backend == "expert_loop":
        return grouped_ffn_expert_loop(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "native_cpu":
        return grouped_ffn_native_cpu(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "pallas":
        from expertd.kernels.experts_pallas import grouped_ffn_pallas

        return grouped_ffn_pallas(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
