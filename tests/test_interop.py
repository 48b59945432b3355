"""Bytes move between torch, ml_dtypes and ONNX TensorProto without re-rounding (checked via onnx.numpy_helper)."""

import ml_dtypes
import numpy as np
import torch
from onnx import numpy_helper

from fp4pass import MXFP4Tensor, NVFP4Tensor
from fp4pass.formats import interop


def test_scale_codes_view_the_same_bytes():
    nv = NVFP4Tensor.quantize(torch.randn(4, 64))
    view = interop.codes_to_numpy(nv.scales, interop.ONNX_E4M3)
    assert view.dtype == ml_dtypes.float8_e4m3fn
    assert np.shares_memory(view, nv.scales.numpy())
    np.testing.assert_array_equal(view.astype(np.float32), nv.block_scales().numpy())
    assert torch.equal(interop.codes_from_numpy(view), nv.scales)


def test_tensor_proto_round_trip_and_onnx_reading():
    mx = MXFP4Tensor.quantize(torch.randn(3, 64))
    codes_proto = interop.to_tensor_proto(mx.codes, interop.ONNX_FP4, "w")
    scales_proto = interop.to_tensor_proto(mx.scales, interop.ONNX_E8M0, "s")
    assert list(codes_proto.dims) == [3, 64]
    # onnx's own reader decodes our FP4 bytes to the values our decoder gives
    onnx_values = numpy_helper.to_array(codes_proto).astype(np.float32)
    from fp4pass.formats import decode_e2m1, unpack_nibbles

    np.testing.assert_array_equal(onnx_values, decode_e2m1(unpack_nibbles(mx.codes)).numpy())
    assert torch.equal(interop.from_tensor_proto(codes_proto), mx.codes)
    assert torch.equal(interop.from_tensor_proto(scales_proto), mx.scales)


def test_fp4_numpy_round_trip_odd_length():
    codes = torch.tensor([[0x21, 0x0F]], dtype=torch.uint8)
    array = interop.fp4_to_numpy(codes, 3)
    assert array.dtype == ml_dtypes.float4_e2m1fn and array.shape == (1, 3)
    assert array.astype(np.float32).tolist() == [[0.5, 1.0, -6.0]]
    assert torch.equal(interop.fp4_from_numpy(array), codes)
