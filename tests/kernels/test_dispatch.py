"""permute / unpermute against their references and the layout rules of moe-semantics.md 3.1:
expert-major rows, ascending tokens inside an expert, zero pad rows with align_size, the static
worst-case buffer, tokens per expert without padding, fp32 combine; bitwise fp32 round trips."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_compile import compile_all, compile_fast

from expertd.kernels import dispatch

H = 8
ALIGNS = (0, 8, 128)
POINTS = [(t, k, e) for t, (e, k) in itertools.product((1, 3, 1024), ((1, 1), (2, 2), (8, 2), (64, 8)))]


def routing(num_tokens, topk, num_experts, seed=0, skew=False):
    rng = np.random.default_rng(seed)
    p = None
    if skew:  # most copies on a few experts, several experts empty
        p = np.zeros(num_experts)
        p[: max(topk, num_experts // 4)] = 1.0
        p /= p.sum()
    return np.stack([rng.choice(num_experts, topk, replace=False, p=p) for _ in range(num_tokens)]).astype(np.int32)


def make_point(point):
    t, k, e = point
    rng = np.random.default_rng(t + e)
    x = jnp.asarray(rng.normal(size=(t, H)), jnp.float32)
    ids = jnp.asarray(routing(t, k, e, skew=(t % 2 == 0)))
    valid = jnp.asarray(rng.random(t) < 0.7)

    def run(x, ids, valid):
        out = {}
        for align, use_valid in itertools.product(ALIGNS, (False, True)):
            v = valid if use_valid else None
            out[align, use_valid] = (dispatch.permute(x, ids, e, align_size=align, valid=v),
                                     dispatch.permute_reference(x, ids, e, align_size=align, valid=v))
        return out

    return (x, ids, valid), compile_fast(run, x, ids, valid)


@pytest.fixture(scope="module")
def compiled():
    return compile_all(make_point, POINTS)


def check_layout(rows, perm, x, ids, valid, num_experts, align):
    t, k = ids.shape
    rows, x, ids = np.asarray(rows), np.asarray(x), np.asarray(ids)
    valid = np.ones(t, bool) if valid is None else np.asarray(valid)
    dest, token_of_row = np.asarray(perm.dest), np.asarray(perm.token_of_row)
    sizes, offsets, tpe = (np.asarray(a) for a in (perm.group_sizes, perm.group_offsets, perm.tokens_per_expert))
    n = dispatch.buffer_rows(t, k, num_experts, align)
    assert rows.shape == (n, x.shape[1]) and token_of_row.shape == (n,)
    counts = np.bincount(ids[valid].ravel(), minlength=num_experts)
    np.testing.assert_array_equal(tpe, counts)
    expected_sizes = counts if align <= 1 else -(-counts // align) * align
    np.testing.assert_array_equal(sizes, expected_sizes)
    np.testing.assert_array_equal(offsets, np.cumsum(expected_sizes) - expected_sizes)
    assert sizes.sum() <= n
    for e in range(num_experts):
        block = token_of_row[offsets[e]:offsets[e] + sizes[e]]
        real = block[: counts[e]]
        assert (np.diff(real) > 0).all(), "tokens ascending inside an expert"
        np.testing.assert_array_equal(np.sort(real), np.flatnonzero(((ids == e) & valid[:, None]).any(1)))
        assert (block[counts[e]:] == t).all(), "pad rows hold no token"
    used = np.zeros(n, bool)
    for ti in range(t):
        for j in range(k):
            if valid[ti]:
                r = dest[ti, j]
                assert offsets[ids[ti, j]] <= r < offsets[ids[ti, j]] + counts[ids[ti, j]]
                np.testing.assert_array_equal(rows[r], x[ti])  # bitwise copy
                used[r] = True
            else:
                assert dest[ti, j] == n
    np.testing.assert_array_equal(rows[~used], 0.0)  # pad rows and the unused tail are zero


@pytest.mark.parametrize("num_tokens,topk,num_experts", POINTS)
def test_permute_layout_and_reference(compiled, num_tokens, topk, num_experts):
    (x, ids, valid), program = compiled[(num_tokens, topk, num_experts)]
    for (align, use_valid), (fast, ref) in program(x, ids, valid).items():
        check_layout(*fast, x, ids, valid if use_valid else None, num_experts, align)
        for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_unpermute_matches_reference_and_ignores_nan_rows(align, dtype):
    t, k, e = 50, 3, 6
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(t, H)), dtype)
    ids = jnp.asarray(routing(t, k, e, skew=True))
    valid = jnp.asarray(rng.random(t) < 0.8)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, k)), jnp.float32)

    def run(x, ids, valid, weights):
        rows, perm = dispatch.permute(x, ids, e, align_size=align, valid=valid)
        routed = jnp.zeros(rows.shape[0], bool).at[perm.dest].set(True, mode="drop")
        garbage = jnp.where(routed[:, None], rows * 2, jnp.nan).astype(dtype)  # NaN in pad/unused rows
        return (dispatch.unpermute(garbage, perm, weights, out_dtype=jnp.float32),
                dispatch.unpermute_reference(jnp.where(routed[:, None], garbage, 0), perm, weights,
                                             out_dtype=jnp.float32))

    out, ref = compile_fast(run, x, ids, valid, weights)(x, ids, valid, weights)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
    expected = 2 * np.asarray(x, np.float32) * np.asarray(weights).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), np.where(np.asarray(valid)[:, None], expected, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scale_rows_weights_each_copy_and_zeros_the_rest(dtype):
    """scale_rows (Llama 4's weight on the expert input): routed row dest[t, j] = w[t, j] * x[t]
    rounded once to the rows' dtype; pad rows, invalid tokens' rows and NaN garbage come back 0."""
    t, k, e = 40, 2, 5
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(t, H)), dtype)
    ids = jnp.asarray(routing(t, k, e, skew=True))
    valid = jnp.asarray(rng.random(t) < 0.8)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, k)), jnp.float32)

    def run(x, ids, valid, weights):
        rows, perm = dispatch.permute(x, ids, e, align_size=8, valid=valid)
        routed = jnp.zeros(rows.shape[0], bool).at[perm.dest].set(True, mode="drop")
        garbage = jnp.where(routed[:, None], rows, jnp.nan).astype(dtype)
        return dispatch.scale_rows(garbage, perm, weights), perm.dest

    scaled, dest = compile_fast(run, x, ids, valid, weights)(x, ids, valid, weights)
    assert scaled.dtype == dtype
    want = np.zeros(scaled.shape, np.float32)
    x32, w, dest, ok = (np.asarray(a, np.float32) for a in (x, weights, dest, valid))
    for tok, slot in itertools.product(range(t), range(k)):
        if ok[tok]:
            want[int(dest[tok, slot])] = np.asarray(jnp.asarray(x32[tok] * w[tok, slot]).astype(dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(scaled, np.float32), want)


@pytest.mark.parametrize("align", ALIGNS)
def test_round_trip_is_bitwise_for_fp32(align):
    t, e = 64, 8
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(t, H)) * 1e3, jnp.float32)
    for k in (1, 2, 8):
        ids = jnp.asarray(routing(t, k, e, seed=k))
        rows, perm = dispatch.permute(x, ids, e, align_size=align)
        if k == 1:
            np.testing.assert_array_equal(np.asarray(dispatch.unpermute(rows, perm)), np.asarray(x))
        # one slot weighted 1, the others 0: exact whatever k
        pick = jax.nn.one_hot(rng.integers(0, k, t), k, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(dispatch.unpermute(rows, perm, pick)), np.asarray(x))
        if k == 2:  # x/2 + x/2 is exact in binary floating point
            half = jnp.full((t, k), 0.5, jnp.float32)
            np.testing.assert_array_equal(np.asarray(dispatch.unpermute(rows, perm, half)), np.asarray(x))


def test_bad_arguments_are_named():
    x = jnp.zeros((4, H))
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="topk_ids"):
        dispatch.permute(x, ids[:3], 4)
    with pytest.raises(ValueError, match="x must be"):
        dispatch.permute(x[0], ids, 4)
    with pytest.raises(ValueError, match="align_size"):
        dispatch.permute(x, ids, 4, align_size=-1)
    with pytest.raises(ValueError, match="valid"):
        dispatch.permute(x, ids, 4, valid=jnp.ones(3, bool))
    rows, perm = dispatch.permute(x, ids, 4)
    with pytest.raises(ValueError, match="topk_weights"):
        dispatch.unpermute(rows, perm, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="rows"):
        dispatch.unpermute(rows[:-1], perm)
