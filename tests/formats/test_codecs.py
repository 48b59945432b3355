"""Codecs against ml_dtypes: exhaustive decode of every code, property-based encode (RNE, ties, saturation)."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fp4pass.errors import FormatError, NonFiniteError
from fp4pass.formats import codecs

F32 = dict(width=32, allow_nan=False, allow_subnormal=True)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as values, NaN where the other is NaN, and the same sign of zero."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    equal = (a == b) & (np.signbit(a) == np.signbit(b))
    return bool(np.all(both_nan | equal))


def test_e2m1_decode_all_16_codes(device):
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ours = codecs.decode_e2m1(torch.from_numpy(codes).to(device)).cpu().numpy()
    assert _same_bits(ours, expected)


def test_e4m3_decode_all_256_codes(device):
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ours = codecs.decode_e4m3(torch.from_numpy(codes).to(device)).cpu().numpy()
    assert _same_bits(ours, expected)
    assert np.isnan(ours[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(ours, [0x7F, 0xFF])).all()


def test_e8m0_decode_all_finite_codes(device):
    codes = np.arange(255, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = codecs.decode_e8m0(torch.from_numpy(codes).to(device)).cpu().numpy()
    assert _same_bits(ours, expected)
    assert ours[127] == 1.0 and ours[0] == np.float32(2.0**-127)


def test_e8m0_code_255_is_rejected_with_its_position():
    codes = torch.full((2, 3), 127, dtype=torch.uint8)
    codes[1, 2] = 255
    with pytest.raises(FormatError, match=r"layer0\.scales: E8M0 code 255 \(NaN\) at index \(1, 2\)"):
        codecs.decode_e8m0(codes, what="layer0.scales")


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(allow_infinity=True, **F32)))
def test_e2m1_encode_matches_ml_dtypes(x):
    expected = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    ours = codecs.encode_e2m1(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ours, expected)


def test_e2m1_ties_go_to_even_and_large_values_saturate():
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30], np.float32)
    expected = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0], np.float32)
    for sign in (1, -1):
        got = codecs.round_e2m1(torch.from_numpy(sign * midpoints)).numpy()
        assert _same_bits(got, sign * expected)
        assert _same_bits(got, (sign * midpoints).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e2m1_nan_is_rejected_with_its_position():
    x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])
    with pytest.raises(NonFiniteError, match=r"w: NaN at index \(1, 0\)"):
        codecs.encode_e2m1(x, what="w")


@settings(max_examples=300, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(-448, 448, **F32)))
def test_e4m3_encode_in_range_matches_ml_dtypes(x):
    expected = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codecs.encode_e4m3(torch.from_numpy(x)).numpy(), expected)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(allow_infinity=True, **F32)))
def test_e4m3_encode_saturates_where_ml_dtypes_would_give_nan(x):
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    ours = codecs.encode_e4m3(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ours, expected)
    assert not np.isnan(ours.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).any()


def test_e4m3_ties_and_subnormals():
    # 2^-10 is the midpoint between 0 and the smallest subnormal 2^-9: ties to even -> 0.
    # 3*2^-10 is between 2^-9 (k=1) and 2^-8 (k=2): ties to even -> 2^-8.  464 = between 448 and "480": saturates.
    x = torch.tensor([2.0**-10, 3 * 2.0**-10, 17.0, 464.0, -1e9])
    assert codecs.round_e4m3(x).tolist() == [0.0, 2.0**-8, 16.0, 448.0, -448.0]


def test_e4m3_nan_is_rejected():
    with pytest.raises(NonFiniteError, match="scales: NaN at index"):
        codecs.encode_e4m3(torch.tensor([1.0, float("nan")]), what="scales")


@given(st.integers(-127, 127))
def test_pow2_and_e8m0_encode_are_exact(k):
    value = codecs.pow2(torch.tensor([k])).item()
    assert value == np.ldexp(1.0, k)
    assert codecs.encode_e8m0(torch.tensor([k])).item() == k + 127


def test_e8m0_encode_saturates_to_finite_codes():
    assert codecs.encode_e8m0(torch.tensor([-500, 500])).tolist() == [0, 254]
