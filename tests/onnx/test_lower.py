"""lower_for_ort: every FP4 pattern, run by onnxruntime after lowering, equals onnx.reference / numpy exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp4pass.onnx.lower import lower, lower_for_ort
from onnx_models import moe_np, qmoe_model, random_fp4, trt_act_model
from oracles import mx_dq_model, nv_dq_model, nv_quantize_np, run_reference


def _ort(model: ir.Model, feeds=None, outputs=None):
    proto = ir.serde.serialize_model(model)
    assert proto.ir_version <= 13
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds or {})


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("shape", [(8, 64), (3, 4, 96)])
def test_mxfp4_dq_lowered_is_exact(shape):
    codes, scales = random_fp4(np.random.default_rng(0), shape, 32, "e8m0")
    scales.flat[0] = 0  # 2^-127: a subnormal-range float scale
    proto = mx_dq_model(codes, scales)
    expected = run_reference(proto)[0]
    model = ir.serde.deserialize_model(proto)
    lowered, report = lower(model)
    assert report.lowered == {"FP4 DequantizeLinear -> GatherBlockQuantized": 1}
    assert [n.op_type for n in lowered.graph] == ["GatherBlockQuantized"]
    np.testing.assert_array_equal(_ort(lowered)[0], expected)
    with pytest.raises(onnxruntime_error()):  # and the original really does not run
        _ort(model)


def onnxruntime_error():
    return (ort.capi.onnxruntime_pybind11_state.NotImplemented, ort.capi.onnxruntime_pybind11_state.Fail,
            ort.capi.onnxruntime_pybind11_state.InvalidGraph)


@pytest.mark.parametrize("shape,per_expert", [((8, 64), False), ((3, 4, 64), False), ((3, 4, 64), True)])
def test_nvfp4_two_dq_lowered_is_exact(shape, per_expert):
    rng = np.random.default_rng(1)
    codes, scales = random_fp4(rng, shape, 16, "e4m3")
    g = rng.uniform(1e-3, 2, shape[0]).astype(np.float32) if per_expert else np.float32(0.0123)
    proto = nv_dq_model(codes, scales, g)
    expected = run_reference(proto)[0]
    lowered = lower_for_ort(ir.serde.deserialize_model(proto))
    np.testing.assert_array_equal(_bits(_ort(lowered)[0]), _bits(expected))


def test_lowering_leaves_the_input_model_alone():
    codes, scales = random_fp4(np.random.default_rng(2), (4, 32), 32, "e8m0")
    model = ir.serde.deserialize_model(mx_dq_model(codes, scales))
    before = [n.op_type for n in model.graph]
    lowered = lower_for_ort(model)
    assert [n.op_type for n in model.graph] == before == ["DequantizeLinear"]
    assert lowered is not model and "s" in model.graph.initializers


@pytest.mark.parametrize("form", ["dq", "alpha"])
def test_trt_activation_quantizer_lowered_is_exact(form):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, 64)) * np.exp2(rng.integers(-12, 8, (2, 3, 64)))).astype(np.float32)
    x[0, 0, :16] = 0
    g = np.float32(np.abs(x).max() / (6 * 448))
    lowered, report = lower(ir.serde.deserialize_model(trt_act_model(64, g, form)))
    assert report.lowered == {"TRT_FP4DynamicQuantize -> standard-op emulation": 1}
    assert not any(n.domain == "trt" for n in lowered.graph) and "trt" not in lowered.opset_imports
    codes, s8, _ = nv_quantize_np(x, g)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(2, 3, 4, 16)
    block = s8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if form == "dq":
        expected = (values * (block * g)[..., None]).reshape(x.shape)
    else:
        expected = (values * block[..., None]).reshape(x.shape) * g
    np.testing.assert_array_equal(_bits(_ort(lowered, {"x": x})[0]), _bits(expected))
    reference = run_reference(ir.serde.serialize_model(lowered), {"x": x})[0]
    np.testing.assert_array_equal(_bits(reference), _bits(expected))


@pytest.mark.parametrize("quant_type", ["fp4", "nvfp4"])
def test_qmoe_fp4_lowered_to_float_moe(quant_type):
    rng = np.random.default_rng(4)
    proto, w1, b1, w2, b2, attrs = qmoe_model(rng, quant_type)
    lowered, report = lower(ir.serde.deserialize_model(proto))
    assert report.lowered == {"QMoE FP4 -> MoE": 1}
    assert sorted(n.op_type for n in lowered.graph) == ["GatherBlockQuantized", "GatherBlockQuantized", "MoE"]
    x = rng.standard_normal((6, 64)).astype(np.float32)
    router = rng.standard_normal((6, 4)).astype(np.float32)
    # the dequantized weights are exact ...
    gathers = [n.outputs[0] for n in lowered.graph if n.op_type == "GatherBlockQuantized"]
    lowered.graph.outputs.extend(gathers)
    y, fc1, fc2 = _ort(lowered, {"x": x, "router": router})
    np.testing.assert_array_equal(fc1, w1)
    np.testing.assert_array_equal(fc2, w2)
    # ... and the MoE equals an independent float64 computation up to float32 summation order
    with np.errstate(over="ignore"):
        expected = moe_np(x, router, w1, b1, w2, b2, attrs["k"])
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_fp4_graph_input_is_declined_with_a_reason():
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT4E2M1, [4, 32])
    s = numpy_helper.from_array(np.full((4, 1), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu), "s")
    node = helper.make_node("DequantizeLinear", ["w", "s"], ["y"], axis=-1, block_size=32, output_dtype=TensorProto.FLOAT)
    graph = helper.make_graph([node], "g", [w], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                              initializer=[s])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12))
    lowered, report = lower(model)
    assert not report.lowered and "not an initializer" in report.declined[0]
    assert [n.op_type for n in lowered.graph] == ["DequantizeLinear"]


def test_ir_version_capped_for_onnxruntime():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert model.ir_version > 13  # onnx's helper default
    lowered = lower_for_ort(model)
    assert lowered.ir_version == 13
    np.testing.assert_array_equal(_ort(lowered, {"x": np.array([-1, 2], np.float32)})[0], [0, 2])
