"""grouped_ffn: every backend against a float64 per-expert numpy loop, over E x rows x dtype with
empty experts whose unused rows hold NaN garbage, all rows on one expert, aligned layouts,
capacity drops, activations (the families' clamped and gpt-oss variants, per-expert biases), the
Pallas kernel's Triton lowering, and argument errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_compile import compile_all, compile_fast

from expertd.kernels import dispatch, experts
from expertd.kernels.cpu import policy as cpu
from expertd.kernels.experts import BACKENDS, ExpertBiases, GatedActivation, grouped_ffn

H, I = 16, 32
DTYPES = (jnp.float32, jnp.bfloat16)
TOL = {np.dtype(jnp.float32): 2e-5, np.dtype(jnp.bfloat16): 3e-2}


def ffn_oracle(xs, group_sizes, wg, wu, wd, activation="silu", biases=None):
    """float64 per-expert loop; rows past the groups are 0. activation: a name or a GatedActivation
    (its fields: name, limit, limit_mode, alpha); biases: (gate, up, down) or None."""
    f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    xs, wg, wu, wd = f(xs), f(wg), f(wu), f(wd)
    spec = experts.as_gated_activation(activation)
    out = np.zeros_like(xs)
    start = 0
    for e, n in enumerate(np.asarray(group_sizes)):
        x = xs[start:start + n]
        g, u = x @ wg[e], x @ wu[e]
        if biases is not None:
            g, u = g + f(biases[0])[e], u + f(biases[1])[e]
        y = _np_glu(g, u, spec) @ wd[e]
        out[start:start + n] = y if biases is None else y + f(biases[2])[e]
        start += n
    return out


def _np_act(g, name):
    if name == "silu":
        return g / (1 + np.exp(-g))
    if name == "gelu":
        return np.asarray(jax.nn.gelu(jnp.asarray(g), approximate=False), np.float64)
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def _np_glu(g, u, spec):
    lim = spec.limit
    if spec.name == "swiglu_oai":
        if lim is not None:
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        return (u + 1) * g / (1 + np.exp(-spec.alpha * g))
    if lim is None:
        return _np_act(g, spec.name) * u
    if spec.limit_mode == "before_activation":
        return _np_act(np.minimum(g, lim), spec.name) * np.clip(u, -lim, lim)
    return np.minimum(_np_act(g, spec.name), lim) * np.clip(u, -lim, lim)


def make_inputs(num_experts, group_sizes, dtype, *, extra_rows=5, seed=0):
    """Rows for `group_sizes` followed by `extra_rows` NaN garbage rows, and weights."""
    rng = np.random.default_rng(seed)
    n = int(np.sum(group_sizes)) + extra_rows
    xs = rng.normal(size=(n, H)).astype(np.float32)
    xs[int(np.sum(group_sizes)):] = np.nan
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), dtype)
    return (jnp.asarray(xs, dtype), jnp.asarray(group_sizes, jnp.int32),
            w(num_experts, H, I), w(num_experts, H, I), w(num_experts, I, H))


def group_pattern(num_experts, rows, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "one_expert":
        sizes = np.zeros(num_experts, np.int64)
        sizes[num_experts // 2] = rows
        return sizes
    # random sizes with at least one empty expert when E > 1
    probs = rng.dirichlet(np.ones(num_experts))
    if num_experts > 1:
        probs[0] = 0.0
        probs /= probs.sum()
    return rng.multinomial(rows, probs)


def check(out, ref, dtype, what):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    if out.size == 0:
        return
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(out - ref).max())
    assert err <= TOL[np.dtype(dtype)] * scale, f"{what}: max abs error {err:.3g}"


GRID = [(e, rows, "random") for e in (1, 2, 8, 64) for rows in (1, 64, 1024)] + [
    (8, 1024, "one_expert"), (64, 64, "one_expert")]


def _build(point):
    e, rows, kind = point
    cases = [make_inputs(e, group_pattern(e, rows, kind), dt) for dt in DTYPES]

    def run(all_inputs):
        return [[grouped_ffn(*inp, backend=b) for b in BACKENDS] for inp in all_inputs]

    return cases, compile_fast(run, cases)


@pytest.fixture(scope="module")
def compiled():
    return compile_all(_build, GRID)


@pytest.mark.parametrize("num_experts,rows,kind", GRID)
def test_every_backend_matches_per_expert_oracle(compiled, num_experts, rows, kind):
    cases, program = compiled[(num_experts, rows, kind)]
    for inputs, outs in zip(cases, program(cases)):
        ref = ffn_oracle(*inputs)
        for backend, out in zip(BACKENDS, outs):
            assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
            check(out, ref, inputs[0].dtype, f"{backend} {inputs[0].dtype}")
            # Rows past the groups come back as exact zeros even though they held NaN.
            np.testing.assert_array_equal(np.asarray(out[int(np.sum(inputs[1])):], np.float32), 0.0)


@pytest.mark.parametrize("extra_rows", (0, 3, 300))
def test_expert_loop_tiles_at_the_end_of_the_buffer(extra_rows):
    """The last expert's 250 rows run as one masked 256-row tile that would cross the end of the
    buffer (moved back, so it overlaps the previous expert's rows) or read NaN garbage rows."""
    inputs = make_inputs(3, [300, 0, 250], jnp.float32, extra_rows=extra_rows, seed=4)
    out = jax.jit(functools.partial(grouped_ffn, backend="expert_loop"))(*inputs)
    check(out, ffn_oracle(*inputs), jnp.float32, f"expert_loop, {extra_rows} garbage rows")
    np.testing.assert_array_equal(np.asarray(out[550:]), 0.0)


@pytest.mark.parametrize("align_size", (8, 128))
def test_aligned_layout_with_zero_pad_rows(align_size):
    """permute's aligned buffer (zero pad rows inside each block) gives the unaligned result."""
    rng = np.random.default_rng(1)
    t, k, e = 40, 2, 8
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    x = jnp.asarray(rng.normal(size=(t, H)), jnp.float32)
    _, _, wg, wu, wd = make_inputs(e, np.zeros(e, np.int64), jnp.float32)
    plain_rows, plain = dispatch.permute(x, ids, e)
    rows, perm = dispatch.permute(x, ids, e, align_size=align_size)
    ref = ffn_oracle(plain_rows, plain.group_sizes, wg, wu, wd)

    def run(rows, sizes):
        return [dispatch.unpermute(grouped_ffn(rows, sizes, wg, wu, wd, backend=b), perm) for b in BACKENDS]

    expected = ref[np.asarray(plain.dest)].sum(axis=1)  # unpermute of the unaligned oracle rows
    for backend, out in zip(BACKENDS, compile_fast(run, rows, perm.group_sizes)(rows, perm.group_sizes)):
        check(out, expected, jnp.float32, f"{backend} align={align_size}")


@pytest.mark.parametrize("capacity", (5, 20))
def test_capacity_drops_rows_past_capacity(capacity):
    sizes = np.array([10, 3, 0, 30])  # capacity 20 runs in buckets (8, 16, 20): the largest is chosen
    xs, gs, wg, wu, wd = make_inputs(4, sizes, jnp.float32)
    out = np.asarray(grouped_ffn(xs, gs, wg, wu, wd, backend="capacity", capacity=capacity))
    ref = ffn_oracle(xs, gs, wg, wu, wd)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for start, n in zip(starts, sizes):
        kept = min(n, capacity)
        check(out[start:start + kept], ref[start:start + kept], jnp.float32, "kept rows")
        np.testing.assert_array_equal(out[start + kept:start + n], 0.0)


def test_capacity_buckets():
    assert experts.capacity_buckets(16) == (8, 16)
    assert experts.capacity_buckets(100) == (8, 16, 32, 56, 100)
    assert experts.capacity_buckets(4096) == (128, 256, 512, 1024, 2048, 4096)  # CAPACITY_BUCKETS sizes
    assert experts.capacity_buckets(8) == (8,) and experts.capacity_buckets(5) == (5,)


@pytest.mark.parametrize("largest", (1, 7, 8, 9, 16, 17, 24, 25, 40))
@pytest.mark.parametrize("dtype", DTYPES)
def test_capacity_runs_the_bucket_that_holds_the_largest_group(largest, dtype):
    """Capacity 40 compiles buckets (8, 16, 24, 40); groups on both sides of every edge are kept
    whole (dropless), empty experts and the NaN garbage rows after the groups give no NaN."""
    sizes = np.array([3, 0, largest, 5])
    xs, gs, wg, wu, wd = make_inputs(4, sizes, dtype, extra_rows=7)
    assert experts.capacity_buckets(40) == (8, 16, 24, 40)
    out = jax.jit(functools.partial(grouped_ffn, backend="capacity", capacity=40))(xs, gs, wg, wu, wd)
    check(out, ffn_oracle(xs, gs, wg, wu, wd), dtype, f"largest group {largest}")
    np.testing.assert_array_equal(np.asarray(out[int(sizes.sum()):], np.float32), 0.0)


@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh"))
def test_activations(activation):
    xs, gs, wg, wu, wd = make_inputs(3, np.array([4, 0, 9]), jnp.float32)
    ref = ffn_oracle(xs, gs, wg, wu, wd, activation)
    run = lambda *a: [grouped_ffn(*a, activation=activation, backend=b) for b in BACKENDS]
    for backend, out in zip(BACKENDS, compile_fast(run, xs, gs, wg, wu, wd)(xs, gs, wg, wu, wd)):
        check(out, ref, jnp.float32, f"{backend} {activation}")


GATED = [GatedActivation("swiglu_oai", 0.7, alpha=1.702), GatedActivation("silu", 0.6),
         GatedActivation("silu", 0.3, "after_activation"), GatedActivation("gelu_tanh", 0.5, "after_activation")]


def test_gated_activations_and_biases_on_every_backend():
    """The families' gated activations (limits small enough to cut) with and without per-expert
    biases, at E = 4 with an empty expert and NaN garbage rows: every backend in one program."""
    rng = np.random.default_rng(7)
    sizes = np.array([5, 0, 17, 9])
    inputs = {dt: make_inputs(4, sizes, dt, seed=3) for dt in DTYPES}
    biases = {dt: ExpertBiases(*(jnp.asarray(rng.normal(size=shape) * 0.3, dt) for shape in ((4, I), (4, I), (4, H))))
              for dt in DTYPES}
    cases = [(dt, spec, b) for dt in DTYPES for spec in GATED for b in (None, biases[dt])
             if b is None or spec.name == "swiglu_oai" or dt == jnp.float32]

    def run(all_inputs, all_biases):
        return [[grouped_ffn(*all_inputs[DTYPES.index(dt)], activation=spec, biases=b and all_biases[DTYPES.index(dt)],
                             backend=backend) for backend in BACKENDS] for dt, spec, b in cases]

    args = ([inputs[dt] for dt in DTYPES], [biases[dt] for dt in DTYPES])
    for (dt, spec, b), outs in zip(cases, compile_fast(run, *args)(*args)):
        ref = ffn_oracle(*inputs[dt], spec, b)
        assert np.abs(ref).max() > 0.1
        for backend, out in zip(BACKENDS, outs):
            check(out, ref, dt, f"{backend} {spec} biases={b is not None} {dt}")
            np.testing.assert_array_equal(np.asarray(out[int(sizes.sum()):], np.float32), 0.0)


def test_pallas_kernel_lowers_to_triton_for_gpu():
    """No GPU here: lower the compiled (non-interpret) kernel for CUDA, which runs the
    Pallas-Triton lowering and so checks block shapes and ops. PTX compilation is unverified."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    from expertd.kernels.experts.pallas import grouped_ffn_pallas

    xs, gs, wg, wu, wd = make_inputs(5, np.array([3, 0, 10, 7, 12]), jnp.bfloat16)
    fn = jax.jit(lambda *a: grouped_ffn_pallas(*a, interpret=False))
    text = fn.trace(xs, gs, wg, wu, wd).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # gate/up kernel and down kernel
    # gpt-oss: its activation and per-expert biases inside the gate/up kernel
    biases = ExpertBiases(jnp.zeros((5, I), jnp.bfloat16), jnp.zeros((5, I), jnp.bfloat16), jnp.zeros((5, H)))
    fn = jax.jit(lambda *a: grouped_ffn_pallas(*a, activation=GATED[0], biases=biases, interpret=False))
    text = fn.trace(xs, gs, wg, wu, wd).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("block_m, tiles", [(16, dict(block_n=16, block_k=16, num_warps=8, num_stages=3)),
                                             (32, dict(block_n=32, block_k=32, num_warps=4, num_stages=4)),
                                             (64, dict(block_n=256, block_k=64, num_warps=8, num_stages=3))])
def test_every_pallas_tiling_computes_the_same_function(block_m, tiles):
    from expertd.kernels.experts.pallas import PallasTiles, grouped_ffn_pallas

    sizes = np.array([3, 0, 10, 7, 12])
    for dtype in DTYPES:
        xs, gs, wg, wu, wd = make_inputs(5, sizes, dtype)
        out = np.asarray(grouped_ffn_pallas(xs, gs, wg, wu, wd, block_m=block_m, tiles=PallasTiles(**tiles)),
                         np.float32)
        ref = ffn_oracle(xs, gs, wg, wu, wd)
        n = int(sizes.sum())
        scale = np.abs(ref[:n]).max()
        assert np.abs(out[:n] - ref[:n]).max() / scale <= TOL[np.dtype(dtype)]
        np.testing.assert_array_equal(out[n:], 0.0)  # the NaN garbage rows past the groups


def test_pallas_tiles_are_checked_and_lower_to_triton():
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    from expertd.kernels.experts.pallas import PallasTiles, grouped_ffn_pallas

    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 48"):
        PallasTiles(block_n=48)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        PallasTiles(num_warps=3)
    xs, gs, wg, wu, wd = make_inputs(5, np.array([3, 0, 10, 7, 12]), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
        grouped_ffn_pallas(xs, gs, wg, wu, wd, block_m=24)
    tiles = PallasTiles(block_n=32, block_k=16, num_warps=8, num_stages=4)
    fn = jax.jit(lambda *a: grouped_ffn_pallas(*a, block_m=32, tiles=tiles, interpret=False))
    text = fn.trace(xs, gs, wg, wu, wd).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "num_warps = 8 : i32" in text and "num_stages = 4 : i32" in text  # the launch parameters reach Triton
    assert "num_warps = 4 : i32" not in text


def test_default_tiles_are_hoppers_only_on_hopper_with_64_row_tiles_of_two_byte_elements():
    from expertd.kernels.experts.pallas import HOPPER_TILES, PallasTiles, default_tiles

    assert HOPPER_TILES != PallasTiles()
    assert default_tiles(64, 2, "9.0") == HOPPER_TILES
    assert default_tiles(16, 2, "9.0") == default_tiles(32, 2, "9.0") == PallasTiles()  # decode tiles: unmeasured
    assert default_tiles(128, 2, "9.0") == PallasTiles()  # a 128-row tile with HOPPER_TILES exceeds shared memory
    assert default_tiles(64, 4, "9.0") == PallasTiles()  # so would float32 elements
    for other in ("8.0", "8.9", "10.0", "12.0", None):  # less shared memory, or not measured
        assert default_tiles(64, 2, other) == PallasTiles()


def test_the_default_tiles_reach_triton():
    """With no tiles given, the kernels lower with default_tiles' launch parameters for the device
    compiled for (here no GPU: PallasTiles())."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    from expertd.kernels.experts.pallas import PallasTiles, gpu_compute_capability, grouped_ffn_pallas

    assert gpu_compute_capability() is None  # the suite runs on CPU
    xs, gs, wg, wu, wd = make_inputs(5, np.array([30, 0, 100, 70, 120]), jnp.bfloat16)
    fn = jax.jit(lambda *a: grouped_ffn_pallas(*a, interpret=False))
    text = fn.trace(xs, gs, wg, wu, wd).lower(lowering_platforms=("cuda",)).as_text()
    assert f"num_warps = {PallasTiles().num_warps} : i32" in text
    assert f"num_stages = {PallasTiles().num_stages} : i32" in text


def test_bad_arguments_are_named():
    xs, gs, wg, wu, wd = make_inputs(2, np.array([2, 1]), jnp.float32)
    with pytest.raises(ValueError, match="w_up"):
        grouped_ffn(xs, gs, wg, wu[:, :, :8], wd)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_ffn(xs, gs[:1], wg, wu, wd)
    with pytest.raises(ValueError, match="xs"):
        grouped_ffn(xs[0], gs, wg, wu, wd)
    with pytest.raises(ValueError, match="backend"):
        grouped_ffn(xs, gs, wg, wu, wd, backend="cuda")
    with pytest.raises(ValueError, match="activation"):
        grouped_ffn(xs, gs, wg, wu, wd, activation="relu")
    with pytest.raises(ValueError, match="activation limit_mode must be one of"):
        grouped_ffn(xs, gs, wg, wu, wd, activation=GatedActivation("silu", 1.0, "clamp"))
    with pytest.raises(ValueError, match=r"biases.down must have shape \(2, 16\), got \(2, 32\)"):
        grouped_ffn(xs, gs, wg, wu, wd, biases=ExpertBiases(jnp.zeros((2, I)), jnp.zeros((2, I)), jnp.zeros((2, I))))
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_ffn(xs[:, :8], gs, wg[:, :8], wu[:, :8], wd[:, :, :8], backend="pallas")


def test_auto_resolves_to_a_backend_for_every_platform():
    for platform in ("cpu", "gpu", "tpu"):
        for rows in (16, 4096, 32768):
            assert experts.choose_backend(rows, 8, 1024, 2048, jnp.bfloat16, platform) in BACKENDS


def test_gpu_auto_picks_pallas_for_bf16_from_gpu_pallas_min_rows():
    mixtral = (8, 1024, 2048)
    assert experts.choose_backend(32, *mixtral, jnp.float32, "gpu") == "ragged_dot"
    gpu_rows = experts.GPU_PALLAS_MIN_ROWS
    assert experts.choose_backend(gpu_rows - 1, *mixtral, jnp.bfloat16, "gpu") == "ragged_dot"
    assert experts.choose_backend(gpu_rows, *mixtral, jnp.bfloat16, "gpu") == "pallas"
    assert experts.choose_backend(gpu_rows, *mixtral, jnp.float32, "gpu") == "ragged_dot"
    assert experts.choose_backend(gpu_rows, 8, 1000, 2048, jnp.bfloat16, "gpu") == "ragged_dot"  # H % 16
    for dtype in DTYPES:
        assert experts.compiler_options(32, *mixtral, dtype=dtype, platform="gpu") == {}


def test_compiled_with_small_rows_options_matches_default():
    """The options change the compiled program (no YNNPACK fusions), not the numbers."""
    rng = np.random.default_rng(3)
    e, h, i = 4, 64, 128
    xs = jnp.asarray(rng.standard_normal((24, h)), jnp.float32)
    gs = jnp.asarray([5, 0, 12, 7], jnp.int32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in ((e, h, i), (e, h, i), (e, i, h))]
    for backend in ("expert_loop", "capacity"):
        ffn = lambda *a, b=backend: grouped_ffn(*a, backend=b)
        default = jax.jit(ffn).lower(xs, gs, *ws).compile()
        small = jax.jit(ffn, compiler_options=cpu.small_rows_cpu_options()).lower(xs, gs, *ws).compile()
        assert "ynn_fusion" in default.as_text() and "ynn_fusion" not in small.as_text(), backend
        np.testing.assert_allclose(np.asarray(small(xs, gs, *ws)), np.asarray(default(xs, gs, *ws)),
                                   rtol=1e-5, atol=1e-5, err_msg=backend)
