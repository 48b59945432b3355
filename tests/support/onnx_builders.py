"""Small hand-built ONNX models for the ONNX pass tests, and numpy/ml_dtypes oracles of FP4 dequantization.

Nothing here imports fp4pass: the models are written with onnx.helper, MXFP4 quantized with the OCP FLOOR rule
in numpy (``fp4pass.examples.moe.mxfp4_quantize``, which imports nothing of fp4pass), and the oracles decode initializers with ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fp4pass.examples.moe import mxfp4_quantize

OPSET = [helper.make_opsetid("", 24)]
MS_OPSET = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]


def weight(shape, seed=0, scale=0.05, expert_exponents=None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * scale
    if expert_exponents is not None:
        w = w * np.exp2(np.asarray(expert_exponents, np.float64)).reshape(-1, *([1] * (len(shape) - 1)))
    return w


def mx_inits(name: str, w: np.ndarray, block: int = 32):
    codes, scales = mxfp4_quantize(w) if block == 32 else _mx_block(w, block)
    return [numpy_helper.from_array(codes, name), numpy_helper.from_array(scales, f"{name}_scale")]


def _mx_block(w, block):
    blocks = w.astype(np.float32).reshape(*w.shape[:-1], -1, block)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(amax)
    k = np.where(amax > 0, e - 3, -127)
    codes = (blocks / np.exp2(k)[..., None]).astype(ml_dtypes.float4_e2m1fn).reshape(w.shape)
    return codes, np.exp2(k.astype(np.float32)).astype(ml_dtypes.float8_e8m0fnu)


def dq_node(name: str, block: int = 32, axis: int = -1, out: str | None = None, scale: str | None = None):
    return helper.make_node("DequantizeLinear", [name, scale or f"{name}_scale"], [out or f"{name}_dq"],
                            name=f"{name}_dq", axis=axis, block_size=block, output_dtype=TensorProto.FLOAT)


def make(nodes, inputs, outputs, inits, opsets=OPSET, ir_version=12) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)


def vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def linear_model(n=48, k=64, seed=0, expert_exponents=None, shared=False) -> onnx.ModelProto:
    """y = x @ DQ(W [n, k])^T; with ``shared`` the same DQ also feeds z = x @ Cast(DQ(W))^T."""
    w = weight((n, k), seed)
    nodes = [dq_node("W"),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "W_t"], ["y"], name="mm")]
    outputs = [vi("y", ["b", n])]
    if shared:
        nodes += [helper.make_node("Cast", ["W_dq"], ["W_c"], name="c", to=TensorProto.FLOAT),
                  helper.make_node("Transpose", ["W_c"], ["W_ct"], name="t2", perm=[1, 0]),
                  helper.make_node("MatMul", ["x", "W_ct"], ["z"], name="mm2")]
        outputs.append(vi("z", ["b", n]))
    return make(nodes, [vi("x", ["b", k])], outputs, mx_inits("W", w))


def expert_model(e=3, n=32, k=64, exponents=(0, -7, 9), spread_expert=None) -> onnx.ModelProto:
    """y = x_e @ Transpose(DQ(W [e, n, k]), [0, 2, 1]) for x_e [e, t, k]."""
    w = weight((e, n, k), 1, expert_exponents=exponents)
    if spread_expert is not None:
        w[spread_expert, : n // 2] *= 2.0**-22
    nodes = [dq_node("W"),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "W_t"], ["y"], name="mm")]
    return make(nodes, [vi("x", [e, "t", k])], [vi("y", [e, "t", n])], mx_inits("W", w))


def qmoe_model(e=2, hidden=64, inner=32, global_scale=None, fc2_global_scale=None) -> onnx.ModelProto:
    """com.microsoft::QMoE quant_type='fp4' with uint8 [E, N, K/2] weights and E8M0 scales; ``global_scale``
    is fc1's fc*_global_scale and fc2's too unless ``fc2_global_scale`` gives fc2 its own."""
    inits = []
    for name, shape in (("fc1", (e, 2 * inner, hidden)), ("fc2", (e, hidden, inner))):
        codes, scales = mxfp4_quantize(weight(shape, 2 if name == "fc1" else 3))
        packed = _pack(codes)
        inits += [numpy_helper.from_array(packed, f"{name}.weight"), numpy_helper.from_array(scales, f"{name}.scales")]
        given = fc2_global_scale if name == "fc2" and fc2_global_scale is not None else global_scale
        g = np.ones(e, np.float32) if given is None else np.asarray(given, np.float32)
        inits.append(numpy_helper.from_array(g, f"{name}.global_scale"))
    ins = ["x", "router", "fc1.weight", "fc1.scales", "", "fc2.weight", "fc2.scales", "", "", "", "",
           "", "", "", "", "fc1.global_scale", "fc2.global_scale"]
    node = helper.make_node("QMoE", ins, ["y"], name="moe", domain="com.microsoft", quant_type="fp4", k=1,
                            block_size=32, activation_type="swiglu", swiglu_fusion=1, expert_weight_bits=4)
    return make([node], [vi("x", ["t", hidden]), vi("router", ["t", e])], [vi("y", ["t", hidden])], inits,
                opsets=MS_OPSET)


def gbq_model(n=40, k=64) -> onnx.ModelProto:
    codes, scales = mxfp4_quantize(weight((n, k), 4))
    inits = [numpy_helper.from_array(codes, "emb"),
             numpy_helper.from_array(scales.astype(np.float32), "emb_scale")]
    node = helper.make_node("GatherBlockQuantized", ["emb", "ids", "emb_scale"], ["y"], name="gather",
                            domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=32)
    return make([node], [vi("ids", ["t"], TensorProto.INT64)], [vi("y", ["t", k])], inits, opsets=MS_OPSET)


def _pack(codes: np.ndarray) -> np.ndarray:
    u = codes.view(np.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray, shape) -> np.ndarray:
    lo, hi = packed & 0x0F, packed >> 4
    codes = np.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)[..., : shape[-1]]
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(shape)


def init(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def mx_dequant(model: onnx.ModelProto, name: str, scale_name: str) -> np.ndarray:
    """e2m1(W) * e8m0(S) from a model's initializers (FLOAT4E2M1/FLOAT8E8M0 ONNX types)."""
    w = numpy_helper.to_array(init(model, name)).astype(np.float32)
    s = numpy_helper.to_array(init(model, scale_name)).astype(np.float32)
    return w * np.repeat(s, 32, axis=-1)


