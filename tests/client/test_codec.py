"""expertd.client.codec: numpy <-> Tensor round trips and field-named errors."""
import ml_dtypes
import numpy as np
import pytest

from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
@pytest.mark.parametrize("shape", [(0, 4), (1, 1), (3, 5), (2, 3, 4)])
def test_round_trip_is_exact(dtype, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    tensor = codec.encode(x)
    assert list(tensor.shape) == list(shape)
    assert len(tensor.data) == x.size * np.dtype(dtype).itemsize
    y = codec.decode(expert_pb2.Tensor.FromString(tensor.SerializeToString()))
    assert y.dtype == np.dtype(dtype) and y.shape == shape
    np.testing.assert_array_equal(y.view(np.uint8), x.view(np.uint8))


def test_bytes_are_little_endian_whatever_the_array_byte_order():
    x = np.array([1.0, -2.5], dtype=">f4")
    tensor = codec.encode(x)
    assert tensor.data == np.array([1.0, -2.5], dtype="<f4").tobytes()
    assert tensor.dtype == expert_pb2.DTYPE_FLOAT32


def test_bfloat16_bytes_match_ml_dtypes_layout():
    x = np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16)
    tensor = codec.encode(x)
    assert tensor.dtype == expert_pb2.DTYPE_BFLOAT16
    assert tensor.data == np.array([0x3F80, 0xC000, 0x3F00], dtype="<u2").tobytes()


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported dtype float64"):
        codec.encode(np.zeros(3, dtype=np.float64))


@pytest.mark.parametrize(
    "tensor, kwargs, field, text",
    [
        (expert_pb2.Tensor(dtype=0, shape=[1, 2], data=b""), {}, "x.dtype", "got DType(0)"),
        (expert_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4), {}, "x.dtype", "got DType(99)"),
        (
            expert_pb2.Tensor(dtype=expert_pb2.DTYPE_INT32, shape=[1], data=b"\0" * 4),
            {"dtypes": codec.FLOAT_DTYPES},
            "x.dtype",
            "expected one of float32, bfloat16, float16, got int32",
        ),
        (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_FLOAT32, shape=[4], data=b"\0" * 16), {"ndim": 2}, "x.shape",
         "expected 2 dimensions"),
        (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_FLOAT32, shape=[2, -1], data=b""), {}, "x.shape", ">= 0"),
        (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20), {}, "x.data",
         "expected 24 bytes"),
        (expert_pb2.Tensor(dtype=expert_pb2.DTYPE_BFLOAT16, shape=[2, 3], data=b"\0" * 24), {}, "x.data",
         "expected 12 bytes"),
    ],
)
def test_decode_errors_name_the_field(tensor, kwargs, field, text):
    with pytest.raises(codec.TensorError) as info:
        codec.decode(tensor, field="x", **kwargs)
    assert info.value.field == field
    assert text in str(info.value)
    assert isinstance(info.value, ValueError)


def test_encode_into_fills_a_field_in_place_and_replaces_what_it_held():
    response = expert_pb2.ForwardResponse()
    codec.encode_into(response.output, np.ones((3, 4), np.float32))
    x = np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3)
    codec.encode_into(response.output, x)
    assert response.output == codec.encode(x)
    np.testing.assert_array_equal(codec.decode(response.output), x)
