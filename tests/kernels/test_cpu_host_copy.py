"""expertd.kernels.cpu.copy_2d (the checkpoint loader's transposing copy) against `out[...] = src`,
bit for bit, over dtypes, shapes with block and register-tile tails, and every kind of view; the
native path where the library is built and the numpy path everywhere."""
import ml_dtypes
import numpy as np
import pytest

from expertd.kernels import cpu
from expertd.kernels.cpu import host_copy

DTYPES = [np.uint8, ml_dtypes.bfloat16, np.float16, np.float32, np.int64, ml_dtypes.float8_e4m3fn]
SHAPES = [(1, 1), (3, 5), (8, 8), (9, 17), (64, 64), (65, 130), (300, 37), (256, 520)]


def _views(base: np.ndarray):
    """[R, C] views of ``base`` (3-D, [2, A, B]) of every stride pattern the loader meets."""
    yield "transposed", base[1].T
    yield "transposed expert slice", base.transpose(0, 2, 1)[0]
    yield "contiguous", base[0]
    yield "every other row", base[0, ::2]
    yield "sliced columns", base[1, :, 1:]
    yield "reversed", base[1, ::-1].T
    yield "two strides", base[0, ::3, ::2]


def _source(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 256, size=(2, *shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    raw = bits.reshape(2, *shape[:-1], shape[-1] * np.dtype(dtype).itemsize)
    return raw.view(dtype)  # every bit pattern, NaN payloads included: compared as bits


def _bits(array):
    return np.ascontiguousarray(array).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("path", ["copy_2d", "numpy"])
def test_copy_equals_assignment_for_every_view(dtype, shape, path):
    base = _source(shape, dtype, seed=shape[0] * 1000 + shape[1])
    for name, src in _views(base):
        want = np.empty(src.shape, src.dtype)
        host_copy.copy_2d_reference(want, src)
        out = np.zeros(src.shape, src.dtype)
        (cpu.copy_2d if path == "copy_2d" else host_copy.copy_2d_numpy)(out, src)
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=f"{name} {src.shape} strides {src.strides}")


def test_the_native_library_does_the_transposed_copy():
    if not cpu.available():
        pytest.skip(f"native CPU library unavailable: {cpu.unavailable_reason()}")
    lib = host_copy.load()[0]
    src = _source((37, 70), ml_dtypes.bfloat16, seed=1)[0].T
    out = np.zeros(src.shape, src.dtype)
    assert lib.expertd_strided_copy_2d(src.ctypes.data, *src.strides, out.ctypes.data, *out.shape, 2) == 0
    np.testing.assert_array_equal(_bits(out), _bits(src))
    assert lib.expertd_strided_copy_2d(src.ctypes.data, *src.strides, out.ctypes.data, *out.shape, 3) == -1


def test_bad_arguments_name_what_was_expected():
    src = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous 2-D array"):
        cpu.copy_2d(np.zeros((6, 4), np.float32).T, src)
    with pytest.raises(ValueError, match=r"src must have out's shape \[4, 5\], got \[4, 6\]"):
        cpu.copy_2d(np.zeros((4, 5), np.float32), src)
    with pytest.raises(ValueError, match="src must have out's dtype bfloat16, got float32"):
        cpu.copy_2d(np.zeros((4, 6), ml_dtypes.bfloat16), src)
    frozen = np.zeros((4, 6), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable=False"):
        cpu.copy_2d(frozen, src)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (128, 128), (130, 300), (257, 129)], ids=str)
@pytest.mark.parametrize("block", [(1, 1), (2, 3), (64, 32), (128, 128)], ids=str)
def test_block_lookup_equals_its_reference(dtype, shape, block):
    if not cpu.available():
        pytest.skip(f"native CPU library unavailable: {cpu.unavailable_reason()}")
    rng = np.random.default_rng(shape[0] * 7 + block[0])
    bm, bn = block
    wide = rng.integers(0, 256, size=(shape[0], shape[1] + 5), dtype=np.uint8)
    codes = wide[:, 2:2 + shape[1]]  # rows further apart than their width
    tables = _source((-(-shape[0] // bm), -(-shape[1] // bn) * 256), dtype, seed=3)[0]
    tables = np.ascontiguousarray(tables.reshape(-(-shape[0] // bm), -(-shape[1] // bn), 256))
    out = np.zeros(shape, dtype)
    assert cpu.block_lookup(out, codes, tables, bm, bn)
    np.testing.assert_array_equal(_bits(out), _bits(cpu.block_lookup_reference(codes, tables, bm, bn)))


def test_block_lookup_names_what_disagrees():
    codes, out = np.zeros((4, 6), np.uint8), np.zeros((4, 6), ml_dtypes.bfloat16)
    tables = np.zeros((2, 2, 256), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"tables must be a C-contiguous bfloat16 \[2, 2, 256\] array, got bfloat16 "
                                         r"\[2, 3, 256\]"):
        cpu.block_lookup(out, codes, np.zeros((2, 3, 256), ml_dtypes.bfloat16), 2, 3)
    with pytest.raises(ValueError, match="codes must be uint8 with contiguous rows"):
        cpu.block_lookup(out, codes.T.copy().T, tables, 2, 3)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous \[4, 6\] array of 2- or 4-byte elements"):
        cpu.block_lookup(np.zeros((4, 6), np.float64), codes, tables, 2, 3)
    with pytest.raises(ValueError, match="bm and bn must be >= 1"):
        cpu.block_lookup(out, codes, tables, 0, 3)
