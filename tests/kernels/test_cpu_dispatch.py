"""The C++ dispatch passes of the CPU layer (cpu.layout, cpu.combine and the grouped
matmul reading its rows by index) against their jnp twins in kernels/dispatch.py, over the grid
of test_dispatch: every Permutation field equal, the combine to fp32 rounding (bitwise for one
copy per token), NaN garbage in rows no copy points at never read."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu, dispatch

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")

# (E, k, T): the grid, k <= E; T = 1024 with E = 64, k = 8 is the layer's 8192 copies.
GRID = [(e, k, t) for e, k, t in itertools.product((1, 2, 8, 64), (1, 2, 8), (1, 3, 64, 1024)) if k <= e]


def random_ids(e, k, t, seed, skew=False):
    """[T, k] distinct experts per token; `skew` piles most copies onto the first experts."""
    rng = np.random.default_rng(seed)
    p = np.arange(e, 0, -1.0) ** 4 if skew else np.ones(e)
    return jnp.asarray(np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(t)]), jnp.int32)


def valid_mask(t, seed):
    return jnp.asarray(np.random.default_rng(seed).random(t) < 0.7)


@pytest.mark.parametrize("e,k,t", GRID)
def test_layout_equals_the_sorting_layout(e, k, t):
    ids = random_ids(e, k, t, seed=e * 100 + k * 10 + t, skew=t % 2 == 1)
    for align, valid in ((0, None), (8, None), (128, None), (0, valid_mask(t, t)), (8, valid_mask(t, t + 1))):
        want = jax.jit(lambda i, v, a=align: dispatch.layout(i, e, align_size=a, valid=v))(ids, valid)
        got = jax.jit(lambda i, v, a=align: cpu.layout(i, e, align_size=a, valid=v))(ids, valid)
        for name, a, b in zip(dispatch.Permutation._fields, got, want):
            assert a.dtype == b.dtype == jnp.int32, name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} align={align}")


def test_layout_of_no_routed_copies():
    ids = jnp.zeros((5, 2), jnp.int32)
    perm = cpu.layout(ids, 4, valid=jnp.zeros(5, bool))
    np.testing.assert_array_equal(np.asarray(perm.dest), 10)  # N = T * k: nowhere
    np.testing.assert_array_equal(np.asarray(perm.token_of_row), 5)
    np.testing.assert_array_equal(np.asarray(perm.tokens_per_expert), 0)


def _rows_with_garbage(perm, h, dtype, seed):
    """[N, H] rows; the rows no routed copy points at (pad rows, the unused tail) hold NaN."""
    n = perm.token_of_row.shape[0]
    rows = np.random.default_rng(seed).standard_normal((n, h)).astype(np.float32)
    rows[np.asarray(perm.token_of_row) >= perm.dest.shape[0]] = np.nan
    return jnp.asarray(rows, dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("e,k,t", [c for c in GRID if c[2] in (3, 64, 1024)])
def test_combine_matches_unpermute(e, k, t, dtype):
    ids = random_ids(e, k, t, seed=t + k)
    valid = valid_mask(t, seed=e)
    perm = dispatch.layout(ids, e, align_size=8, valid=valid)
    rows = _rows_with_garbage(perm, 40, dtype, seed=k)  # H = 40: a scalar tail past the 8-wide vectors
    weights = jnp.asarray(np.random.default_rng(t).random((t, k)), jnp.float32)
    for w in (weights, None):
        got = np.asarray(jax.jit(cpu.combine)(rows, perm, w))
        want = np.asarray(jax.jit(lambda r, p, w: dispatch.unpermute(r, p, w, out_dtype=jnp.float32))(rows, perm, w))
        assert got.dtype == np.float32 and got.shape == (t, 40)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[~np.asarray(valid)], 0)


def test_round_trip_with_one_copy_is_bitwise():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((50, 24)), jnp.float32)
    ids = random_ids(8, 1, 50, seed=1)
    perm = cpu.layout(ids, 8)
    rows = x.at[perm.token_of_row].get(mode="fill", fill_value=0)
    np.testing.assert_array_equal(np.asarray(cpu.combine(rows, perm)), np.asarray(x))


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("e,k,t,h,c", [(4, 2, 9, 40, 50), (8, 2, 64, 64, 96), (2, 2, 40, 300, 64)])
def test_matmul_reading_rows_by_index_equals_gathering_first(e, k, t, h, c, dtype):
    """Same kernel, same arithmetic: bitwise equal; pad rows (source T) read zeros. (2, 2, 40):
    40 rows per expert take the packed path."""
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    perm = dispatch.layout(random_ids(e, k, t, seed=h), e, align_size=8)
    w = jnp.asarray(rng.standard_normal((e, h, c)) * 0.1, dtype)
    gathered = x.at[perm.token_of_row].get(mode="fill", fill_value=0)
    got = np.asarray(jax.jit(lambda x, g, w, s: cpu.grouped_matmul(x, g, w, source=s))(
        x, perm.group_sizes, w, perm.token_of_row))
    want = np.asarray(jax.jit(cpu.grouped_matmul)(gathered, perm.group_sizes, w))
    assert got.shape == (perm.token_of_row.shape[0], c)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.asarray(cpu.grouped_matmul_reference(gathered, perm.group_sizes, w)),
                               rtol=1e-5, atol=1e-5 * np.sqrt(h))


def test_argument_errors_name_the_field():
    ids = jnp.zeros((4, 2), jnp.int32)
    perm = cpu.layout(ids, 3)
    with pytest.raises(ValueError, match="align_size"):
        cpu.layout(ids, 3, align_size=-1)
    with pytest.raises(ValueError, match="valid"):
        cpu.layout(ids, 3, valid=jnp.ones(5, bool))
    with pytest.raises(ValueError, match="topk_weights"):
        cpu.combine(jnp.zeros((8, 16)), perm, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="rows"):
        cpu.combine(jnp.zeros((7, 16)), perm)
    with pytest.raises(ValueError, match="rows must be float32 or bfloat16"):
        cpu.combine(jnp.zeros((8, 16), jnp.float16), perm)
    with pytest.raises(ValueError, match="source"):
        cpu.grouped_matmul(jnp.ones((4, 16)), jnp.ones(3, jnp.int32), jnp.ones((3, 16, 16)),
                                  source=jnp.zeros(8, jnp.float32))
