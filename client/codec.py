"""numpy <-> ``expertd.v1.Tensor``: dtype + shape + raw little-endian row-major bytes.

Used by both the client and the server. Supported dtypes: float32, bfloat16 (``ml_dtypes``, the
same type as ``jnp.bfloat16``), float16 and int32.

Bad tensors raise :class:`TensorError` (a ``ValueError``) naming the offending field, e.g.
``hidden_states.dtype`` or ``hidden_states.data``, and saying what was expected and what came.
"""
from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np

from expertd.client.pb.v1 import expert_pb2

DType = expert_pb2.DType

_NUMPY_BY_ENUM: dict[int, np.dtype] = {
    expert_pb2.DTYPE_FLOAT32: np.dtype(np.float32),
    expert_pb2.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    expert_pb2.DTYPE_FLOAT16: np.dtype(np.float16),
    expert_pb2.DTYPE_INT32: np.dtype(np.int32),
}
_ENUM_BY_NUMPY: dict[np.dtype, int] = {dt: enum for enum, dt in _NUMPY_BY_ENUM.items()}
_NAMES: dict[int, str] = {enum: str(dt) for enum, dt in _NUMPY_BY_ENUM.items()}
FLOAT_DTYPES = (expert_pb2.DTYPE_FLOAT32, expert_pb2.DTYPE_BFLOAT16, expert_pb2.DTYPE_FLOAT16)


class TensorError(ValueError):
    """A tensor that cannot be decoded or does not have the expected dtype/shape.

    ``field`` is the dotted name of the offending field (``hidden_states.shape``);
    ``description`` says what was expected and what came.
    """

    def __init__(self, field: str, description: str):
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


def dtype_name(dtype: int) -> str:
    """``DTYPE_BFLOAT16`` -> ``"bfloat16"``; unknown values give ``"DType(<n>)"``."""
    return _NAMES.get(dtype, f"DType({dtype})")


def numpy_dtype(dtype: int) -> np.dtype:
    """The numpy dtype of a ``DType`` value (``ValueError`` for unsupported values)."""
    try:
        return _NUMPY_BY_ENUM[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype_name(dtype)}; expected one of {sorted(_NAMES.values())}") from None


def dtype_enum(dtype: np.dtype | type) -> int:
    """The ``DType`` value of a numpy dtype (``ValueError`` for unsupported dtypes)."""
    try:
        return _ENUM_BY_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_NAMES.values())}") from None


def encode(array: np.ndarray) -> expert_pb2.Tensor:
    """Encode ``array`` (any shape; float32, bfloat16, float16 or int32) as a Tensor message."""
    tensor = expert_pb2.Tensor()
    encode_into(tensor, array)
    return tensor


def encode_into(tensor: expert_pb2.Tensor, array: np.ndarray) -> None:
    """Write ``array`` into the Tensor ``tensor``, e.g. a response's field in place: building
    a Tensor and passing it to a message constructor would copy it once more."""
    array = np.asarray(array)
    if array.dtype.byteorder not in "=|":  # an explicitly byte-ordered dtype such as '>f4'
        array = array.astype(array.dtype.newbyteorder("="))
    tensor.dtype = dtype_enum(array.dtype)
    tensor.shape[:] = array.shape
    tensor.data = _little_endian_bytes(array)


def decode(
    tensor: expert_pb2.Tensor,
    *,
    field: str = "tensor",
    dtypes: tuple[int, ...] | None = None,
    ndim: int | None = None,
) -> np.ndarray:
    """Decode a Tensor message into a read-only numpy array (no copy on little-endian hosts).

    Args:
      tensor: the message.
      field: its name in the request, used in error messages (``hidden_states``).
      dtypes: the ``DType`` values accepted (default: every supported one).
      ndim: the required rank, if any.

    Raises:
      TensorError: unknown or unaccepted dtype, wrong rank, negative dimensions, or a byte length
        that does not match ``prod(shape) * itemsize``.
    """
    allowed = dtypes if dtypes is not None else tuple(_NUMPY_BY_ENUM)
    if tensor.dtype not in allowed or tensor.dtype not in _NUMPY_BY_ENUM:
        expected = ", ".join(dtype_name(d) for d in allowed)
        raise TensorError(f"{field}.dtype", f"expected one of {expected}, got {dtype_name(tensor.dtype)}")
    if ndim is not None and len(tensor.shape) != ndim:  # before the dimensions are read: a rank costs O(1)
        raise TensorError(f"{field}.shape", f"expected {ndim} dimensions, got {shown_shape(tensor.shape)}")
    if len(tensor.shape) > MAX_DIMENSIONS:
        raise TensorError(f"{field}.shape", f"expected at most {MAX_DIMENSIONS} dimensions, got "
                                            f"{shown_shape(tensor.shape)}")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"{field}.shape", f"dimensions must be >= 0, got {list(shape)}")
    return from_bytes(tensor.data, _NUMPY_BY_ENUM[tensor.dtype], shape, field=field)


MAX_DIMENSIONS = 8
"""The most dimensions a tensor may declare (expertd's tensors have 1 or 2)."""


def shown_shape(shape) -> str:
    """A shape as an error message quotes it: its first dimensions only when it has many."""
    count = len(shape)
    if count <= 4:
        return str([int(d) for d in shape])
    return f"[{', '.join(str(int(shape[i])) for i in range(3))}, ...] ({count} dimensions)"


def from_bytes(data: bytes, dtype: np.dtype, shape: tuple[int, ...], *, field: str = "tensor") -> np.ndarray:
    """``data`` (little-endian, row-major) as a read-only array of ``dtype`` and ``shape`` (no copy on
    little-endian hosts), for a caller that has checked dtype and shape already.

    Raises:
      TensorError: (``{field}.data``) a byte length that is not ``prod(shape) * itemsize``.
    """
    expected_bytes = math.prod(shape) * dtype.itemsize
    if len(data) != expected_bytes:
        raise TensorError(f"{field}.data", f"expected {expected_bytes} bytes for {dtype} shape {list(shape)}, "
                                           f"got {len(data)}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if sys.byteorder == "big":
        array = array.byteswap()
    return array


def _little_endian_bytes(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    if sys.byteorder == "big":
        array = array.byteswap()
    return array.tobytes()
