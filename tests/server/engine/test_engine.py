"""Engine (built by start-up): compiled steps per bucket equal the kernels on the same weights;
padding; warm-up; compile cache; what start-up reports."""
import dataclasses
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu, moe, router
from expertd.kernels.cpu import build as cpu_build
from expertd.kernels.cpu.policy import SMALL_ROWS_CPU_OPTIONS
from expertd.server import console
from expertd.server.engine import api, weights
from expertd.server.engine.build import build_engine
from expertd.server.engine.engine import CompileEvent
from expertd.server.engine.warmup import enable_compile_cache, warm_up
from expertd.server.errors import InvalidRequest
from expertd.server.host import allocator, memory
from expertd.server.models.presets import LoadedLayer, load_preset

BUCKETS = (8, 32)
# The kernels the engine must agree with, jitted once (cheaper than op-by-op on a loaded CPU).
moe_layer = jax.jit(moe.moe_layer, static_argnames=("cfg", "backend", "return_routing"))


def _tokens(n, hidden=64, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, hidden), dtype=np.float32).astype(dtype)


def _bucket(engine, n):
    return next(b for b in engine.buckets if b >= n)


def forward(engine, layer, x, num_valid=None):
    """The engine's forward of x [n, H] as the batcher calls it: cast to the engine dtype, padded to
    the smallest bucket, the first num_valid (default n) rows valid."""
    padded = api.pad_rows([x.astype(engine.dtype)], _bucket(engine, len(x)))
    return engine.forward(layer, padded, len(x) if num_valid is None else num_valid)


def route(engine, layer, hidden=None, logits=None, num_valid=None, aux_loss_coeff=1.0):
    tokens = hidden.astype(engine.dtype) if logits is None else logits.astype(np.float32)
    padded = api.pad_rows([tokens], _bucket(engine, len(tokens)))
    return engine.route(layer, padded, len(tokens) if num_valid is None else num_valid,
                        from_logits=logits is not None, aux_loss_coeff=aux_loss_coeff)


def _device_params(layer, dtype):
    return moe.MoEParams.from_dict({name: jnp.asarray(value, moe.param_dtype(name, dtype))
                                    for name, value in layer.params.items()})


@pytest.fixture(scope="module")
def tiny():
    return load_preset("tiny", dtype="float32")


@pytest.fixture(scope="module")
def served(tiny):
    return build_engine(tiny, buckets=BUCKETS, dtype="float32", devices=1)


@pytest.fixture(scope="module")
def warm_engine(served):
    events = []
    engine = served.engine
    listened = []
    engine.add_compile_listener(listened.append)
    warm_up(engine, progress=events.append)
    return engine, events, listened


def test_warmup_compiles_every_config_bucket_and_step_with_progress(warm_engine):
    engine, events, listened = warm_engine
    total = 2 * len(BUCKETS) * 3  # two layer configs x buckets x (forward, route_hidden, route_logits)
    assert [e.done for e in events] == list(range(1, total + 1)) and {e.total for e in events} == {total}
    assert {(e.layers, e.bucket, e.kind) for e in events} == {
        ((layer,), bucket, kind) for layer in (0, 1) for bucket in BUCKETS
        for kind in ("forward", "route_hidden", "route_logits")}
    assert listened == events and all(isinstance(e, CompileEvent) and e.seconds > 0 for e in events)
    assert engine.compilations == total and engine.compile_seconds == pytest.approx(sum(e.seconds for e in events))
    assert engine.warm
    forward(engine, 0, _tokens(3))
    assert engine.compilations == total  # warm: serving compiles nothing
    warm_up(engine)  # compiles nothing more
    assert engine.compilations == total


