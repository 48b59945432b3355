"""Moving FP4/FP8 bytes between torch, numpy/ml_dtypes and ONNX ``TensorProto``.

Byte layouts agree everywhere, so conversions share or copy bytes and never re-round:

- E4M3FN / E8M0 scale codes (uint8) <-> ``ml_dtypes.float8_e4m3fn`` / ``float8_e8m0fnu`` arrays: a view.
- Packed E2M1 codes <-> ``ml_dtypes.float4_e2m1fn`` arrays: ml_dtypes holds one FP4 per byte, so this is
  an unpack / pack (the only copy).
- ONNX FLOAT4E2M1 raw data is the packed bytes (low nibble first), FLOAT8E4M3FN / FLOAT8E8M0 raw data the
  codes, so a ``TensorProto`` is written from and read into the same bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from fp4pass.errors import FormatError
from fp4pass.formats.packing import pack_nibbles, unpack_nibbles

__all__ = [
    "ONNX_FP4",
    "ONNX_E4M3",
    "ONNX_E8M0",
    "fp4_to_numpy",
    "fp4_from_numpy",
    "codes_to_numpy",
    "codes_from_numpy",
    "to_tensor_proto",
    "from_tensor_proto",
]

ONNX_FP4 = TensorProto.FLOAT4E2M1
ONNX_E4M3 = TensorProto.FLOAT8E4M3FN
ONNX_E8M0 = TensorProto.FLOAT8E8M0

_ML_DTYPES = {ONNX_E4M3: ml_dtypes.float8_e4m3fn, ONNX_E8M0: ml_dtypes.float8_e8m0fnu}


def fp4_to_numpy(codes: torch.Tensor, count: int | None = None) -> np.ndarray:
    """Packed E2M1 codes [..., B] -> ``ml_dtypes.float4_e2m1fn`` array [..., count or 2B]."""
    return unpack_nibbles(codes.cpu(), count).numpy().view(ml_dtypes.float4_e2m1fn)


def fp4_from_numpy(array: np.ndarray) -> torch.Tensor:
    """``ml_dtypes.float4_e2m1fn`` array [..., K] -> packed E2M1 codes uint8 [..., ceil(K/2)]."""
    if array.dtype != ml_dtypes.float4_e2m1fn:
        raise FormatError(f"expected a float4_e2m1fn array, got {array.dtype}")
    return pack_nibbles(torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)))


def codes_to_numpy(codes: torch.Tensor, onnx_type: int) -> np.ndarray:
    """E4M3FN or E8M0 codes (uint8 torch) -> the ml_dtypes array viewing the same bytes."""
    return codes.cpu().numpy().view(_ML_DTYPES[onnx_type])


def codes_from_numpy(array: np.ndarray) -> torch.Tensor:
    """An ml_dtypes float8_e4m3fn / float8_e8m0fnu array -> uint8 torch codes sharing its bytes."""
    if array.dtype not in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu):
        raise FormatError(f"expected a float8_e4m3fn or float8_e8m0fnu array, got {array.dtype}")
    return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8))


def to_tensor_proto(codes: torch.Tensor, onnx_type: int, name: str, shape=None) -> TensorProto:
    """uint8 codes -> an ONNX initializer of ``onnx_type`` (FLOAT4E2M1: ``codes`` packed, ``shape`` logical)."""
    codes = codes.cpu().contiguous()
    if shape is None:
        shape = (*codes.shape[:-1], codes.shape[-1] * 2) if onnx_type == ONNX_FP4 else tuple(codes.shape)
    return onnx.helper.make_tensor(name, onnx_type, list(shape), codes.numpy().tobytes(), raw=True)


def from_tensor_proto(proto: TensorProto, base_dir: str = "") -> torch.Tensor:
    """An ONNX FLOAT4E2M1 / FLOAT8E4M3FN / FLOAT8E8M0 / UINT8 initializer -> uint8 codes (FP4 packed)."""
    array = numpy_helper.to_array(proto, base_dir)
    if proto.data_type == ONNX_FP4:
        return fp4_from_numpy(array)
    if proto.data_type in _ML_DTYPES or proto.data_type == TensorProto.UINT8:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).copy())
    raise FormatError(f"{proto.name}: expected an FP4/FP8/uint8 initializer, got {TensorProto.DataType.Name(proto.data_type)}")
