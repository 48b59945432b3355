"""fp4pass.checkpoint.engine: which units skip reading their codes, per-expert conversion of a stack, and the
E4M3 block scales of a lossless window that reaches E4M3's subnormals (oracle: ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4pass.checkpoint.engine import convert_experts, takes_lossless_path
from fp4pass.convert import mxfp4_to_nvfp4
from fp4pass.formats import MXFP4Tensor


def _mx(e8m0: np.ndarray, seed: int = 0) -> MXFP4Tensor:
    rng = np.random.default_rng(seed)
    rows, blocks = e8m0.shape
    codes = torch.from_numpy(rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8))
    return MXFP4Tensor(codes, torch.from_numpy(e8m0.astype(np.uint8)), 32)


@pytest.mark.parametrize("low,high", [(110, 126), (100, 117), (100, 118), (2, 12), (30, 40)])
def test_lossless_path_prediction_matches_the_engine(low, high):
    rng = np.random.default_rng(1)
    e8m0 = rng.integers(low, high + 1, (64, 4))
    e8m0[0, 0], e8m0[1, 1] = low, high
    mx = _mx(e8m0)
    nv, stats = mxfp4_to_nvfp4(mx, "auto", group_dims=0)
    shared = nv.codes.data_ptr() == mx.codes.data_ptr()
    predicted = takes_lossless_path(mx.scales, "auto")
    assert predicted == (high - low <= 17 and high - 135 >= -126)
    if predicted:
        assert shared and stats.blocks16_requantized == 0
    assert not takes_lossless_path(mx.scales, "hybrid")


def test_subnormal_window_block_scales_against_ml_dtypes():
    """Spread 17: the lowest blocks take E4M3 subnormal scales 2^-9 .. 2^-7 (the table path of the engine)."""
    rng = np.random.default_rng(2)
    e8m0 = rng.integers(103, 121, (96, 6))
    e8m0[0, 0], e8m0[0, 1] = 103, 120
    mx = _mx(e8m0)
    nv, stats = mxfp4_to_nvfp4(mx, "auto", group_dims=0)
    m = 120 - 127 - 8
    assert float(nv.global_scale) == 2.0**m and stats.blocks16_requantized == 0
    expected = np.exp2(e8m0 - 127 - m).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).repeat(2, axis=-1)
    np.testing.assert_array_equal(nv.scales.numpy(), expected)
    assert (expected < 8).any()  # some block scales are subnormal


def test_convert_experts_equals_one_call_with_per_expert_groups():
    rng = np.random.default_rng(3)
    e, n, k = 4, 32, 128
    e8m0 = rng.integers(115, 125, (e, n, k // 32)) + np.arange(e)[:, None, None] * 3
    e8m0[2, 0, 0] = 90  # expert 2 spreads over 17 octaves: lossy
    codes = torch.from_numpy(rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8))
    codes[2, 0, :16] = 0x77
    mx = MXFP4Tensor(codes, torch.from_numpy(e8m0.astype(np.uint8)), 32)
    nv, parts = convert_experts(mx)
    ref, stats = mxfp4_to_nvfp4(mx, "auto")  # per-expert groups of a 3-D tensor
    assert torch.equal(nv.codes, ref.codes) and torch.equal(nv.scales, ref.scales)
    assert torch.equal(nv.global_scale, ref.global_scale)
    assert [p["lossless"] for p in parts] == [True, True, False, True]
    assert sum(p["blocks16_requantized"] for p in parts) == stats.blocks16_requantized