@pytest.mark.parametrize("layer_index", [0, 1])
@pytest.mark.parametrize("num_tokens", [5, 32])
def test_forward_equals_moe_layer_fp32(warm_engine, tiny, layer_index, num_tokens):
    engine, _, _ = warm_engine
    layer = tiny[layer_index]
    x = _tokens(num_tokens, seed=num_tokens)
    result = forward(engine, layer_index, x)
    expected, routing = moe_layer(_device_params(layer, jnp.float32), jnp.asarray(x), cfg=layer.cfg,
                                   return_routing=True)
    assert result.output.dtype == np.float32 and result.output.shape == (num_tokens, 64)
    np.testing.assert_allclose(result.output, np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result.topk_ids, np.asarray(routing["topk_ids"]))
    np.testing.assert_allclose(result.topk_weights, np.asarray(routing["topk_weights"]), rtol=1e-6)
    np.testing.assert_array_equal(result.tokens_per_expert, np.asarray(routing["tokens_per_expert"]))
    assert result.tokens_per_expert.sum() == num_tokens * layer.cfg.topk


def test_results_stay_put_when_the_input_is_reused_and_later_steps_run(warm_engine):
    """Steps take host inputs as they are and CPU results are read in place (MeshPlacement's
    step_input and fetch): a returned result must not change when the caller overwrites its input
    or when later steps run on the same executables."""
    engine, _, _ = warm_engine
    x = _tokens(8, seed=3)
    forwarded, routed = engine.forward(0, x, 8), engine.route(0, x, 8)  # 8 rows: the bucket, not copied
    def arrays():
        return (forwarded.output, forwarded.topk_ids, forwarded.topk_weights, forwarded.tokens_per_expert,
                routed.topk_ids, routed.topk_weights, routed.tokens_per_expert, routed.aux_scores)

    kept = [np.array(a) for a in arrays()]
    x[:] = 1e30
    for seed in range(4):
        forward(engine, 0, _tokens(8, seed=10 + seed))
        route(engine, 0, hidden=_tokens(8, seed=20 + seed))
    for before, now in zip(kept, arrays(), strict=True):
        np.testing.assert_array_equal(now, before)
    np.testing.assert_array_equal(forward(engine, 0, _tokens(8, seed=3)).output, kept[0])


def test_padding_rows_are_masked_and_uncounted(warm_engine):
    engine, _, _ = warm_engine
    clean = _tokens(6)
    garbage = np.concatenate([clean, np.full((10, 64), 1e30, np.float32)])  # 16 rows -> bucket 32
    for layer_index in (0, 1):
        result = forward(engine, layer_index, garbage, num_valid=6)
        alone = forward(engine, layer_index, clean)
        assert result.output.shape == (6, 64) and np.all(np.isfinite(result.output))
        np.testing.assert_allclose(result.output, alone.output, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result.tokens_per_expert, alone.tokens_per_expert)
        assert result.tokens_per_expert.sum() == 6 * 2
        routed = route(engine, layer_index, hidden=garbage, num_valid=6)
        np.testing.assert_array_equal(routed.tokens_per_expert, alone.tokens_per_expert)
        assert routed.aux_loss == pytest.approx(route(engine, layer_index, hidden=clean).aux_loss, rel=1e-5)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _router_reference(logits, expert_bias, cfg):
    """ids, weights, tokens per expert and the unscaled aux loss, from the router kernels directly."""
    probs, routing_map = router.fused_topk_with_score_function(
        logits, cfg.topk, use_pre_softmax=cfg.use_pre_softmax, num_groups=cfg.num_groups,
        group_topk=cfg.group_topk, scaling_factor=cfg.scaling_factor, score_function=cfg.score_function,
        expert_bias=expert_bias)
    ids, weights = router.topk_ids_and_weights(probs, routing_map, cfg.topk)
    counts = routing_map.sum(axis=0, dtype=jnp.int32)
    scores, _ = router.fused_topk_with_score_function(logits, cfg.topk, score_function=cfg.score_function,
                                                      compute_aux_scores=True)
    return ids, weights, counts, router.fused_moe_aux_loss(scores, counts, cfg.topk, 1.0)


