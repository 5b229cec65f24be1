"""``decode.check_tokens``' NaN / Inf scan: 16-bit floats are tested by their exponent bits; every
dtype, contiguous or not, names the first row holding a NaN or Inf and passes the largest finite
values."""
import ml_dtypes
import numpy as np
import pytest

from expertd.server.errors import InvalidRequest
from expertd.server.frontends import decode

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("value", [np.nan, -np.nan, np.inf, -np.inf], ids=["nan", "-nan", "inf", "-inf"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_the_first_row_with_a_nan_or_inf_is_named(dtype, value, contiguous):
    x = np.zeros((6, 16), dtype) if contiguous else np.zeros((6, 32), dtype)[:, ::2]
    x[4, 0] = value
    x[3, 15] = value
    with pytest.raises(InvalidRequest) as info:
        decode.check_tokens(x, "hidden_states", 16, "H", 8)
    assert info.value.field == "hidden_states" and "first at token 3" in info.value.description


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_largest_and_smallest_finite_values_pass(dtype):
    info = ml_dtypes.finfo(dtype)  # numpy's finfo knows no bfloat16
    x = np.array([[info.max, -info.max, info.tiny, -info.tiny, info.smallest_subnormal, 0.0, -0.0, 1.0]], dtype)
    decode.check_tokens(x, "hidden_states", 8, "H", 8)
