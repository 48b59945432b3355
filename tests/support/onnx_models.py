"""Small test models for the lowering and diff tests, built with onnx.helper (IR 11-12, onnxruntime loads them).

Independent of the code under test: the expected numbers come from numpy + ml_dtypes (tests/support/oracles.py) or
from onnx.reference.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def random_fp4(rng: np.random.Generator, shape, block: int, scale_dtype, e8m0_range=(100, 141)):
    """Random E2M1 element codes [..., K] and scale codes [..., K/block] (E8M0 in ``e8m0_range``, E4M3 finite)."""
    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    scale_shape = (*shape[:-1], shape[-1] // block)
    if scale_dtype == "e8m0":
        scales = rng.integers(*e8m0_range, size=scale_shape, dtype=np.uint8)
    else:
        scales = rng.integers(0x08, 0x7E, size=scale_shape, dtype=np.uint8)  # E4M3: 2^-6 .. 448, no NaN
    return codes, scales


def pack(codes: np.ndarray) -> np.ndarray:
    """Two E2M1 codes per byte, low nibble first (docs/formats.md)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e2m1(codes: np.ndarray) -> np.ndarray:
    return E2M1_TABLE[codes]


def mx_matmul_model(codes, scales, batch: int = 3) -> onnx.ModelProto:
    """x [batch, K] @ DQ(W [N, K] FP4, E8M0)^T -> y [batch, N]: MXFP4 feeding a MatMul through a Transpose."""
    n, k = codes.shape
    w = numpy_helper.from_array(codes.view(ml_dtypes.float4_e2m1fn), "w")
    s = numpy_helper.from_array(scales.view(ml_dtypes.float8_e8m0fnu), "s")
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s"], ["w_f"], axis=-1, block_size=32, output_dtype=TensorProto.FLOAT),
        helper.make_node("Transpose", ["w_f"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w_t"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mx_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])], initializer=[w, s])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12)


def float_matmul_model(weight: np.ndarray, name_suffix: str = "") -> onnx.ModelProto:
    """The same graph as :func:`mx_matmul_model` with a plain FP32 weight (same tensor names h, y)."""
    n, k = weight.shape
    nodes = [
        helper.make_node("Transpose", ["w_f"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w_t"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "float_matmul" + name_suffix, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        initializer=[numpy_helper.from_array(weight.astype(np.float32), "w_f")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=11)


def trt_act_model(k: int, global_scale: float, form: str = "dq", lead=(2, 3)) -> onnx.ModelProto:
    """x [*lead, K] -> TRT_FP4DynamicQuantize(x, g) -> DQ(s, g) -> DQ(x_fp4, s_f, block 16) -> y.

    ``form="alpha"``: the scales' DQ uses 1.0 and a Mul by g follows (the alpha form's shape of the graph).
    """
    g = numpy_helper.from_array(np.array(global_scale, np.float32), "g")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [
        helper.make_node("TRT_FP4DynamicQuantize", ["x", "g"], ["x_fp4", "x_s"], domain="trt",
                         axis=-1, block_size=16, scale_type=17),
        helper.make_node("DequantizeLinear", ["x_s", "g" if form == "dq" else "one"], ["x_sf"]),
        helper.make_node("DequantizeLinear", ["x_fp4", "x_sf"], ["x_hat" if form == "alpha" else "y"],
                         axis=-1, block_size=16),
    ]
    if form == "alpha":
        nodes.append(helper.make_node("Mul", ["x_hat", "g"], ["y"]))
    graph = helper.make_graph(
        nodes, "trt_act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, k])], initializer=[g, one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)],
                             ir_version=11)


def qmoe_model(rng: np.random.Generator, quant_type: str, experts=4, hidden=64, inter=32, tokens=6, k=2):
    """QMoE with interleaved SwiGLU (gpt-oss style); returns (model, float weights fc1 [E,2I,H], fc2 [E,H,I], attrs)."""
    block, dtype = (32, "e8m0") if quant_type == "fp4" else (16, "e4m3")
    c1, s1 = random_fp4(rng, (experts, 2 * inter, hidden), block, dtype)
    c2, s2 = random_fp4(rng, (experts, hidden, inter), block, dtype)
    g1 = (rng.uniform(0.5, 2.0, experts) if quant_type == "nvfp4" else np.ones(experts)).astype(np.float32)
    g2 = (rng.uniform(0.01, 0.1, experts) if quant_type == "nvfp4" else np.ones(experts)).astype(np.float32)
    b1 = rng.standard_normal((experts, 2 * inter)).astype(np.float32)
    b2 = rng.standard_normal((experts, hidden)).astype(np.float32)
    scale_np = ml_dtypes.float8_e8m0fnu if dtype == "e8m0" else ml_dtypes.float8_e4m3fn

    def weight(codes, scales, g):
        s = scales.view(scale_np).astype(np.float32) * g[:, None, None]
        return e2m1(codes) * np.repeat(s, block, axis=-1)

    inits = [
        numpy_helper.from_array(pack(c1), "fc1_w"), numpy_helper.from_array(s1.view(scale_np), "fc1_s"),
        numpy_helper.from_array(b1, "fc1_b"),
        numpy_helper.from_array(pack(c2), "fc2_w"), numpy_helper.from_array(s2.view(scale_np), "fc2_s"),
        numpy_helper.from_array(b2, "fc2_b"),
        numpy_helper.from_array(g1, "fc1_g"), numpy_helper.from_array(g2, "fc2_g"),
    ]
    attrs = dict(k=k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1,
                 activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    node = helper.make_node(
        "QMoE",
        ["x", "router", "fc1_w", "fc1_s", "fc1_b", "fc2_w", "fc2_s", "fc2_b", "", "", "", "", "", "", "",
         "fc1_g", "fc2_g"],
        ["y"], domain="com.microsoft", quant_type=quant_type, expert_weight_bits=4, block_size=block, **attrs)
    graph = helper.make_graph(
        [node], "qmoe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden]),
         helper.make_tensor_value_info("router", TensorProto.FLOAT, [tokens, experts])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, hidden])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=12)
    return model, weight(c1, s1, g1), b1, weight(c2, s2, g2), b2, attrs


def moe_np(x, router, w1, b1, w2, b2, k, alpha=1.702, beta=1.0, limit=7.0):
    """Float MoE in float64 numpy: softmax router, top-k, renormalized weights, interleaved SwiGLU (ORT's doc)."""
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        p = np.exp(router[t] - router[t].max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        for e, weight in zip(top, p[top] / p[top].sum()):
            h = w1[e].astype(np.float64) @ x[t] + b1[e]
            gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            act = gate / (1 + np.exp(-alpha * gate)) * (up + beta)
            out[t] += weight * (w2[e].astype(np.float64) @ act + b2[e])
    return out


def save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)
