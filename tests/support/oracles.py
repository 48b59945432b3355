"""Independent oracles for the tests: numpy + ml_dtypes formulas and onnx.reference, sharing no fp4pass code."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator


def mx_quantize_np(x: np.ndarray, rule: str = "floor", block: int = 32):
    """MXFP4 per the OCP rules (docs/formats.md) in float64 math: returns (element codes uint8 [..., K], E8M0 codes [..., K/block])."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        f = np.floor(np.log2(amax))
        if rule == "floor":
            k = f - 2
        elif rule == "ceil":
            k = np.ceil(np.log2(amax)) - 2
        elif rule == "rceil":
            k = np.ceil(np.log2(amax / 6.0))
        elif rule == "even":
            m = np.where(amax > 0, amax / np.exp2(np.where(amax > 0, f, 0)), 1.0)
            k = f + np.floor(np.log2(np.floor(m * 2 + 0.5) / 2)) - 2
        else:
            raise ValueError(rule)
    k = np.where(amax > 0, k, -127).clip(-127, 127).astype(np.int64)
    scaled = xb.astype(np.float64) / np.exp2(k)[..., None]
    codes = scaled.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(x.shape), (k + 127).astype(np.uint8)


def nv_quantize_np(x: np.ndarray, global_scale=None):
    """NVFP4 per ModelOpt's formulas in float32 numpy + ml_dtypes: (codes [..., K], e4m3 codes, global_scale)."""
    x = x.astype(np.float32)
    if global_scale is None:
        amax = np.float32(np.abs(x).max())
        global_scale = np.float32(amax / np.float32(6 * 448)) if amax > 0 else np.float32(1.0)
        global_scale = max(global_scale, np.float32(2.0**-140))  # fp4pass floors the global scale at 2^-140
    g = np.asarray(global_scale, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 16)
    g_b = g.reshape(g.shape + (1,) * (xb.ndim - 1 - g.ndim))
    bamax = np.abs(xb).max(-1)
    block_scale = np.clip(bamax / (np.float32(6) * g_b), np.float32(2.0**-9), np.float32(448))
    s8 = block_scale.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    s = s8.astype(np.float32)
    q = (xb / (s * g_b)[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return q.reshape(x.shape), s8.view(np.uint8), g


def run_reference(model: onnx.ModelProto, feeds=None):
    return ReferenceEvaluator(model).run(None, feeds or {})


def mx_dq_model(codes: np.ndarray, scales: np.ndarray, block: int = 32) -> onnx.ModelProto:
    """One DequantizeLinear-24 FP4/E8M0 (axis=-1) whose output is the graph output."""
    w = numpy_helper.from_array(codes.view(ml_dtypes.float4_e2m1fn), "w")
    s = numpy_helper.from_array(scales.view(ml_dtypes.float8_e8m0fnu), "s")
    node = helper.make_node("DequantizeLinear", ["w", "s"], ["y"], axis=-1, block_size=block, output_dtype=TensorProto.FLOAT)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(codes.shape))
    graph = helper.make_graph([node], "mx", [], [out], initializer=[w, s])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12)


def nv_dq_model(codes: np.ndarray, scales: np.ndarray, global_scale) -> onnx.ModelProto:
    """ModelOpt's NVFP4 form: DQ(s E4M3, g) -> DQ(w FP4, s_f, axis=-1, block_size=16), opset 23."""
    w = numpy_helper.from_array(codes.view(ml_dtypes.float4_e2m1fn), "w")
    s = numpy_helper.from_array(scales.view(ml_dtypes.float8_e4m3fn), "s")
    g = numpy_helper.from_array(np.asarray(global_scale, np.float32), "g")
    axis_attrs = {"axis": 0} if np.ndim(global_scale) else {}
    dq_s = helper.make_node("DequantizeLinear", ["s", "g"], ["s_f"], **axis_attrs)
    dq_w = helper.make_node("DequantizeLinear", ["w", "s_f"], ["y"], axis=-1, block_size=16)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(codes.shape))
    graph = helper.make_graph([dq_s, dq_w], "nv", [], [out], initializer=[w, s, g])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def qmoe_kernel_codes(packed: np.ndarray) -> np.ndarray:
    """onnxruntime's CUDA QMoE layout uint8 [E, K, N/2] -> E2M1 codes [E, N, K].

    Byte [e, k, j] holds element (n=2j, k) in its low nibble and (n=2j+1, k) in its high nibble, the map the
    onnxruntime-genai builder writes (loaders/gptoss.py pack_blocks_for_qmoe) and the kernel reads.
    """
    e, k, half_n = packed.shape
    codes = np.zeros((e, 2 * half_n, k), np.uint8)
    for j in range(half_n):
        codes[:, 2 * j, :] = packed[:, :, j] % 16
        codes[:, 2 * j + 1, :] = packed[:, :, j] // 16
    return codes


def qmoe_nvfp4_kernel_dequant(packed: np.ndarray, e4m3_codes: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
    """W[e, n, k] = e2m1 * e4m3(scale[e, n, k // 16]) * global[e] (float64) from the kernel layout."""
    values = E2M1_VALUES[qmoe_kernel_codes(packed)]
    scales = np.asarray(e4m3_codes).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.repeat(scales, 16, axis=-1) * np.asarray(global_scale, np.float64)[:, None, None]