@pytest.mark.parametrize("layer_index", [0, 1])
def test_route_equals_the_router(warm_engine, tiny, layer_index):
    engine, _, _ = warm_engine
    layer, cfg = tiny[layer_index], tiny[layer_index].cfg
    x = _tokens(20, seed=3)
    params = _device_params(layer, jnp.float32)
    logits = jnp.asarray(x) @ params.router_weight
    ids, weights, counts, aux = (np.asarray(v) for v in _router_reference(logits, params.expert_bias, cfg))

    for result in (route(engine, layer_index, hidden=x, aux_loss_coeff=0.01),
                   route(engine, layer_index, logits=np.asarray(logits), aux_loss_coeff=0.01)):
        np.testing.assert_array_equal(result.topk_ids, ids)
        np.testing.assert_allclose(result.topk_weights, weights, rtol=1e-5)
        np.testing.assert_array_equal(result.tokens_per_expert, counts)
        assert result.aux_loss == pytest.approx(0.01 * aux, rel=1e-5)
        # the per-token aux scores [n, E] give the same loss on the host, for this or any subset of rows
        assert result.aux_scores.shape == (20, cfg.num_experts)
        host = api.aux_loss_of(result.aux_scores.sum(axis=0), counts, 20, cfg.topk, 0.01)
        assert host == pytest.approx(0.01 * aux, rel=1e-5)
    # Route agrees with Forward's routing, and the default coefficient is 1 (1.0 = balanced).
    np.testing.assert_array_equal(forward(engine, layer_index, x).topk_ids, ids)
    assert route(engine, layer_index, hidden=x).aux_loss == pytest.approx(aux, rel=1e-5)


def test_forward_equals_moe_layer_bf16(tiny):
    # Plain host arrays this time (as from a checkpoint): cast to bf16 when placed.
    host_layer = dataclasses.replace(tiny[1], params=dict(tiny[1].params))
    host_w_up = weakref.ref(host_layer.params["w_up"])
    engine = build_engine([host_layer], buckets=(8,), dtype="bfloat16", devices=1).engine
    del host_layer
    gc.collect()
    assert host_w_up() is None  # the engine keeps the device copy only
    w_up = engine.layers[1].params.w_up  # prepared at load (CPU, native kernel): not an array
    assert not isinstance(w_up, jax.Array) and all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(w_up))
    assert w_up.dtype == jnp.bfloat16 and moe.logical_shape(w_up) == tiny[1].params["w_up"].shape
    x = _tokens(7, seed=5, dtype=jnp.bfloat16)
    result = forward(engine, 1, x)
    expected = moe_layer(_device_params(tiny[1], jnp.bfloat16), jnp.asarray(x), cfg=tiny[1].cfg)
    assert result.output.dtype == jnp.bfloat16
    np.testing.assert_allclose(result.output.astype(np.float32), np.asarray(expected, np.float32),
                               rtol=2e-2, atol=2e-2)
    assert forward(engine, 1, x[:5]).output.shape == (5, 64)
    assert engine.compilations == 1 and not engine.warm  # compiled on first use, once


def test_info(served, warm_engine):
    info = served.info()
    assert info["buckets"] == [8, 32] and info["dtype"] == "float32" and info["warm"]
    assert info["mesh"] == {"axis": "ep", "size": 1, "platform": "cpu", "devices": [str(jax.devices()[0])],
                            "expert_parallel": False}
    assert [layer["index"] for layer in info["layers"]] == [0, 1]
    assert info["layers"][1]["config"]["score_function"] == "sigmoid"
    assert info["layers"][0]["params"]["w_gate"] == {"shape": [8, 64, 128], "dtype": "float32",
                                                     "split_over_ep": False}
    assert info["forward_compiler_options"] == []  # tiny's 32 KiB expert matrices keep the defaults
    # The dev box and CI have g++ (and an AVX2 CPU at least).
    assert info["native_cpu_kernel"] == {"available": True, "reason": None, "isa": cpu.isa(), "amx": cpu.amx()}
    assert cpu.amx() in cpu.AMX_ORDERS and (cpu.isa() == "amx_bf16") == (cpu.amx() == "high_first")
    assert info["native_cpu_kernel"]["isa"] in cpu.ISA_LEVELS[1:]
    assert info["weight_layout"] == "panels" and info["panel_columns"] == cpu.panel_columns()
    assert info["layers"][0]["params"]["w_gate"]["shape"] == [8, 64, 128]  # the logical shape, any width
    assert info["forward_expert_backends"] == [  # the two layers' routers differ: one compiled step each
        {"layers": [layer], "bucket": b, "backend": "native_cpu"} for layer in (0, 1) for b in (8, 32)]


