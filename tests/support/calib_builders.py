"""Small models and activations for the calibration tests, built with onnx.helper and numpy only."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from oracles import nv_quantize_np

E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def nv_dequantize_np(codes: np.ndarray, scales_u8: np.ndarray, global_scale) -> np.ndarray:
    """Element codes [..., K] + E4M3 codes [..., K/16] -> float32, e2m1 * (e4m3 * g) in float32."""
    values = E2M1_LUT[codes & 0x0F].reshape(*scales_u8.shape, 16)
    s = scales_u8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = np.asarray(global_scale, np.float32)
    return (values * (s * g)[..., None]).reshape(codes.shape)


def nv_fake_quant_np(x: np.ndarray, global_scale) -> np.ndarray:
    codes, scales, g = nv_quantize_np(x, global_scale=np.float32(global_scale))
    return nv_dequantize_np(codes, scales, g)


def float_mlp(k: int = 64, hidden: int = 32, out: int = 16, seed: int = 0) -> onnx.ModelProto:
    """x [B, k] -> MatMul W1 -> Relu -> MatMul W2 -> y; activations named x and h."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((k, hidden)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((hidden, out)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h_pre"], name="mm1"),
             helper.make_node("Relu", ["h_pre"], ["h"], name="relu"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", out])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def nvfp4_linear(k: int = 64, n: int = 32, seed: int = 0, two_consumers: bool = True):
    """x [B, k] -> Relu -> a; y1 = a @ dq(W1).T and (optionally) y2 = a @ dq(W2).T, NVFP4 weights in
    ModelOpt's two-DQ form (opset 23). Also Add(a, a) -> z so that a float reader of ``a`` exists.

    Returns (model, {"w1": float32 dequantized [n, k], "w2": ...}).
    """
    rng = np.random.default_rng(seed)
    inits, nodes, dequantized = [], [helper.make_node("Relu", ["x"], ["a"], name="relu")], {}
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", k])]
    nodes.append(helper.make_node("Add", ["a", "a"], ["z"], name="residual"))
    for i in (1, 2) if two_consumers else (1,):
        w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
        codes, scales, g = nv_quantize_np(w)
        dequantized[f"w{i}"] = nv_dequantize_np(codes, scales, g)
        packed = codes.view(ml_dtypes.float4_e2m1fn)
        inits += [numpy_helper.from_array(packed, f"w{i}_fp4"),
                  numpy_helper.from_array(scales.view(ml_dtypes.float8_e4m3fn), f"w{i}_scale"),
                  numpy_helper.from_array(np.asarray(g, np.float32), f"w{i}_global_scale")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{i}_scale", f"w{i}_global_scale"], [f"w{i}_scale_f"],
                                   name=f"w{i}_dq_scale"),
                  helper.make_node("DequantizeLinear", [f"w{i}_fp4", f"w{i}_scale_f"], [f"w{i}_f"], axis=-1,
                                   block_size=16, name=f"w{i}_dq"),
                  helper.make_node("Transpose", [f"w{i}_f"], [f"w{i}_t"], perm=[1, 0], name=f"w{i}_transpose"),
                  helper.make_node("MatMul", ["a", f"w{i}_t"], [f"y{i}"], name=f"mm{i}")]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", n]))
    graph = helper.make_graph(nodes, "w4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", k])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11), dequantized


# -- synthetic activations ---------------------------------------------------------------------------------


def llm_like(rng: np.random.Generator, tokens: int, k: int = 256, outlier_channels: int = 4) -> np.ndarray:
    """Gaussian tokens with a few outlier channels (x30), like LLM MLP inputs."""
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[:, :outlier_channels] *= 30
    return x


def rare_spike(rng: np.random.Generator, n: int, rate: float = 1e-7, spike: float = 1e6) -> np.ndarray:
    """Standard normal with a spike of ``spike`` in a fraction ``rate`` of samples (at least one)."""
    x = rng.standard_normal(n).astype(np.float32)
    count = max(1, int(round(rate * n)))
    x[rng.choice(n, count, replace=False)] = spike
    return x.reshape(-1, 256)


def log_normal(rng: np.random.Generator, n: int, sigma: float = 3.0) -> np.ndarray:
    """Random signs times exp(sigma * N(0, 1))."""
    x = np.exp(sigma * rng.standard_normal(n)) * rng.choice([-1.0, 1.0], n)
    return x.astype(np.float32).reshape(-1, 256)
