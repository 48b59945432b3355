"""Float block scales that are MXFP4 by value (fp4pass.onnx.rewrite_common.float_scales_to_e8m0)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from fp4pass.errors import FormatError
from fp4pass.onnx.rewrite_common import float_scales_to_e8m0


def _codes(rows: int, blocks: int, zero_block=None) -> ir.PackedTensor:
    packed = np.full((rows, blocks * 16), 0x21, np.uint8)  # every block holds non-zero codes
    if zero_block is not None:
        packed[zero_block[0], zero_block[1] * 16:(zero_block[1] + 1) * 16] = 0x88  # -0, -0
    return ir.PackedTensor(packed, ir.DataType.FLOAT4E2M1, shape=ir.Shape([rows, blocks * 32]))


def test_powers_of_two_over_the_whole_e8m0_range():
    k = np.arange(-127, 128).reshape(5, 51)
    scales = np.ldexp(np.float32(1), k).astype(np.float32)  # 2^-127 is a float32 subnormal
    codes, reason = float_scales_to_e8m0(scales, _codes(5, 51), "s")
    assert reason is None
    np.testing.assert_array_equal(codes, (k + 127).astype(np.uint8))
    # independent: ml_dtypes' E8M0 of the same values
    np.testing.assert_array_equal(codes, scales.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_scales(dtype):
    scales = np.array([[2.0**-14, 0.5], [1.0, 2.0**15]], dtype=dtype).astype(np.float32)
    codes, reason = float_scales_to_e8m0(scales, _codes(2, 2), "s")
    assert reason is None
    np.testing.assert_array_equal(codes, [[113, 126], [127, 142]])


@pytest.mark.parametrize("value,why", [(0.75, "not a power of two"), (-0.5, "negative"),
                                       (2.0**-128, "outside E8M0's range"),
                                       (0.0, "0 over a block with non-zero codes")])
def test_not_mxfp4(value, why):
    scales = np.array([[1.0, np.float32(value)]], np.float32)
    codes, reason = float_scales_to_e8m0(scales, _codes(1, 2), "s")
    assert codes is None
    assert reason.startswith("lossy") and why in reason and "[0, 1]" in reason


def test_zero_scale_over_an_all_zero_block_is_mxfp4():
    scales = np.array([[0.5, 0.0], [0.0, 4.0]], np.float32)
    codes, reason = float_scales_to_e8m0(scales, _codes(2, 2, zero_block=(0, 1)), "s")
    assert codes is None and "[1, 0]" in reason  # the block at [1, 0] holds values: its zero scale is lossy
    scales[1, 0] = 1.0
    codes, reason = float_scales_to_e8m0(scales, _codes(2, 2, zero_block=(0, 1)), "s")
    assert reason is None
    np.testing.assert_array_equal(codes, [[126, 0], [127, 129]])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_scale_is_an_error(value):
    with pytest.raises(FormatError, match="NaN or infinity"):
        float_scales_to_e8m0(np.array([[1.0, value]], np.float32), _codes(1, 2), "s")