def test_panel_weights_serve_the_same_outputs_as_row_major(tiny):
    """The panel-major layout (the default on CPU) changes how the weights lie, not what comes out:
    forward and route equal an engine that keeps the checkpoint's row-major layout, bit for bit,
    at few rows per expert (streaming path) and many (packed path)."""
    built = {layout: build_engine(tiny, buckets=(8, 512), dtype="bfloat16", devices=1,
                                  panel_weights=layout == "panels") for layout in ("panels", "row_major")}
    assert {layout: b.info()["weight_layout"] for layout, b in built.items()} == {
        "panels": "panels", "row_major": "row_major"}
    both = {layout: b.engine for layout, b in built.items()}
    assert isinstance(both["row_major"].layers[0].params.w_gate, jax.Array)
    for layer in (0, 1):
        for n in (3, 100, 150, 500):
            x = _tokens(n, seed=n + layer, dtype=jnp.bfloat16)
            got, want = (forward(both[layout], layer, x) for layout in ("panels", "row_major"))
            np.testing.assert_array_equal(got.output, want.output)
            np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
        np.testing.assert_array_equal(route(both["panels"], layer, hidden=x).topk_ids,
                                      route(both["row_major"], layer, hidden=x).topk_ids)


def test_small_buckets_of_large_experts_compile_with_small_rows_options(monkeypatch):
    """Without the native CPU kernel (no compiler), a layer with 4 MiB fp32 expert matrices: buckets
    under 64 rows per expert compile with YNNPACK off (moe.compiler_options), larger ones with the
    defaults; both equal the kernel."""
    monkeypatch.setattr(cpu_build, "_state", (None, "no C++ compiler (test)"))  # as on a machine without one
    cfg = moe.MoEConfig(num_experts=4, topk=2, hidden_size=1024, intermediate_size=1024)
    params = {name: np.asarray(value) for name, value in moe.init_params(cfg, jax.random.key(0), jnp.float32).items()}
    layer = LoadedLayer(index=0, cfg=cfg, params=params, source="test")
    served = build_engine([layer], buckets=(8, 128), dtype="float32", devices=1)
    engine = served.engine
    assert served.info()["weight_layout"] == "row_major"  # no native kernel: the XLA backends' layout
    events = []
    engine.add_compile_listener(events.append)
    assert served.info()["forward_compiler_options"] == [
        {"layers": [0], "bucket": 8, "options": SMALL_ROWS_CPU_OPTIONS}]
    assert served.info()["forward_expert_backends"] == [
        {"layers": [0], "bucket": 8, "backend": "capacity"}, {"layers": [0], "bucket": 128, "backend": "expert_loop"}]
    for n in (5, 100):
        x = _tokens(n, hidden=1024, seed=n)
        expected = moe_layer(_device_params(layer, jnp.float32), jnp.asarray(x), cfg=cfg)
        np.testing.assert_allclose(forward(engine, 0, x).output, np.asarray(expected), rtol=1e-4, atol=1e-4)
    route(engine, 0, hidden=_tokens(5, hidden=1024))
    assert [(e.kind, e.bucket, e.compiler_options, e.expert_backend) for e in events] == [
        ("forward", 8, SMALL_ROWS_CPU_OPTIONS, "capacity"), ("forward", 128, {}, "expert_loop"),
        ("route_hidden", 8, {}, None)]


