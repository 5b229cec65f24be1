"""The grouped-FFN backends built from XLA ops: "ragged_dot", "capacity" and "expert_loop".

Each has the contract of `expertd.kernels.ffn` (xs [N, H] expert-major rows, group_sizes int32 [E],
w_gate / w_up [E, H, I], w_down [E, I, H] -> [N, H] xs.dtype; rows past sum(group_sizes) never
read, zeros out) and is compared with `ffn.grouped_ffn_reference` in tests/kernels/test_experts.py.

  grouped_ffn_ragged_dot   jax.lax.ragged_dot: a real grouped GEMM on GPU/TPU (E x FLOPs on CPU)
  grouped_ffn_capacity     rows scattered into [E, C, H], one batched matmul per projection, C
                           chosen per call from `capacity_buckets(capacity)`
  grouped_ffn_expert_loop  a loop over the experts that have rows, each running only its own rows
                           in row tiles (LOOP_TILES), computed in fp32
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from expertd.kernels.ffn import (
    ExpertBiases,
    as_gated_activation,
    check_ffn_args,
    gated_mlp,
    grouped_ffn_by,
    matmul_precision,
    row_experts,
)


def grouped_ffn_ragged_dot(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None):
    """Grouped FFN through `jax.lax.ragged_dot` (rows past sum(group_sizes) come back zero)."""
    def rdot(a, w, gs):
        return lax.ragged_dot(a, w, gs, preferred_element_type=jnp.float32, precision=matmul_precision(a, w))

    return grouped_ffn_by(rdot, xs, group_sizes, w_gate, w_up, w_down, activation=activation, biases=biases)


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
# work shrinks (a dropless C = T is the worst case; a decode batch uses a fraction of it).
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


def _capacity_ffn(xs, group_sizes, w_gate, w_up, w_down, biases, activation, capacity: int):
    """Grouped FFN through a `[E, capacity, H]` buffer; rows past the capacity of their expert -> 0
    (empty slots compute their expert's biases alone, and are never read back)."""
    n = xs.shape[0]
    slots = capacity_slots(group_sizes, capacity)  # [E, C]
    buf = xs.at[slots].get(mode="fill", fill_value=0)  # [E, C, H]; empty slots are 0
    per_expert = None if biases is None else ExpertBiases(*(b[:, None, :] for b in biases))
    out = gated_mlp(buf, w_gate, w_up, w_down, activation, per_expert)  # [E, C, H]
    expert, valid = row_experts(group_sizes, n)
    gs = group_sizes.astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32) - jnp.take(jnp.cumsum(gs) - gs, jnp.minimum(expert, gs.shape[0] - 1))
    kept = valid & (pos < capacity)
    y = out.at[jnp.minimum(expert, gs.shape[0] - 1), jnp.minimum(pos, capacity - 1)].get()
    return jnp.where(kept[:, None], y, 0)


def grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", capacity=None, biases=None):
    """Capacity-padded grouped FFN: gather rows into `[E, C, H]`, batched matmuls, gather back.

    C is chosen per call from `capacity_buckets(capacity)`: the smallest that holds the largest
    group (the full capacity when a group exceeds it, whose extra rows are dropped), so a dropless
    capacity costs the padding of the batch at hand, not of the worst case. On GPU the switch reads
    max(group_sizes) on the host (a sync per call)."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    capacity = xs.shape[0] if capacity is None else int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    buckets = capacity_buckets(capacity)
    glu = as_gated_activation(activation)
    branches = [functools.partial(_capacity_ffn, activation=glu, capacity=c) for c in buckets]
    if len(branches) == 1:
        return branches[0](xs, group_sizes, w_gate, w_up, w_down, biases)
    largest = jnp.max(group_sizes.astype(jnp.int32))
    index = jnp.minimum(jnp.sum(largest > jnp.asarray(buckets, jnp.int32)), len(buckets) - 1)
    return lax.switch(index, branches, xs, group_sizes, w_gate, w_up, w_down, biases)


# Row tiles of the "expert_loop" backend, largest first. An expert's rows run as full tiles of a
# size, plus one masked tile of that size when at least 3/4 of it would be used; what is left goes
# to the next size, and the last size covers the rest with masked tiles (so at most 63 masked rows
# per expert). Rule: large tiles first, because XLA:CPU's dot does more work per second on tiles of
# 64 rows and up than on 8-32, so a quarter of masked rows costs less than smaller tiles; three
# sizes keep the compiled program small (each is one copy of the MLP). The sizes are the fastest
# of the sets compared by `benchmarks/moe_layer.py` (BENCHMARKS.md).
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


def grouped_ffn_expert_loop(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None):
    """Grouped FFN as a loop over the experts that have rows, each running only its own rows.

    XLA:CPU has no grouped GEMM (ragged_dot costs E x the FLOPs there) and no bf16 matmul unit
    on AVX2 machines (its bf16 ops convert whole operands to fp32), so this path computes in
    fp32: the rows are converted once, each expert's weights once per call and only for experts
    that have rows (see expert_weights_f32), and the output buffer stays fp32 inside the loops (a
    bf16 loop-carried buffer gets converted whole on every update). `h` is rounded to xs.dtype
    before the down projection, as in the other backends. Rows past sum(group_sizes) are never
    read as data.
    """
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    n, h = xs.shape
    glu = as_gated_activation(activation)
    pad = LOOP_TILES[0]  # masked tiles may read up to pad - 1 rows past the last one
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs
    _, valid = row_experts(gs, n)
    x32 = jnp.concatenate([jnp.where(valid[:, None], xs, 0).astype(jnp.float32), jnp.zeros((pad, h), jnp.float32)])

    # bf16 operands widened to fp32 are exact at any precision; fp32 ones need HIGHEST (no TF32)
    precision = matmul_precision(xs, w_gate, w_up, w_down)

    def tile(out, weights, start, size, keep):
        g, u, d = (functools.partial(jnp.matmul, b=w, precision=precision) for w in weights[:3])
        x = lax.dynamic_slice(x32, (start, 0), (size, h))
        if len(weights) == 3:
            y = d(glu(g(x), u(x)).astype(xs.dtype).astype(jnp.float32))
        else:  # with this expert's biases (fp32 [I], [I], [H])
            bg, bu, bd = weights[3:]
            y = d(glu(g(x) + bg, u(x) + bu).astype(xs.dtype).astype(jnp.float32)) + bd
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
        weights = tuple(expert_weights_f32(w, e) for w in (w_gate, w_up, w_down) + tuple(biases or ()))
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
