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
      layout). Rows past the capacity of their expert are dropped (zeros).

  Backends:
      "reference"   per-expert loop over all rows, selecting each expert's rows (clarity, E x FLOPs)
      "ragged_dot"  jax.lax.ragged_dot (a real grouped GEMM on GPU/TPU; E x FLOPs on CPU)
      "capacity"    rows scattered into [E, C, H], one batched matmul per projection
      "expert_loop" loop over the experts that have rows, each running only its rows in row
                    tiles (dropless, <= 63 masked rows per expert; fp32 compute, see there)
      "pallas"      fused grouped-GEMM Pallas kernel (experts_pallas.py): compiled with
                    Pallas-Triton on GPU, interpret mode on CPU
      "auto"        chosen per platform and shape by `choose_backend` (measured, see there)

  compiler_options(num_rows, E, H, I, *, backend="auto", platform=None) -> dict
      XLA compiler options for the jit of a program running the grouped FFN at that shape (per
      compiled shape: a server passes them per token bucket). Non-empty only on CPU for few rows
      per large expert, where they turn YNNPACK off (measured faster, see SMALL_ROWS_CPU_OPTIONS).

ACTIVATIONS: "silu" (default), "gelu" (exact erf), "gelu_tanh" (tanh approximation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
BACKENDS = ("reference", "ragged_dot", "capacity", "expert_loop", "pallas")


def activation_fn(name: str):
    """The elementwise activation `name` (one of ACTIVATIONS), applied in fp32."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda v: jax.nn.gelu(v, approximate=False)
    if name == "gelu_tanh":
        return lambda v: jax.nn.gelu(v, approximate=True)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def matmul_f32(a, b):
    """a @ b (batched over leading dims of both) with fp32 accumulation and fp32 result."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


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
        return lax.ragged_dot(a, w, gs, preferred_element_type=jnp.float32)

    h = act(rdot(xs, w_gate)) * rdot(xs, w_up)
    y = rdot(h.astype(xs.dtype), w_down).astype(xs.dtype)
    return jnp.where(valid[:, None], y, 0)


def capacity_slots(group_sizes, capacity: int):
    """Row index `int32 [E, C]` feeding each capacity slot; N (out of range) for empty slots."""
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs
    slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    return jnp.where(slot < gs[:, None], offsets[:, None] + slot, jnp.iinfo(jnp.int32).max)


def grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", capacity=None):
    """Capacity-padded grouped FFN: gather rows into `[E, C, H]`, batched matmuls, gather back."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    n = xs.shape[0]
    capacity = n if capacity is None else int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    slots = capacity_slots(group_sizes, capacity)  # [E, C]
    buf = xs.at[slots].get(mode="fill", fill_value=0)  # [E, C, H]; empty slots are 0
    out = gated_mlp(buf, w_gate, w_up, w_down, activation)  # [E, C, H]
    expert, valid = row_experts(group_sizes, n)
    gs = group_sizes.astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32) - jnp.take(jnp.cumsum(gs) - gs, jnp.minimum(expert, gs.shape[0] - 1))
    kept = valid & (pos < capacity)
    y = out.at[jnp.minimum(expert, gs.shape[0] - 1), jnp.minimum(pos, capacity - 1)].get()
    return jnp.where(kept[:, None], y, 0)


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

    def tile(out, weights, start, size, keep):
        g, u, d = weights
        x = lax.dynamic_slice(x32, (start, 0), (size, h))
        y = (act(x @ g) * (x @ u)).astype(xs.dtype).astype(jnp.float32) @ d
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


def choose_backend(num_rows: int, num_experts: int, hidden: int, intermediate: int, dtype,
                   platform: str | None = None) -> str:
    """The backend "auto" runs for `num_rows` (= T*k) rows of this shape on this platform.

    CPU: "expert_loop", measured fastest at every benchmarked shape when compiled with
    `compiler_options` (benchmarks/moe_layer.py, BENCHMARKS.md "MoE layer": T in {16, 256, 4096},
    E in {8, 64}, bf16 and fp32). "capacity" came close only at T=16, E=8 (its E*T padded rows
    match the loop's tiles there: fp32 48 ms vs 66 ms for expert_loop with default options, 45.5
    ms with YNNPACK off) and pays E/k x the FLOPs at large T; ragged_dot and the reference do
    E x the FLOPs on CPU; Pallas runs interpreted. GPU / TPU: "ragged_dot", XLA's native grouped
    GEMM there; the Pallas kernel is written for GPU but has not been compiled or measured on one,
    so "auto" does not pick it yet.
    The shape arguments are part of the contract for when a platform's choice depends on them.
    """
    platform = platform or jax.default_backend()
    return "expert_loop" if platform == "cpu" else "ragged_dot"


# XLA:CPU options for programs whose expert_loop runs few rows per large expert. jaxlib lowers every
# dot to YNNPACK by default; with fewer than 64 rows per expert and an expert matrix of 8 MiB (fp32
# [1024, 2048]) XLA's own dot emitter ran the whole layer 1.26-2.18x faster (E=8, T in {1..128}, bf16
# and fp32; also 1.2-1.9x on Qwen3-30B-A3B / Mixtral-8x7B layer shapes), while for 2 MiB matrices
# ([1024, 512], E=64) it was 0.80-1.02x and at 64 rows per expert about even (two A/B runs on the
# CPU dev box, `benchmarks/moe_layer.py --options-ab`, BENCHMARKS.md "MoE layer"). Compiler
# options are per compiled program, so a server applies them per token bucket; the 4 MiB cut
# lies between the two measured matrix sizes.
SMALL_ROWS_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SMALL_ROWS_PER_EXPERT = 64
SMALL_ROWS_MIN_MATRIX_BYTES = 4 << 20


@functools.cache
def small_rows_cpu_options() -> dict:
    """SMALL_ROWS_CPU_OPTIONS if this jaxlib's compiler knows them, else {} (debug option names
    change across XLA releases; an unknown one fails the compile)."""
    try:
        jax.jit(lambda v: v + 1, compiler_options=SMALL_ROWS_CPU_OPTIONS).lower(jnp.zeros((), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - an unknown option name raises a version-specific error type
        return {}
    return dict(SMALL_ROWS_CPU_OPTIONS)


def compiler_options(num_rows: int, num_experts: int, hidden: int, intermediate: int, *,
                     backend: str = "auto", platform: str | None = None) -> dict:
    """XLA compiler options for a program running the grouped FFN on `num_rows` rows of this shape.

    Pass them to `jax.jit(..., compiler_options=...)` of the program that calls `grouped_ffn` (or
    `moe.moe_layer`, see `moe.compiler_options`). On CPU, when `backend` resolves to "expert_loop"
    with fewer than SMALL_ROWS_PER_EXPERT rows per expert and fp32 expert matrices of at least
    SMALL_ROWS_MIN_MATRIX_BYTES, this is SMALL_ROWS_CPU_OPTIONS (YNNPACK off, measured faster, see
    there) if this jaxlib accepts it; otherwise (other platforms and shapes) an empty dict.
    """
    platform = platform or jax.default_backend()
    if backend == "auto":
        backend = choose_backend(num_rows, num_experts, hidden, intermediate, jnp.float32, platform)
    few_rows = num_rows < SMALL_ROWS_PER_EXPERT * num_experts
    large_matrix = hidden * intermediate * 4 >= SMALL_ROWS_MIN_MATRIX_BYTES
    if platform != "cpu" or backend != "expert_loop" or not (few_rows and large_matrix):
        return {}
    return small_rows_cpu_options()


def grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", backend="auto",
                capacity=None):
    """Grouped gated-MLP over expert-major rows; see the module docstring for the contract."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    activation_fn(activation)  # validate early
    if backend == "auto":
        e, h, i = w_gate.shape
        backend = choose_backend(xs.shape[0], e, h, i, xs.dtype)
    if backend == "reference":
        return grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "ragged_dot":
        return grouped_ffn_ragged_dot(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "capacity":
        return grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, activation=activation,
                                    capacity=capacity)
    if backend == "expert_loop":
        return grouped_ffn_expert_loop(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    if backend == "pallas":
        from expertd.kernels.experts_pallas import grouped_ffn_pallas

        return grouped_ffn_pallas(xs, group_sizes, w_gate, w_up, w_down, activation=activation)
    raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