def test_serve_notes_the_native_kernel_level_or_why_it_is_missing(served):
    assert weights.native_cpu_note(None) is None  # not a CPU engine
    assert weights.native_cpu_note({"available": True, "reason": None, "isa": "avx512_bf16"}) == (
        "native CPU expert kernel: avx512_bf16 instructions")
    assert weights.native_cpu_note({"available": True, "reason": None, "isa": "avx512_bf16"}, 64) == (
        "native CPU expert kernel: avx512_bf16 instructions, expert weights in 64-column panels")
    assert weights.native_cpu_note({"available": True, "reason": None, "isa": "amx_bf16", "amx": "high_first"}, 64) == (
        "native CPU expert kernel: amx_bf16 instructions (AMX tiles from 16 rows per expert), expert weights in "
        "64-column panels")
    assert "AMX tiles present, off: they add a bf16 pair's products low half first" in weights.native_cpu_note(
        {"available": True, "reason": None, "isa": "avx512_bf16", "amx": "low_first"})
    note = weights.native_cpu_note({"available": False, "reason": "no C++ compiler found (set CXX)", "isa": None})
    assert "unavailable (no C++ compiler found (set CXX))" in note
    # start-up's summary: the native kernel's line and host malloc's (tiny's weights fit no huge page)
    assert served.notes() == [weights.native_cpu_note(served.info()["native_cpu_kernel"], cpu.panel_columns()),
                              allocator.note(allocator.state().as_dict())]


def test_serve_notes_the_weights_pages():
    assert memory.note(None) is None  # not a CPU engine, or --no-huge-pages
    assert memory.note({"eligible_bytes": 0, "huge_bytes": 0, "seconds": 0.0, "collapse_errors": 0,
                             "reason": "no CPU buffer spans a whole 2 MiB page"}) is None
    assert memory.note({"eligible_bytes": 2 << 30, "huge_bytes": 1 << 30, "seconds": 1.25,
                             "collapse_errors": 3, "reason": None}) == "weights: 1024 of 2048 MiB on huge pages (1.25s)"
    assert memory.note({"eligible_bytes": 1 << 30, "huge_bytes": 0, "seconds": 0.0, "collapse_errors": 0,
                             "reason": "transparent huge pages are never on this system"}).endswith(
        "0 of 1024 MiB on huge pages (0.00s); transparent huge pages are never on this system")


def test_serve_notes_the_host_allocator():
    assert allocator.note(None) is None  # not a CPU engine
    assert allocator.note({"applied": True, "reason": None}).startswith(
        "host memory: freed buffers kept for reuse")
    assert allocator.note({"applied": False, "reason": "not glibc on Linux"}) == (
        "host memory: large freed buffers go back to the system (not glibc on Linux)")


def test_serve_progress_line_names_the_expert_backend_and_compiler_options(capsys):
    console.print_progress(CompileEvent((0, 1), 8, "forward", 1.5, 1, 3,
                                        {"xla_cpu_experimental_ynn_fusion_type": ""}, "expert_loop"))
    console.print_progress(CompileEvent((0,), 32, "route_hidden", 0.25, 2, 3))
    assert capsys.readouterr().out.splitlines() == [
        "expertd: compiled 1/3: forward bucket 8 for layers 0,1 in 1.50s (experts: expert_loop) "
        "(XLA options: xla_cpu_experimental_ynn_fusion_type='')",
        "expertd: compiled 2/3: route_hidden bucket 32 for layers 0 in 0.25s"]


def test_start_up_rejects_bad_layers_and_meshes(tiny):
    """(Buckets, dtype and backend are the config's to check: test_service_config.py; requests are
    checked once, when decoded: test_requests.py.)"""
    with pytest.raises(ValueError, match="layer 0 is given twice"):
        build_engine([tiny[0], tiny[0]], buckets=[8], devices=1)
    with pytest.raises(ValueError, match="the engine needs at least one layer"):
        build_engine([], buckets=[8], devices=1)
    with pytest.raises(ValueError, match="devices: asked for 9, 8 available"):
        build_engine(tiny, buckets=[8], devices=9)
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over 3 devices"):
        build_engine(tiny, buckets=[8], devices=3)


