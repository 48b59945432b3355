"""Example models holding MXFP4 weights as pattern 1 (DequantizeLinear-24, FLOAT4E2M1 + FLOAT8E8M0, block 32).

- ``tiny_mlp.onnx``: x [B, 64] -> DQ(W1 [128, 64]) -Transpose-> MatMul -> Relu -> Gemm(DQ(W2 [64, 128]), bias,
  transB=1) -> y [B, 64].
- ``moe.onnx``: a dense-routed MoE block with E=4 experts. x [T, 64]; probs = Softmax(x @ W_router);
  h_e = Relu(x @ W1[e]^T), o_e = h_e @ W2[e]^T (W1 [4, 128, 64], W2 [4, 64, 128] through Transpose [0, 2, 1]);
  y = sum_e probs[:, e] * o_e. The experts sit 2^6 apart in magnitude (x1, x2^-6, x2^6, x2^12), so one global
  scale for the whole tensor cannot hold them all in E4M3's 18 exact powers of two, but one per expert can;
  expert 3 of W2 also mixes rows 2^-20 apart (exponent spread > 17), so that expert converts lossily.

Weights are drawn from ``numpy.random.default_rng(seed)`` and quantized with the OCP FLOOR rule, so the same
seed gives byte-identical files: ``python -m fp4pass.examples.moe models`` rebuilds the committed
``models/tiny_mlp.onnx``, ``models/moe.onnx`` and ``models/calib.npz`` byte for byte.

This module uses numpy, ml_dtypes and onnx only, never fp4pass's own code, so that the tests can use it as an
independent source of MXFP4 models (its MXFP4 quantizer is written from the OCP rule, not from fp4pass).
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["mxfp4_quantize", "mxfp4_dq", "build_tiny_mlp", "build_moe", "build_calibration_data", "main"]

OPSET = 24
IR_VERSION = 12  # lowest IR holding FLOAT8E8M0; onnxruntime 1.31 loads IR <= 13


def mxfp4_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MXFP4 (FLOOR rule): float [..., K] -> (float4_e2m1fn [..., K], float8_e8m0fnu [..., K/32])."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(amax)
    k = np.where(amax > 0, e.astype(np.int64) - 1 - 2, -127).clip(-127, 127)
    codes = (blocks / np.exp2(k)[..., None].astype(np.float32)).astype(ml_dtypes.float4_e2m1fn)
    scales = np.exp2(k.astype(np.float32)).astype(ml_dtypes.float8_e8m0fnu)
    return codes.reshape(x.shape), scales


def mxfp4_dq(name: str, x: np.ndarray, output: str | None = None):
    """(DequantizeLinear node, [codes, scales] initializers) for the MXFP4 form of float ``x``."""
    codes, scales = mxfp4_quantize(x)
    node = helper.make_node("DequantizeLinear", [name, f"{name}_scale"], [output or f"{name}_dq"],
                            name=f"{name}_dq", axis=-1, block_size=32, output_dtype=TensorProto.FLOAT)
    return node, [numpy_helper.from_array(codes, name), numpy_helper.from_array(scales, f"{name}_scale")]


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="fp4pass.models")
    onnx.checker.check_model(model, full_check=True)
    return model


def build_tiny_mlp(seed: int = 0, hidden: int = 64, inner: int = 128) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    dq1, init1 = mxfp4_dq("fc1.weight", rng.standard_normal((inner, hidden)) * 0.05)
    dq2, init2 = mxfp4_dq("fc2.weight", rng.standard_normal((hidden, inner)) * 0.05)
    bias = numpy_helper.from_array((rng.standard_normal(hidden) * 0.01).astype(np.float32), "fc2.bias")
    nodes = [
        dq1,
        helper.make_node("Transpose", ["fc1.weight_dq"], ["fc1.weight_t"], name="fc1_t", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "fc1.weight_t"], ["fc1_out"], name="fc1"),
        helper.make_node("Relu", ["fc1_out"], ["act"], name="act"),
        dq2,
        helper.make_node("Gemm", ["act", "fc2.weight_dq", "fc2.bias"], ["y"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        initializer=[*init1, *init2, bias],
    )
    return _model(graph)


EXPERT_EXPONENTS = (0, -6, 6, 12)


def build_moe(seed: int = 0, hidden: int = 64, inner: int = 128) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    experts = len(EXPERT_EXPONENTS)
    magnitude = np.exp2(np.array(EXPERT_EXPONENTS, np.float64))[:, None, None]
    w1 = rng.standard_normal((experts, inner, hidden)) * 0.05 * magnitude
    w2 = rng.standard_normal((experts, hidden, inner)) * 0.05 * magnitude
    w2[3, hidden // 2:] *= 2.0**-20  # expert 3: exponent spread > 17 -> lossy with any single global scale
    router = (rng.standard_normal((hidden, experts)) * 0.1).astype(np.float32)
    dq1, init1 = mxfp4_dq("experts.w1", w1)
    dq2, init2 = mxfp4_dq("experts.w2", w2)
    nodes = [
        helper.make_node("MatMul", ["x", "router.weight"], ["router_logits"], name="router"),
        helper.make_node("Softmax", ["router_logits"], ["probs"], name="router_softmax", axis=-1),
        helper.make_node("Transpose", ["probs"], ["probs_t"], name="probs_t", perm=[1, 0]),
        helper.make_node("Unsqueeze", ["probs_t", "axis_last"], ["gate"], name="gate"),
        helper.make_node("Unsqueeze", ["x", "axis_first"], ["x_e"], name="x_e"),
        dq1,
        helper.make_node("Transpose", ["experts.w1_dq"], ["experts.w1_t"], name="w1_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x_e", "experts.w1_t"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["h_act"], name="act"),
        dq2,
        helper.make_node("Transpose", ["experts.w2_dq"], ["experts.w2_t"], name="w2_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h_act", "experts.w2_t"], ["o"], name="fc2"),
        helper.make_node("Mul", ["o", "gate"], ["o_gated"], name="gate_mul"),
        helper.make_node("ReduceSum", ["o_gated", "axis_first"], ["y"], name="combine", keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(router, "router.weight"),
        numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
        numpy_helper.from_array(np.array([0], np.int64), "axis_first"),
        *init1, *init2,
    ]
    graph = helper.make_graph(
        nodes, "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", hidden])],
        initializer=inits,
    )
    return _model(graph)


BUILDERS = {"tiny_mlp.onnx": build_tiny_mlp, "moe.onnx": build_moe}


def build_calibration_data(seed: int = 1, batches: int = 8, tokens: int = 32, hidden: int = 64) -> dict[str, np.ndarray]:
    """Calibration inputs for both examples: ``x`` [batches * tokens, hidden], standard normal.

    ``fp4pass calibrate --batch-size 32`` streams it as ``batches`` batches of ``tokens`` rows.
    """
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batches * tokens, hidden)).astype(np.float32)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "models")
    out.mkdir(parents=True, exist_ok=True)
    for name, build in BUILDERS.items():
        onnx.save(build(), out / name)
        print(out / name)
    np.savez(out / "calib.npz", **build_calibration_data())
    print(out / "calib.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
