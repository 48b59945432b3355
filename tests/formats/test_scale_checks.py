"""The NVFP4 scale-value rules (``fp4pass.formats.scale_checks``) and the lossless rule
(``fp4pass.convert.lossless_range``), against values decoded by ml_dtypes and spreads counted by hand."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from fp4pass.convert import lossless_range
from fp4pass.formats import block_scale_problems, scale_value_problems


def test_float_scales_nonfinite_zero_negative_each_its_own():
    values = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1.5, -1e-30, 1e-30, 2688.0], dtype=np.float32)
    masks = dict(scale_value_problems(values))
    assert list(masks) == ["nonfinite_scale", "zero_scale", "negative_scale"]
    assert masks["nonfinite_scale"].tolist() == [True, True, True, False, False, False, False, False, False]
    assert masks["zero_scale"].tolist() == [False, False, False, True, True, False, False, False, False]
    assert masks["negative_scale"].tolist() == [False, False, False, False, False, True, True, False, False]


def test_block_scale_bytes_against_every_e4m3fn_value():
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    masks = dict(block_scale_problems(codes))
    assert list(masks) == ["nonfinite_scale", "negative_scale"]
    np.testing.assert_array_equal(masks["nonfinite_scale"], np.isnan(values))  # 0x7F and 0xFF only
    np.testing.assert_array_equal(masks["negative_scale"], values < 0)  # 0x80 is -0: zero, not negative
    assert masks["nonfinite_scale"].shape == codes.shape


def test_lossless_range_is_eighteen_exponents_on_ints_arrays_and_tensors():
    assert lossless_range(-9, 8) and lossless_range(100, 117) and not lossless_range(100, 118)
    lo = np.array([0, 3, 3, 200], dtype=np.int64)
    hi = np.array([17, 21, 20, 254], dtype=np.int64)
    assert lossless_range(lo, hi).tolist() == [True, False, True, False]
    assert lossless_range(torch.from_numpy(lo), torch.from_numpy(hi)).tolist() == [True, False, True, False]