def nv_dequant(model: onnx.ModelProto, name: str) -> np.ndarray:
    """e2m1(W) * (e4m3(S16) * G) from fp4pass's output initializers ({W}_scale_e4m3, {W}_global_scale)."""
    w = numpy_helper.to_array(init(model, name)).astype(np.float32)
    s = numpy_helper.to_array(init(model, f"{name}_scale_e4m3")).astype(np.float32)
    g = numpy_helper.to_array(init(model, f"{name}_global_scale")).astype(np.float32)
    g = g.reshape(g.shape + (1,) * (s.ndim - g.ndim))
    return w * np.repeat((s * g).astype(np.float32), 16, axis=-1)


def mx_quantize_axis0(w: np.ndarray):
    """MXFP4 blocked along axis 0: codes [N, K], scales [N/32, K] (an axis the pass declines)."""
    codes, scales = mxfp4_quantize(w.T.copy())
    return codes.T.copy(), scales.T.copy()


def if_branch_model(n=48, k=64, weight_scales=(0.05, 3.0), shared=False) -> onnx.ModelProto:
    """y = If(cond, then: x @ DQ(W_then)^T, else: x @ DQ(W_else)^T), opset 24.

    Each branch holds an MXFP4 ``DequantizeLinear`` (FLOAT4E2M1 codes, FLOAT8E8M0 scales, block 32, last axis)
    reading outer-scope initializers of the main graph, then a Transpose and a MatMul reading the outer input
    x. ``weight_scales``: the two weights' magnitudes (far apart, so a swapped branch shows). ``shared``: both
    branches dequantize the one weight W_then.
    """
    inits, branches = [], []
    for i, tag in enumerate(("then", "else")):
        w = f"W_{tag}" if not shared or tag == "then" else "W_then"
        if w not in {t.name for t in inits}:
            inits += mx_inits(w, weight((n, k), 10 + i, weight_scales[i]))
        nodes = [helper.make_node("DequantizeLinear", [w, f"{w}_scale"], [f"{tag}_dq"], name=f"{tag}_dq", axis=-1,
                                  block_size=32, output_dtype=TensorProto.FLOAT),
                 helper.make_node("Transpose", [f"{tag}_dq"], [f"{tag}_t"], name=f"{tag}_t", perm=[1, 0]),
                 helper.make_node("MatMul", ["x", f"{tag}_t"], [f"{tag}_y"], name=f"{tag}_mm")]
        branches.append(helper.make_graph(nodes, f"{tag}_branch", [], [vi(f"{tag}_y", ["b", n])]))
    node = helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branches[0], else_branch=branches[1])
    return make([node], [vi("x", ["b", k]), vi("cond", [], TensorProto.BOOL)], [vi("y", ["b", n])], inits)