@pytest.fixture
def restore_compile_cache():
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
             jax.config.jax_persistent_cache_min_entry_size_bytes)
    yield
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", saved[2])
    compilation_cache.reset_cache()


def test_compile_cache_dir_gets_entries(tiny, tmp_path, restore_compile_cache):
    cache = tmp_path / "jax-cache"
    served = build_engine(tiny[:1], buckets=(4,), dtype="float32", devices=1, compile_cache_dir=cache)
    route(served.engine, 0, hidden=_tokens(2))  # compiles one step
    assert served.engine.compilations == 1
    assert [p for p in cache.rglob("*") if p.is_file()]
    assert served.info()["compile_cache_dir"] == str(cache)
    enable_compile_cache(cache)  # idempotent


def test_expert_parallel_engine_equals_single_device(tiny, warm_engine):
    single, _, _ = warm_engine
    # Layer 1 (sigmoid, expert bias, groups, shared expert) exercises the most of the EP path.
    served = build_engine(tiny[1:], buckets=(8,), dtype="float32", devices=4)
    engine = served.engine
    events = []
    warm_up(engine, progress=events.append)
    # the expert-parallel forward is an AOT-compiled step like the others, counted the same way
    assert [(e.done, e.total) for e in events] == [(1, 3), (2, 3), (3, 3)]
    assert sorted(e.kind for e in events) == ["forward", "route_hidden", "route_logits"]
    info = served.info()
    assert info["mesh"]["size"] == 4 and info["mesh"]["expert_parallel"]
    params = info["layers"][0]["params"]
    assert params["w_gate"]["shape"] == [8, 64, 128] and params["w_gate"]["split_over_ep"]
    assert not params["router_weight"]["split_over_ep"] and not params["shared_w_up"]["split_over_ep"]
    x = np.concatenate([_tokens(5, seed=9), np.full((2, 64), np.nan, np.float32)])
    sharded = forward(engine, 1, x, num_valid=5)
    alone = forward(single, 1, x[:5])
    np.testing.assert_allclose(sharded.output, alone.output, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sharded.topk_ids, alone.topk_ids)
    np.testing.assert_allclose(sharded.topk_weights, alone.topk_weights, rtol=1e-6)
    np.testing.assert_array_equal(sharded.tokens_per_expert, alone.tokens_per_expert)
    routed = route(engine, 1, hidden=x, num_valid=5)
    np.testing.assert_array_equal(routed.topk_ids, alone.topk_ids)
    assert engine.compilations == 3  # all compiled at warm-up
    # The expert weights live split over the 4 devices: 2 experts each.
    w_gate = engine.layers[1].params.w_gate
    assert {shard.data.shape for shard in w_gate.addressable_shards} == {(2, 64, 128)}


# ---------------------------------------------------------------------------------------------
# Hash-routed layers (DeepSeek-V4's hash_moe): token ids as a step input


@pytest.fixture(scope="module")
def hashed():
    """A DeepSeek-V4-style hash-routed layer (ids from tid2eid[token_id]) served beside tiny's layer 0."""
    cfg = moe.MoEConfig(num_experts=8, topk=2, hidden_size=64, intermediate_size=128, score_function="sqrtsoftplus",
                        norm_topk_prob=True, scaling_factor=1.5, hash_vocab_size=100, swiglu_limit=1.0,
                        num_shared_experts=1, shared_intermediate_size=64, shared_swiglu_limit=1.0)
    params = {name: np.asarray(value) for name, value in moe.init_params(cfg, jax.random.key(4)).items()}
    layer = LoadedLayer(index=7, cfg=cfg, params=params, source="test")
    return layer, build_engine([layer], buckets=(8, 32), dtype="float32", devices=1).engine


