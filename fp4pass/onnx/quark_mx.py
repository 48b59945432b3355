"""Quark's MX rule in fp4pass terms: the float32 values its fake-quant computes, and a weight's MXFP4 codes.

The rule (see :mod:`fp4pass.onnx.rewrite_quark`) is OCP's :attr:`fp4pass.formats.ScaleRule.FLOOR` with E2M1
round-half-even, over blocks of 32 along the last axis. Pattern matching (:mod:`fp4pass.onnx.patterns`) and the
rewrite both use it, so it sits below both.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from fp4pass.formats import MX_BLOCK_SIZE, MXFP4Tensor, ScaleRule

__all__ = ["QUARK_SCALE_RULE", "quark_mxfp4", "quark_fake_quant", "quantize_weight"]

QUARK_SCALE_RULE = ScaleRule.FLOOR


def float32_constant(value: ir.Value) -> np.ndarray:
    return np.asarray(value.const_value.numpy()).astype(np.float32)


def quark_mxfp4(x: np.ndarray, block_size: int = MX_BLOCK_SIZE, *, name: str = "weight") -> MXFP4Tensor:
    """Quark's MX quantization of float32 ``x`` [..., K] along its last axis (K a multiple of the block)."""
    return MXFP4Tensor.quantize(torch.from_numpy(np.array(x, dtype=np.float32, order="C", copy=True)), block_size,
                                QUARK_SCALE_RULE, name=name)


def quark_fake_quant(x: np.ndarray, axis: int, block_size: int = MX_BLOCK_SIZE, *, name: str = "tensor") -> np.ndarray:
    """The float32 values Quark's ``MXQuantizeDequantize(x, axis, block_size)`` computes (module docstring)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
        axis = 0
    moved = np.moveaxis(x, axis, -1)
    k = moved.shape[-1]
    pad = -k % block_size
    if pad:
        moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad), np.float32)], axis=-1)
    y = quark_mxfp4(moved, block_size, name=name).dequantize().numpy()[..., :k]
    return np.moveaxis(y, -1, axis).reshape(np.shape(x))


def quantize_weight(weight: ir.Value, perm: list[int] | None) -> tuple[ir.Value, ir.Value, tuple[int, ...]]:
    """A float weight -> (FLOAT4E2M1 codes value, FLOAT8E8M0 scales value, logical shape), not in any graph.

    ``perm`` (an axis swap) moves Quark's block axis last first. The codes value takes the weight's name (the
    float initializer is removed when the weight is rewritten); the scales are ``{W}_scale_e8m0``.
    """
    x = float32_constant(weight)
    if perm is not None:
        x = x.transpose(perm)
    mx = quark_mxfp4(x, name=weight.name)
    shape = tuple(int(d) for d in x.shape)
    codes = ir.PackedTensor(mx.codes.numpy(), ir.DataType.FLOAT4E2M1, shape=ir.Shape(shape), name=weight.name)
    scales = ir.Tensor(mx.scales.numpy(), dtype=ir.DataType.FLOAT8E8M0, name=f"{weight.name}_scale_e8m0")
    codes_value = ir.Value(name=weight.name, const_value=codes, shape=ir.Shape(shape),
                           type=ir.TensorType(ir.DataType.FLOAT4E2M1))
    scales_value = ir.Value(name=scales.name, const_value=scales, shape=ir.Shape(list(mx.scales.shape)),
                            type=ir.TensorType(ir.DataType.FLOAT8E8M0))
    return codes_value, scales_value, shape
