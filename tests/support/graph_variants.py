"""MXFP4 test graphs in FLOAT16 / BFLOAT16, with shared weights and tied scales (onnx.helper, numpy, ml_dtypes).

Nothing here imports fp4pass. ``TRTFP4DynamicQuantize`` is an onnx.reference kernel for TensorRT's activation
quantizer written from ModelOpt's formulas (tests/support/oracles.py), to run the ``trt`` form where onnxruntime cannot
(BFLOAT16 has no onnxruntime CPU kernels for MatMul, Mul, Relu).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

import onnx_builders as B
from oracles import nv_quantize_np

NP_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}


def dq(weight: str, out: str, dtype: int, scale: str | None = None, name: str | None = None) -> onnx.NodeProto:
    return helper.make_node("DequantizeLinear", [weight, scale or f"{weight}_scale"], [out],
                            name=f"{out}_node" if name is None else name, axis=-1, block_size=32, output_dtype=dtype)


def linear(x: str, weight_dq: str, out: str, tag: str) -> list[onnx.NodeProto]:
    """out = x @ weight_dq^T."""
    return [helper.make_node("Transpose", [weight_dq], [f"{weight_dq}_t"], name=f"{tag}_t", perm=[1, 0]),
            helper.make_node("MatMul", [x, f"{weight_dq}_t"], [out], name=tag)]


def mlp(dtype: int, k: int = 64, hidden: int = 32, n: int = 16, weight_scale: float = 2.0) -> onnx.ModelProto:
    """x [b, k] -> h = Relu(x @ W1^T) -> y = h @ W2^T, all in ``dtype``; activations x and h.

    The weights are large (std ``weight_scale``) so that FLOAT16 holds the alpha form's unscaled outputs
    (true output / global scale) for unit-scale inputs.
    """
    nodes = [dq("W1", "W1_dq", dtype), *linear("x", "W1_dq", "h_pre", "mm1"),
             helper.make_node("Relu", ["h_pre"], ["h"], name="relu"),
             dq("W2", "W2_dq", dtype), *linear("h", "W2_dq", "y", "mm2")]
    inits = (B.mx_inits("W1", B.weight((hidden, k), 1, weight_scale))
             + B.mx_inits("W2", B.weight((n, hidden), 2, weight_scale)))
    return B.make(nodes, [B.vi("x", ["b", k], dtype)], [B.vi("y", ["b", n], dtype)], inits)


def shared_weight(dtype: int = TensorProto.FLOAT, k: int = 64, n: int = 48) -> onnx.ModelProto:
    """One weight W, two DequantizeLinear nodes on it (onnxruntime QDQ style), each feeding its own MatMul.

    ya = xa @ DQ_a(W)^T, yb = xb @ DQ_b(W)^T; the second DQ node has no name.
    """
    nodes = [dq("W", "W_dq_a", dtype, name="W_dq_a"), *linear("xa", "W_dq_a", "ya", "mm_a"),
             dq("W", "W_dq_b", dtype, name=""), *linear("xb", "W_dq_b", "yb", "mm_b")]
    return B.make(nodes, [B.vi("xa", ["b", k], dtype), B.vi("xb", ["b", k], dtype)],
                  [B.vi("ya", ["b", n], dtype), B.vi("yb", ["b", n], dtype)], B.mx_inits("W", B.weight((n, k), 3)))


def tied_scale(second_is_input: bool = False, k: int = 64, n: int = 48) -> onnx.ModelProto:
    """Two weights W1, W2 with one E8M0 scale initializer S (same block exponents, other codes).

    ``second_is_input``: W2 is a graph input (FLOAT4E2M1), so its DQ stays and S must stay for it.
    """
    w1 = B.weight((n, k), 4)
    codes1, scales = B.mxfp4_quantize(w1)
    rng = np.random.default_rng(5)
    codes2 = rng.choice(np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -6], np.float32), size=(n, k))
    codes2 = codes2.astype(ml_dtypes.float4_e2m1fn)
    inits = [numpy_helper.from_array(codes1, "W1"), numpy_helper.from_array(scales, "S")]
    inputs = [B.vi("x", ["b", k])]
    if second_is_input:
        inputs.append(B.vi("W2", [n, k], TensorProto.FLOAT4E2M1))
    else:
        inits.append(numpy_helper.from_array(codes2, "W2"))
    nodes = [dq("W1", "W1_dq", TensorProto.FLOAT, scale="S"), *linear("x", "W1_dq", "y1", "mm1"),
             dq("W2", "W2_dq", TensorProto.FLOAT, scale="S"), *linear("x", "W2_dq", "y2", "mm2")]
    model = B.make(nodes, inputs, [B.vi("y1", ["b", n]), B.vi("y2", ["b", n])], inits)
    return model, codes2


def random_input(shape, dtype: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return x.astype(NP_TYPES[dtype])


def fake_quant_np(x: np.ndarray, global_scale: float, dequant_global: bool = True) -> np.ndarray:
    """NVFP4 quantize -> dequantize of FLOAT(x) in float32 numpy (ModelOpt's formulas), cast back to x's type.

    ``dequant_global=False``: the alpha form's dequantize, e2m1 * e4m3 without the global scale.
    """
    codes, s8, g = nv_quantize_np(x.astype(np.float32), np.float32(global_scale))
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(*s8.shape, 16)
    s = s8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dequant_global:
        s = s * g
    return (values * s[..., None]).reshape(x.shape).astype(x.dtype)


class TRT_FP4DynamicQuantize(OpRun):  # noqa: N801 - the class name is the op type
    """trt::TRT_FP4DynamicQuantize(x, g) -> (E2M1 codes, E4M3 block scales) along the last axis, block 16."""

    op_domain = "trt"

    def _run(self, x, g, axis=-1, block_size=16, scale_type=17):
        codes, s8, _ = nv_quantize_np(np.asarray(x, np.float32), np.float32(g))
        return codes.view(ml_dtypes.float4_e2m1fn), s8.view(ml_dtypes.float8_e4m3fn)


def run_reference(model: onnx.ModelProto, feeds: dict, outputs=None) -> list[np.ndarray]:
    return ReferenceEvaluator(model, new_ops=[TRT_FP4DynamicQuantize]).run(outputs, feeds)