def test_hash_routed_layer_takes_token_ids_as_a_step_input(hashed):
    layer, engine = hashed
    assert engine.layers[7].params.tid2eid.dtype == np.int32  # placed as int32, not the engine dtype
    events = []
    warm_up(engine, progress=events.append)  # lowers the token-ids input with the others
    assert len(events) == 2 * 3
    x = _tokens(5, seed=11)
    ids = np.array([3, 99, 0, 42, 42], np.int32)
    padded = api.pad_rows([x], 8)
    result = engine.forward(7, padded, 5, token_ids=ids)
    expected, routing = moe_layer(_device_params(layer, jnp.float32), jnp.asarray(x), cfg=layer.cfg,
                                  return_routing=True, token_ids=jnp.asarray(ids))
    np.testing.assert_allclose(result.output, np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result.topk_ids, np.asarray(routing["topk_ids"]))
    table = layer.params["tid2eid"][ids]
    np.testing.assert_array_equal(np.sort(result.topk_ids, 1), np.sort(table, 1))  # the table's experts
    np.testing.assert_array_equal(result.topk_ids[3], result.topk_ids[4])  # same token id, same experts
    routed = engine.route(7, padded, 5, token_ids=np.concatenate([ids, [1, 1, 1]]))  # ids past num_valid: ignored
    np.testing.assert_array_equal(routed.topk_ids, result.topk_ids)
    np.testing.assert_allclose(routed.topk_weights, result.topk_weights, rtol=1e-6)
    logits = np.asarray(moe.router_logits(_device_params(layer, jnp.float32), jnp.asarray(x), layer.cfg))
    from_logits = engine.route(7, api.pad_rows([logits], 8), 5, from_logits=True, token_ids=ids)
    np.testing.assert_array_equal(from_logits.topk_ids, result.topk_ids)
    assert engine.compilations == 6  # all compiled at warm-up


def test_hash_routed_layer_without_or_with_bad_token_ids_is_invalid_argument(hashed):
    from expertd.server.errors import status_of

    _, engine = hashed
    padded = api.pad_rows([_tokens(3)], 8)
    with pytest.raises(InvalidRequest, match="token_ids: required: layer 7 is hash-routed") as missing:
        engine.forward(7, padded, 3)
    assert missing.value.field == "token_ids"
    with pytest.raises(InvalidRequest, match=r"token_ids\[1\] = 100 is out of the vocabulary \[0, 100\)") as bad:
        engine.route(7, padded, 3, token_ids=np.array([5, 100, 2]))
    code, message, details = status_of(bad.value)
    assert code.name == "INVALID_ARGUMENT" and "token_ids[1] = 100" in message
    assert details[0].field_violations[0].field == "token_ids"
    with pytest.raises(InvalidRequest, match=r"token_ids: must be \[n\] with 3 <= n <= 8"):
        engine.forward(7, padded, 3, token_ids=np.array([1, 2]))
    # the host check the request path calls when it decodes a request (kernels.moe.check_token_ids)
    with pytest.raises(ValueError, match=r"token_ids\[0\] = -4") as host:
        moe.check_token_ids(np.array([-4]), engine.layers[7].cfg)
    assert status_of(host.value)[2][0].field_violations[0].field == "token_ids"


def test_hash_routed_layer_over_the_expert_parallel_mesh(hashed):
    """The token ids travel with their tokens over 4 devices: the same routing and output as one device."""
    layer, single = hashed
    engine = build_engine([layer], buckets=(8,), dtype="float32", devices=4).engine
    assert engine.layers[7].params.b_gate is None and engine.layers[7].params.tid2eid.dtype == np.int32
    padded = api.pad_rows([_tokens(5, seed=12)], 8)
    ids = np.array([7, 7, 0, 99, 13], np.int32)
    sharded = engine.forward(7, padded, 5, token_ids=ids)
    alone = single.forward(7, padded, 5, token_ids=ids)
    np.testing.assert_allclose(sharded.output, alone.output, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(sharded.topk_ids, alone.topk_ids)
    np.testing.assert_array_equal(sharded.tokens_per_expert, alone.tokens_per_expert)
    with pytest.raises(InvalidRequest, match="token_ids: required"):
        engine.forward(7, padded, 5)
