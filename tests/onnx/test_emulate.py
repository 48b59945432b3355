"""The standard-op NVFP4 fake-quant is bit-exact with the numpy/ml_dtypes oracle, under onnxruntime and onnx.reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from fp4pass import NVFP4Tensor
from fp4pass.onnx.emulate import nvfp4_fake_quant
from oracles import nv_quantize_np


def _model(shape, global_scale: float, dequant: str = "same") -> ir.Model:
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(shape))
    tape = ir.tape.Tape()
    g = tape.initializer(ir.tensor(np.array(global_scale, np.float32), name="g"))
    kwargs = {}
    if dequant == "none":
        kwargs["dequant_scale"] = None
    elif dequant == "other":
        kwargs["dequant_scale"] = tape.initializer(ir.tensor(np.array(0.75, np.float32), name="g2"))
    y = nvfp4_fake_quant(tape, x, g, name="act", **kwargs)
    graph = ir.Graph([x], [y], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def _expected(x, global_scale, dequant_scale):
    codes, s8, _ = nv_quantize_np(x, np.float32(global_scale))
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(*s8.shape, 16)
    scale = s8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dequant_scale is not None:
        scale = scale * np.float32(dequant_scale)
    return (values * scale[..., None]).reshape(x.shape)


def _hard_input(rng, shape):
    """Wide dynamic range: saturating, subnormal-scale and all-zero blocks, exact ties, negatives near zero."""
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 12, size=shape))).astype(np.float32)
    flat = x.reshape(-1, 16)
    flat[0] = 0.0
    flat[1] = np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, -5, -3.5, -1e-9, 0, 1, -6, 4], np.float32)
    flat[2] *= 1e-6
    return x


def _run_both(model: ir.Model, x):
    proto = ir.serde.serialize_model(model)
    y_ort = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    y_ref = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    return y_ort, y_ref


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 32), (48,)])
@pytest.mark.parametrize("dequant", ["same", "none", "other"])
def test_bit_exact_under_ort_and_reference(shape, dequant):
    rng = np.random.default_rng(len(shape) * 7 + len(dequant))
    x = _hard_input(rng, shape)
    global_scale = float(np.float32(np.abs(x).max() / (6 * 448)))
    expected = _expected(x, global_scale, {"same": global_scale, "none": None, "other": 0.75}[dequant])
    y_ort, y_ref = _run_both(_model(shape, global_scale, dequant), x)
    np.testing.assert_array_equal(_bits(y_ort), _bits(expected))
    np.testing.assert_array_equal(_bits(y_ref), _bits(expected))


@pytest.mark.parametrize("global_scale", [1.0, 1e-3, 3.7e-7])  # scales pushed to E4M3 saturation / subnormals
def test_matches_nvfp4tensor_with_a_given_global_scale(global_scale):
    rng = np.random.default_rng(5)
    x = _hard_input(rng, (8, 64))
    y_ort, _ = _run_both(_model((8, 64), global_scale), x)
    ours = NVFP4Tensor.quantize(torch.from_numpy(x), global_scale=global_scale).dequantize().numpy()
    np.testing.assert_array_equal(_bits(y_ort), _bits(ours))
    np.testing.assert_array_equal(_bits(y_ort), _bits(_expected(x, global_scale, global_scale)))


def test_zero_blocks_stay_zero_and_output_differs_from_input():
    x = np.zeros((2, 32), np.float32)
    x[1] = np.linspace(-1, 1, 32, dtype=np.float32)
    y, _ = _run_both(_model((2, 32), 1.0 / (6 * 448)), x)
    assert not y[0].any()
    assert not np.array_equal(y[1], x[1])  # it really quantized
