"""Packed step results (``result_packing``): the bytes of any mix of results survive pack, one
transfer and unpack, every piece aligned; an engine that packs gives bit for bit the answers of
one that reads each result (forward and both routes, fp32 and bf16, one device and an
expert-parallel mesh, hash-routed layers)."""
import jax
import ml_dtypes
import numpy as np
import pytest

from expertd.kernels import moe
from expertd.server import steps
from expertd.server.engine import Engine
from expertd.server.model import LoadedLayer, load_preset
from expertd.server.result_packing import PackedStep, ResultLayout, pack, unpack
from expertd.server.startup import build_engine
from expertd.server.warmup import warm_up

BF16 = np.dtype(ml_dtypes.bfloat16)
MIXES = {
    "forward fp32": [((3, 8), np.float32), ((3, 2), np.int32), ((3, 2), np.float32), ((4,), np.int32)],
    "forward bf16, odd sizes": [((1, 5), BF16), ((1, 3), np.int32), ((1, 3), np.float32), ((7,), np.int32)],
    "route, a scalar": [((2, 2), np.int32), ((2, 2), np.float32), ((4,), np.int32), ((), np.float32),
                        ((2, 4), np.float32)],
    "one- and two-byte pieces, an empty one": [((3,), np.int8), ((5,), np.float16), ((2,), np.uint16),
                                               ((0, 4), np.float32), ((3,), np.int32)],
}


def _random(shape, dtype, rng):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("mix", MIXES)
def test_pack_and_unpack_round_trip_every_result_bit_for_bit_and_aligned(mix):
    rng = np.random.default_rng(len(mix))
    arrays = [_random(shape, np.dtype(dtype), rng) for shape, dtype in MIXES[mix]]
    packer = PackedStep(lambda *xs: xs)
    buffer = jax.jit(packer)(*arrays)
    layout = packer.layout
    assert buffer.dtype == np.uint8 and buffer.shape == (layout.nbytes,)
    assert layout.nbytes == sum(a.nbytes for a in arrays)
    assert all(offset % np.dtype(d).itemsize == 0 for offset, d in zip(layout.offsets, layout.dtypes, strict=True))
    back = unpack(np.asarray(jax.device_get(buffer)), layout)
    for got, want in zip(back, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.flags.aligned
        assert got.tobytes() == want.tobytes()


def test_layout_puts_the_widest_items_first_and_keeps_result_order_within_a_width():
    layout = ResultLayout.of([np.zeros(3, np.int8), np.zeros(2, np.float32), np.zeros(1, np.int64),
                              np.zeros(3, BF16), np.zeros(2, np.int32)])
    assert layout.offsets == (30, 8, 0, 24, 16) and layout.nbytes == 33


def test_unpack_refuses_a_buffer_of_another_size_or_type():
    layout = ResultLayout.of([np.zeros((2, 2), np.float32)])
    with pytest.raises(ValueError, match=r"expected uint8 \[16\], got uint8 \[12\]"):
        unpack(np.zeros(12, np.uint8), layout)
    with pytest.raises(ValueError, match=r"got float32 \[4\]"):
        unpack(np.zeros(4, np.float32), layout)


def test_pack_of_traced_results_matches_their_host_bytes():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    layout = ResultLayout.of([x, x.astype(BF16)])
    buffer = np.asarray(jax.jit(lambda a: pack((a, a.astype(BF16)), layout))(x))
    assert buffer.tobytes() == x.tobytes() + x.astype(BF16).tobytes()


# ---------------------------------------------------------------------------------------------
# The engine: packed against read one by one


def _twins(layers, dtype, devices):
    """Two warm engines on the same placed weights, one reading results one by one, one packed."""
    served = build_engine(layers, buckets=(8,), dtype=dtype, devices=devices)
    plain = served.engine
    packed = Engine(list(plain.layers.values()), plain.placement, dtype=dtype, buckets=plain.buckets,
                    backend=plain.backend, pack_results=True)
    for engine in (plain, packed):
        warm_up(engine)
    return plain, packed


def _assert_same(a, b):
    for name, x, y in zip(a._fields, a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def _same_answers(plain, packed, layer, rows=5, token_ids=None):
    cfg = plain.layers[layer].cfg
    rng = np.random.default_rng(layer)
    hidden = steps.pad_rows([rng.standard_normal((rows, cfg.hidden_size)).astype(plain.dtype)], 8)
    logits = steps.pad_rows([rng.standard_normal((rows, cfg.num_experts)).astype(np.float32)], 8)
    _assert_same(plain.forward(layer, hidden, rows, token_ids=token_ids),
                 packed.forward(layer, hidden, rows, token_ids=token_ids))
    for tokens, from_logits in ((hidden, False), (logits, True)):
        options = dict(from_logits=from_logits, aux_loss_coeff=0.5, token_ids=token_ids)
        _assert_same(plain.route(layer, tokens, rows, **options), packed.route(layer, tokens, rows, **options))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packing_engine_answers_bit_for_bit_as_one_reading_each_result(dtype):
    plain, packed = _twins(load_preset("tiny", dtype=dtype), dtype, devices=1)
    assert not plain.pack_results and packed.pack_results  # on CPU the engine reads results in place
    assert plain.result_layout(0, 8, steps.FORWARD) is None
    layout = packed.result_layout(0, 8, steps.FORWARD)
    assert layout.dtypes == (np.dtype(dtype), np.int32, np.float32, np.int32)
    for layer in plain.layers:
        _same_answers(plain, packed, layer)


def test_a_packing_expert_parallel_engine_answers_as_one_reading_each_result():
    plain, packed = _twins(load_preset("tiny", dtype="float32")[1:], "float32", devices=4)
    assert plain.placement.ep is not None
    _same_answers(plain, packed, 1)


def test_a_packing_engine_serves_hash_routed_layers_with_their_token_ids():
    cfg = moe.MoEConfig(num_experts=8, topk=2, hidden_size=64, intermediate_size=128, score_function="sqrtsoftplus",
                        norm_topk_prob=True, hash_vocab_size=100, num_shared_experts=1, shared_intermediate_size=64)
    params = {name: np.asarray(value) for name, value in moe.init_params(cfg, jax.random.key(4)).items()}
    plain, packed = _twins([LoadedLayer(index=7, cfg=cfg, params=params, source="test")], "float32", devices=1)
    _same_answers(plain, packed, 7, token_ids=np.arange(5, dtype=np.int32))
