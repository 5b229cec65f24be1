"""The ragged all-to-all emulation and the EP offset arithmetic (expertd.kernels.ragged)."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from expertd.kernels import ragged


def _mesh(r):
    return jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])


def _run_per_rank(fn, r, *per_rank_args):
    """Run fn(*args) on every rank of an r-device mesh; each arg is stacked [r, ...] per rank."""
    mesh = _mesh(r)

    def body(*args):
        out = fn(*[a[0] for a in args])
        return out[None]

    spec = P("ep")
    return np.asarray(
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(per_rank_args), out_specs=spec))(
            *[jnp.asarray(a) for a in per_rank_args]
        )
    )


def _numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The docstring pseudocode of jax.lax.ragged_all_to_all, literally, over lists per rank."""
    r = len(operands)
    k = len(send_sizes[0])
    per = k // r
    results = [o.copy() for o in outputs]
    for src in range(r):
        for i in range(k):
            dst = i // per
            j = src * per + i % per  # index of this slice in the receiver's view
            data = operands[src][input_offsets[src][i] : input_offsets[src][i] + send_sizes[src][i]]
            assert recv_sizes[dst][j] == len(data)
            off = output_offsets[src][i]
            results[dst][off : off + len(data)] = data
    return results


def _emulated(operand, output, io, ss, oo, rs):
    return ragged.ragged_all_to_all_emulated(operand, output, io, ss, oo, rs, axis_name="ep")


