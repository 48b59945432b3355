"""Nibble packing against ONNX's own FLOAT4E2M1 packing (low nibble first, odd counts padded)."""

import ml_dtypes
import numpy as np
import onnx
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fp4pass.formats import pack_nibbles, unpack_nibbles


@given(arrays(np.uint8, st.integers(1, 33), elements=st.integers(0, 15)))
def test_pack_matches_onnx_float4_raw_data(codes):
    tensor = onnx.numpy_helper.from_array(codes.view(ml_dtypes.float4_e2m1fn), "w")
    assert pack_nibbles(torch.from_numpy(codes)).numpy().tobytes() == tensor.raw_data


@given(arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 9)), elements=st.integers(0, 15)))
def test_unpack_inverts_pack(codes):
    packed = pack_nibbles(torch.from_numpy(codes))
    assert packed.shape[-1] == (codes.shape[-1] + 1) // 2
    np.testing.assert_array_equal(unpack_nibbles(packed, codes.shape[-1]).numpy(), codes)


def test_low_nibble_holds_the_even_element():
    assert pack_nibbles(torch.tensor([0x1, 0xF, 0x7], dtype=torch.uint8)).tolist() == [0xF1, 0x07]
