"""FP4 with arbitrary float block scales -> NVFP4 (fp4pass.convert.scaled), against ml_dtypes/numpy oracles."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4pass.convert.scaled import scaled_fp4_to_nvfp4
from oracles import nv_quantize_np


def _decode(codes_packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Independent decode: ml_dtypes E2M1 values times the block's scale, one float32 multiply (as
    DequantizeLinear with float32 scales defines it), returned as float64."""
    codes = np.stack([codes_packed & 0xF, codes_packed >> 4], -1).reshape(*codes_packed.shape[:-1], -1)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    block = values.shape[-1] // scales.shape[-1]
    x = values.reshape(*scales.shape, block) * scales.astype(np.float32)[..., None]
    return x.reshape(values.shape).astype(np.float64)


def _nv_decode(nv) -> np.ndarray:
    codes = nv.codes.numpy()
    values = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1).view(ml_dtypes.float4_e2m1fn)
    scales = nv.scales.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = nv.global_scale.numpy().astype(np.float32)
    g = g.reshape(g.shape + (1,) * (scales.ndim - g.ndim))
    full = (scales * g).astype(np.float32)
    return (values.astype(np.float32).reshape(*scales.shape, 16) * full[..., None]).reshape(values.shape)


def _random(seed: int, shape, negative: bool = False):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
    scales = (2.0 ** rng.integers(-10, 4, (*shape[:-1], shape[-1] // 32)) * rng.uniform(1, 2, (*shape[:-1], shape[-1] // 32)))
    if negative:
        scales *= rng.choice([-1, 1], scales.shape)
    return codes, scales.astype(np.float32)


def _requant_sse(x: np.ndarray) -> float:
    codes, e4m3, g = nv_quantize_np(x.astype(np.float32))
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(*e4m3.shape, 16)
    deq = (values * (e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g)[..., None]).reshape(x.shape)
    return float(np.square(deq.astype(np.float64) - x).sum())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_auto_never_worse_than_requant(seed, negative):
    codes, scales = _random(seed, (16, 64), negative)
    x = _decode(codes, scales)
    nv, stats = scaled_fp4_to_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), "auto")
    sse = float(np.square(_nv_decode(nv).astype(np.float64) - x).sum())
    assert sse <= _requant_sse(x)
    assert stats.mse == pytest.approx(sse / x.size, rel=1e-9, abs=0)


def test_requant_is_the_oracles_requant():
    codes, scales = _random(1, (8, 64))
    x = _decode(codes, scales)
    nv, stats = scaled_fp4_to_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), "requant")
    ref_codes, ref_e4m3, ref_g = nv_quantize_np(x.astype(np.float32))
    packed = ref_codes[..., 0::2] | (ref_codes[..., 1::2] << 4)
    np.testing.assert_array_equal(nv.codes.numpy(), packed)
    np.testing.assert_array_equal(nv.scales.numpy(), ref_e4m3)
    assert float(nv.global_scale) == float(ref_g)
    assert stats.method_used == "requant"


def test_e4m3_representable_scales_convert_exactly():
    """Scales that are E4M3 values times one common factor: verbatim and auto keep every code, exactly."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    e4m3 = rng.integers(0x20, 0x7E, (4, 2), dtype=np.uint8)
    e4m3[0, 0] = 0x7E  # the largest scale is E4M3's max, so G = s_max/448 is the common factor
    scales = (e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(2.0**-7)).astype(np.float32)
    assert not np.all(np.frexp(scales)[0] == 0.5)  # not MXFP4: E4M3 mantissas
    x = _decode(codes, scales)
    for method in ("verbatim", "auto"):
        nv, stats = scaled_fp4_to_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), method)
        np.testing.assert_array_equal(_nv_decode(nv), x)
        assert stats.mse == 0 and stats.blocks16_verbatim == stats.blocks16_total == 16


def test_negative_and_zero_scales():
    codes, scales = _random(3, (4, 64), negative=True)
    scales[1, 0] = 0
    x = _decode(codes, scales)
    nv, _ = scaled_fp4_to_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), "auto")
    out = _nv_decode(nv)
    assert np.all(out[1, :32] == 0)
    assert np.all(np.sign(out[np.abs(out) > 0]) == np.sign(x[np.abs(out) > 0]))


def test_experts_get_their_own_global_scale():
    codes, scales = _random(4, (3, 8, 64))
    scales[1] *= 2.0**20  # an expert far above the others
    nv, stats = scaled_fp4_to_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), "auto")
    assert tuple(nv.global_scale.shape) == (3,)
    assert len(stats.global_scale) == 3 and stats.global_scale[1] > 2.0**15 * stats.global_scale[0]
    x = _decode(codes, scales)
    for e in range(3):
        sse = float(np.square(_nv_decode(nv)[e].astype(np.float64) - x[e]).sum())
        assert sse <= _requant_sse(x[e])
