"""The torch custom ops that stand for FP4 dequantization in a traced graph.

A dequant written as lookup + ldexp dissolves under torch.export's decompositions (and the ONNX exporter
folds it into one FP32 weight), so fp4pass gives each format one opaque op, made with
``torch.library.custom_op`` and a fake (meta) implementation so that it survives torch.export as a single
node — the thing the fx pass matches and writes:

- ``torch.ops.fp4pass.dequantize_mxfp4(codes_u8 [..., K/2], scales_e8m0_u8 [..., K/32]) -> float32 [..., K]``
  = e2m1(code) * 2^(scale-127)
- ``torch.ops.fp4pass.dequantize_nvfp4(codes_u8 [..., K/2], scales_e4m3_u8 [..., K/16], global_scale) ->
  float32 [..., K]`` = e2m1(code) * (e4m3(scale) * global_scale), global_scale of shape [] or leading dims.

Both compute with :mod:`fp4pass.fx.dequant` (byte-table lookups into one preallocated float32 output, bit-exact
with :mod:`fp4pass.formats`, the one definition of each format): peak extra memory is the output plus a
chunk, whatever the weight's size.
"""

from __future__ import annotations

import torch

from fp4pass.fx import dequant

__all__ = ["dequantize_mxfp4", "dequantize_nvfp4"]


def _dequantized_shape(codes: torch.Tensor) -> list[int]:
    return [*codes.shape[:-1], codes.shape[-1] * 2]


@torch.library.custom_op("fp4pass::dequantize_mxfp4", mutates_args=())
def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (E2M1 codes, E8M0 scale per 32) -> float32."""
    return dequant.dequantize_mxfp4(codes, scales)


@dequantize_mxfp4.register_fake
def _(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.new_empty(_dequantized_shape(codes), dtype=torch.float32)


@torch.library.custom_op("fp4pass::dequantize_nvfp4", mutates_args=())
def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 (E2M1 codes, E4M3 scale per 16, FP32 global scale) -> float32."""
    return dequant.dequantize_nvfp4(codes, scales, global_scale)


@dequantize_nvfp4.register_fake
def _(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return codes.new_empty(_dequantized_shape(codes), dtype=torch.float32)