FUNCTION_DOMAIN = "local.fp4"


def function_model(n=48, k=64) -> onnx.ModelProto:
    """y = local.fp4::Linear(x): a model-local function whose body stores an MXFP4 weight in two ``Constant``
    nodes (FLOAT4E2M1 codes, FLOAT8E8M0 scales) and computes x @ DQ(W)^T (DequantizeLinear-24, block 32)."""
    codes, scales = mx_inits("W", weight((n, k), 20))
    body = [helper.make_node("Constant", [], ["W"], name="W_const", value=codes),
            helper.make_node("Constant", [], ["W_scale"], name="W_scale_const", value=scales),
            helper.make_node("DequantizeLinear", ["W", "W_scale"], ["W_dq"], name="W_dq", axis=-1, block_size=32,
                             output_dtype=TensorProto.FLOAT),
            helper.make_node("Transpose", ["W_dq"], ["W_t"], name="W_t", perm=[1, 0]),
            helper.make_node("MatMul", ["x", "W_t"], ["y"], name="mm")]
    function = helper.make_function(FUNCTION_DOMAIN, "Linear", ["x"], ["y"], body, OPSET)
    graph = helper.make_graph([helper.make_node("Linear", ["x"], ["y"], name="linear", domain=FUNCTION_DOMAIN)], "g",
                              [vi("x", ["b", k])], [vi("y", ["b", n])])
    return helper.make_model(graph, functions=[function], ir_version=12,
                             opset_imports=[*OPSET, helper.make_opsetid(FUNCTION_DOMAIN, 1)])


def nvfp4_function_model(n=48, k=64) -> onnx.ModelProto:
    """y = local.fp4::Linear(x) whose body holds NVFP4 in fp4pass's two-DQ form, stored in Constant nodes:
    x @ DQ(W FLOAT4E2M1, DQ(S16 FLOAT8E4M3FN, G), block 16)^T."""
    w = weight((n, k), 21)
    blocks = w.reshape(n, k // 16, 16)
    g = np.float32(np.abs(w).max() / (6 * 448))
    s16 = (np.abs(blocks).max(-1) / 6 / g).astype(ml_dtypes.float8_e4m3fn)
    codes = (blocks / (s16.astype(np.float32) * g)[..., None]).astype(ml_dtypes.float4_e2m1fn).reshape(n, k)
    body = [helper.make_node("Constant", [], ["W"], name="W_const", value=numpy_helper.from_array(codes, "W")),
            helper.make_node("Constant", [], ["S16"], name="S16_const", value=numpy_helper.from_array(s16, "S16")),
            helper.make_node("Constant", [], ["G"], name="G_const", value=numpy_helper.from_array(g, "G")),
            helper.make_node("DequantizeLinear", ["S16", "G"], ["s"], name="s_dq"),
            helper.make_node("DequantizeLinear", ["W", "s"], ["W_dq"], name="W_dq", axis=-1, block_size=16),
            helper.make_node("Transpose", ["W_dq"], ["W_t"], name="W_t", perm=[1, 0]),
            helper.make_node("MatMul", ["x", "W_t"], ["y"], name="mm")]
    function = helper.make_function(FUNCTION_DOMAIN, "Linear", ["x"], ["y"], body, OPSET)
    graph = helper.make_graph([helper.make_node("Linear", ["x"], ["y"], name="linear", domain=FUNCTION_DOMAIN)], "g",
                              [vi("x", ["b", k])], [vi("y", ["b", n])])
    return helper.make_model(graph, functions=[function], ir_version=12,
                             opset_imports=[*OPSET, helper.make_opsetid(FUNCTION_DOMAIN, 1)])