def test_docstring_example():
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    output = np.zeros((2, 4), np.float32)
    io = np.array([[0, 1], [0, 1]], np.int32)
    ss = np.array([[1, 2], [1, 1]], np.int32)
    oo = np.array([[0, 0], [1, 2]], np.int32)
    rs = np.array([[1, 1], [2, 1]], np.int32)
    out = _run_per_rank(_emulated, 2, operand, output, io, ss, oo, rs)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_same_signature_as_the_real_op_and_the_real_op_accepts_our_arguments():
    real = inspect.signature(jax.lax.ragged_all_to_all).parameters
    emulated = inspect.signature(ragged.ragged_all_to_all_emulated).parameters
    assert list(real) == list(emulated)[: len(real)]
    # XLA:CPU cannot compile the real op, but it traces and lowers: our argument dtypes/shapes are valid.
    mesh = _mesh(2)

    def body(operand, output, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(operand[0], output[0], io[0], ss[0], oo[0], rs[0], axis_name="ep")[None]

    args = [np.zeros((2, 3, 4), np.float32), np.zeros((2, 5, 4), np.float32)] + [np.zeros((2, 2), np.int32)] * 4
    lowered = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep"))).lower(*args)
    assert "ragged_all_to_all" in lowered.as_text()


@pytest.mark.parametrize("r,slices_per_rank", [(1, 1), (2, 2), (4, 1), (8, 1)])
def test_random_exchanges_match_the_pseudocode(r, slices_per_rank):
    rng = np.random.default_rng(r * 10 + slices_per_rank)
    k, h = r * slices_per_rank, 3
    n, m = 5 * k, 4 * k + 3  # room for sizes < 4 plus gaps < 2 on both sides
    send_sizes = rng.integers(0, 4, size=(r, k)).astype(np.int32)
    # Slices of one rank are laid out with random gaps; receivers pack what they get from each
    # (source, slice) at a random but non-overlapping place.
    input_offsets = np.zeros((r, k), np.int32)
    for s in range(r):
        gaps = rng.integers(0, 2, size=k)
        input_offsets[s] = np.cumsum(send_sizes[s] + gaps) - send_sizes[s]
    recv_sizes = np.zeros((r, k), np.int32)
    output_offsets = np.zeros((r, k), np.int32)
    per = k // r
    for d in range(r):
        cursor = int(rng.integers(0, 3))
        for s in range(r):
            for jj in range(per):
                i = d * per + jj
                recv_sizes[d, s * per + jj] = send_sizes[s, i]
                output_offsets[s, i] = cursor
                cursor += send_sizes[s, i] + int(rng.integers(0, 2))
        assert cursor <= m
    operands = rng.normal(size=(r, n, h)).astype(np.float32)
    outputs = np.full((r, m, h), -7.0, np.float32)  # rows nobody writes keep this value
    want = _numpy_ragged_all_to_all(list(operands), list(outputs), input_offsets, send_sizes, output_offsets,
                                    recv_sizes)
    got = _run_per_rank(_emulated, r, operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes)
    np.testing.assert_array_equal(got, np.stack(want))


def test_exchange_params_by_hand():
    # counts[s, d]: rows s sends to d.
    counts = np.array([[2, 0, 3], [1, 4, 0], [0, 2, 5]])
    io, ss, oo, rs = (np.asarray(a) for a in ragged.dispatch_exchange_params(counts, 1))
    np.testing.assert_array_equal(ss, [1, 4, 0])
    np.testing.assert_array_equal(io, [0, 1, 5])
    # Rank 1's rows land after rank 0's rows in every receiver: offsets counts[0] = [2, 0, 3].
    np.testing.assert_array_equal(oo, [2, 0, 3])
    np.testing.assert_array_equal(rs, [0, 4, 2])  # column 1
    io, ss, oo, rs = (np.asarray(a) for a in ragged.combine_exchange_params(counts, 1))
    # Rank 1 received 0 rows from 0, 4 from itself, 2 from 2, stored in that order.
    np.testing.assert_array_equal(ss, [0, 4, 2])
    np.testing.assert_array_equal(io, [0, 0, 4])
    # They go back to where they left: rank s's rows for rank 1 start after s's rows for rank 0.
    np.testing.assert_array_equal(oo, [2, 1, 0])
    np.testing.assert_array_equal(rs, [1, 4, 0])
    ex = ragged.dispatch_exchange_params(counts, 2)  # a typed handle, in ragged_all_to_all's argument order
    assert isinstance(ex, ragged.RaggedExchange) and ex._fields == (
        "input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    np.testing.assert_array_equal(ex.input_offsets, [0, 0, 2])
    np.testing.assert_array_equal(ex.output_offsets, [3, 4, 3])


@pytest.mark.parametrize("r", [1, 2, 4])
def test_dispatch_then_combine_round_trip(r):
    rng = np.random.default_rng(r)
    n, h = 10, 2
    counts = np.stack([rng.multinomial(int(rng.integers(0, n + 1)), [1 / r] * r) for _ in range(r)]).astype(np.int32)
    operands = rng.normal(size=(r, n, h)).astype(np.float32)

    def round_trip(operand, counts):
        me = jax.lax.axis_index("ep")
        io, ss, oo, rs = ragged.dispatch_exchange_params(counts, me)
        received = _emulated(operand, jnp.zeros((r * n, h), operand.dtype), io, ss, oo, rs)
        io, ss, oo, rs = ragged.combine_exchange_params(counts, me)
        return _emulated(received, jnp.zeros_like(operand), io, ss, oo, rs)

    got = _run_per_rank(round_trip, r, operands, np.broadcast_to(counts, (r, r, r)))
    for s in range(r):
        sent = counts[s].sum()
        np.testing.assert_array_equal(got[s, :sent], operands[s, :sent])
        np.testing.assert_array_equal(got[s, sent:], 0)


def test_pack_slices_cuts_at_capacity():
    operand = jnp.arange(6, dtype=jnp.float32)[:, None]
    packed = np.asarray(ragged.pack_slices(operand, [0, 1, 5], [1, 4, 0], 2))[..., 0]
    np.testing.assert_array_equal(packed, [[0, 0], [1, 2], [0, 0]])


def test_unpack_slices_inverts_pack_slices():
    operand = jnp.arange(7, dtype=jnp.float32)[:, None] + 1
    offsets, sizes = jnp.array([0, 3, 6]), jnp.array([2, 3, 1])
    packed = ragged.pack_slices(operand, offsets, sizes, 3)
    back = np.asarray(ragged.unpack_slices(packed, offsets, sizes, jnp.zeros_like(operand)))[:, 0]
    np.testing.assert_array_equal(back, [1, 2, 0, 4, 5, 6, 7])  # row 2 is in no slice


def test_rank_capacity():
    # 6 tokens per rank: dropless is 6 rows per destination (a token goes to a rank once).
    assert ragged.rank_capacity(6, 2, 4) == 6
    # share 6 * min(2, 4) / 4 = 3 rows; factor 1.5 -> ceil(4.5) = 5; tiny factors keep 1, huge ones 6.
    assert ragged.rank_capacity(6, 2, 4, 1.5) == 5
    assert ragged.rank_capacity(6, 2, 4, 0.01) == 1
    assert ragged.rank_capacity(6, 2, 4, 100.0) == 6
    # top-8 over 4 ranks: every token may reach every rank, share = 6 * 4 / 4.
    assert ragged.rank_capacity(6, 8, 4, 1.0) == 6


def rank_rows_by_hand(slots, weights, r, s):
    """One row per (token, destination), destination-major, tokens ascending; slots in top-k order."""
    rows = []
    for d in range(r):
        for t in range(len(slots)):
            mine = [(int(p) % s, float(w)) for p, w in zip(slots[t], weights[t]) if p >= 0 and p // s == d]
            if mine:
                rows.append((d, t, mine))
    return rows


@pytest.mark.parametrize("r,s,k", [(2, 4, 2), (4, 2, 4), (3, 3, 3), (8, 1, 2)])
def test_rank_rows_match_the_rule_by_hand(r, s, k):
    rng = np.random.default_rng(r * 100 + s * 10 + k)
    t = 7
    slots = np.stack([rng.choice(r * s, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    slots[2] = -1  # a padding row: routed nowhere
    weights = np.where(slots >= 0, rng.uniform(0.1, 1.0, size=(t, k)), 0).astype(np.float32)
    lay = jax.tree.map(np.asarray, ragged.rank_rows(slots, weights, r, s))
    assert isinstance(ragged.rank_rows(slots, weights, r, s), ragged.RankRows)
    want = rank_rows_by_hand(slots, weights, r, s)
    n, kk, kr = t * min(k, r), min(k, s), min(k, r)
    assert lay.row_token.shape == (n,) and lay.row_slots.shape == (n, kk) and lay.token_rows.shape == (t, kr)
    np.testing.assert_array_equal(lay.send_counts, np.bincount([d for d, _, _ in want], minlength=r))
    np.testing.assert_array_equal(lay.pair_counts, np.bincount(slots[slots >= 0] // s, minlength=r))
    for i, (d, tok, mine) in enumerate(want):
        assert (lay.row_dest[i], lay.row_token[i]) == (d, tok)
        np.testing.assert_array_equal(lay.row_slots[i], [m for m, _ in mine] + [-1] * (kk - len(mine)))
        np.testing.assert_allclose(lay.row_weights[i], [w for _, w in mine] + [0.0] * (kk - len(mine)))
    assert (lay.row_token[len(want):] == t).all() and (lay.row_dest[len(want):] == r).all()
    assert (lay.row_slots[len(want):] == -1).all()
    for tok in range(t):
        rows = [i for i, (_, tt, _) in enumerate(want) if tt == tok]
        np.testing.assert_array_equal(lay.token_rows[tok], rows + [n] * (kr - len(rows)))
