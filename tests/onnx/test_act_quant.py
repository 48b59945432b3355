"""Activation quantizer insertion: TensorRT form checked structurally, reference form run as W4A4."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from calib_builders import nv_fake_quant_np, nvfp4_linear
from fp4pass.calib import ActivationScale, ActivationScales, input_scale_from_g_amax
from fp4pass.errors import UsageError
from fp4pass.onnx.act_quant import insert_activation_quantizers


def scales_for(name="a", g_amax=3.5) -> ActivationScales:
    return ActivationScales("max", {name: ActivationScale(g_amax, g_amax, input_scale_from_g_amax(g_amax),
                                                          0.0, g_amax, 1)})


def model_with_quantizers(target, scale_form="dq", alphas=None, g_amax=3.5):
    proto, weights = nvfp4_linear()
    model = ir.serde.deserialize_model(proto)
    report = insert_activation_quantizers(model, scales_for(g_amax=g_amax), target=target,
                                          scale_form=scale_form, alphas=alphas)
    return model, weights, report


def test_trt_form_follows_tensorrt_importer_rules():
    model, _, report = model_with_quantizers("trt")
    assert report[0]["inserted"] and sorted(report[0]["consumers"]) == ["mm1", "mm2"]
    proto = ir.serde.serialize_model(model)
    quantizers = [n for n in proto.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert len(quantizers) == 1  # once per activation, though two consumers read it
    q = quantizers[0]
    assert q.domain == "trt" and {o.domain: o.version for o in proto.opset_import}["trt"] == 1
    attrs = {a.name: helper.get_attribute_value(a) for a in q.attribute}
    assert attrs == {"axis": -1, "block_size": 16, "scale_type": TensorProto.FLOAT8E4M3FN} and attrs["scale_type"] == 17
    inits = {i.name: i for i in proto.graph.initializer}
    g = inits[q.input[1]]  # a scalar FP32 initializer = input_scale
    assert g.data_type == TensorProto.FLOAT and list(g.dims) == []
    assert onnx.numpy_helper.to_array(g) == np.float32(3.5) / np.float32(2688)
    assert q.input[0] == "a"
    by_input = {i: n for n in proto.graph.node for i in n.input}
    dq_scale = by_input[q.output[1]]
    assert dq_scale.op_type == "DequantizeLinear" and list(dq_scale.input) == [q.output[1], q.input[1]]
    dq_x = by_input[q.output[0]]
    dq_attrs = {a.name: helper.get_attribute_value(a) for a in dq_x.attribute}
    assert dq_x.op_type == "DequantizeLinear" and list(dq_x.input) == [q.output[0], dq_scale.output[0]]
    assert dq_attrs == {"axis": -1, "block_size": 16}
    matmuls = {n.name: n for n in proto.graph.node if n.op_type == "MatMul"}
    assert matmuls["mm1"].input[0] == matmuls["mm2"].input[0] == dq_x.output[0]
    assert [n for n in proto.graph.node if n.name == "residual"][0].input[:] == ["a", "a"]  # float reader kept
    names = {n.name for n in nvfp4_linear()[0].graph.node}
    assert names <= {n.name for n in proto.graph.node}
    assert proto.ir_version >= 11 and {o.domain: o.version for o in proto.opset_import}[""] >= 23


def run_reference(model: ir.Model, x: np.ndarray, outputs=None):
    return ReferenceEvaluator(ir.serde.serialize_model(model)).run(outputs, {"x": x})


def test_w4a4_reference_form_equals_numpy_emulation():
    model, weights, _ = model_with_quantizers("reference", g_amax=3.5)
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32) * 1.5
    a_hat = nv_fake_quant_np(np.maximum(x, 0), np.float32(3.5) / np.float32(2688))  # clips above 3.5
    z, y1, y2 = run_reference(model, x)
    np.testing.assert_array_equal(z, 2 * np.maximum(x, 0))
    np.testing.assert_allclose(y1, a_hat @ weights["w1"].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2, a_hat @ weights["w2"].T, rtol=1e-5, atol=1e-5)
    fq = run_reference(model, x, ["a_nvfp4/fake_quant"])[0]
    np.testing.assert_array_equal(fq, a_hat)  # bit-exact fake-quant

    from fp4pass.onnx.lower import lower_for_ort
    from fp4pass.onnx.runtime import make_session

    session, _, _ = make_session(lower_for_ort(model), "cpu")
    ort_z, ort_y1, ort_y2 = session.run(None, {"x": x})
    np.testing.assert_allclose(ort_y1, a_hat @ weights["w1"].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ort_y2, a_hat @ weights["w2"].T, rtol=1e-5, atol=1e-5)
    lowered = lower_for_ort(model)
    lowered.graph.outputs.append(next(v for n in lowered.graph for v in n.outputs if v.name == "a_nvfp4/fake_quant"))
    np.testing.assert_array_equal(make_session(lowered, "cpu")[0].run(["a_nvfp4/fake_quant"], {"x": x})[0], a_hat)


def test_trt_form_lowered_equals_reference_form():
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    trt, _, _ = model_with_quantizers("trt")
    ref, _, _ = model_with_quantizers("reference")
    from fp4pass.onnx.lower import lower_for_ort
    from fp4pass.onnx.runtime import make_session

    out_trt = make_session(lower_for_ort(trt), "cpu")[0].run(None, {"x": x})
    out_ref = run_reference(ref, x)
    for a, b in zip(out_trt, out_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # matmul summation order only


def test_alpha_form_moves_input_scale_into_alpha():
    proto, weights = nvfp4_linear()
    model = ir.serde.deserialize_model(proto)
    alphas = {"mm1": "w1_global_scale", "mm2": "w2_global_scale"}  # scalar FP32 initializers, as stand-ins
    before = {k: float(model.graph.initializers[v].const_value.numpy()) for k, v in alphas.items()}
    report = insert_activation_quantizers(model, scales_for(), target="reference", scale_form="alpha", alphas=alphas)
    s = np.float32(3.5) / np.float32(2688)
    for k, v in alphas.items():
        assert float(model.graph.initializers[v].const_value.numpy()) == float(np.float32(before[k]) * s)
    assert sorted(report[0]["alphas"]) == sorted(alphas.values())
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    fq = run_reference(model, x, ["a_nvfp4/fake_quant"])[0]
    np.testing.assert_allclose(fq * s, nv_fake_quant_np(np.maximum(x, 0), s), rtol=1e-6)  # E2M1 x E4M3 only

    trt = ir.serde.deserialize_model(proto)
    insert_activation_quantizers(trt, scales_for(), target="trt", scale_form="alpha", alphas=alphas)
    q = next(n for n in trt.graph if n.op_type == "TRT_FP4DynamicQuantize")
    dq_scale = q.outputs[1].consumers()[0]
    assert float(dq_scale.inputs[1].const_value.numpy()) == 1.0
    assert float(q.inputs[1].const_value.numpy()) == s


def test_declines_and_usage_errors():
    proto, _ = nvfp4_linear()
    model = ir.serde.deserialize_model(proto)
    report = insert_activation_quantizers(model, scales_for("z"), target="trt")
    assert not report[0]["inserted"] and "no FP4 consumer" in report[0]["reason"]
    assert not any(n.op_type == "TRT_FP4DynamicQuantize" for n in model.graph)
    with pytest.raises(UsageError):
        insert_activation_quantizers(model, scales_for(), target="ort")
    with pytest.raises(UsageError):
        insert_activation_quantizers(model, scales_for(), scale_form="alpha")


def test_alpha_form_falls_back_to_dq_when_a_consumer_has_no_alpha():
    proto, _ = nvfp4_linear()
    model = ir.serde.deserialize_model(proto)
    before = float(model.graph.initializers["w1_global_scale"].const_value.numpy())
    report = insert_activation_quantizers(model, scales_for(), target="reference", scale_form="alpha",
                                          alphas={"mm1": "w1_global_scale"})
    assert report[0]["scale_form"] == "dq" and "alpha" in report[0]["reason"]
    assert float(model.graph.initializers["w1_global_scale"].const_value.numpy()) == before


def test_an_activation_without_a_scale_is_reported_left_in_full_precision(caplog):
    """SCALES with one of moe.onnx's two quantizable activations: the other is named in the report, not
    inserted, with the reason, and a warning says so (it used to vanish from the report)."""
    import logging
    from pathlib import Path

    import onnx_ir as ir

    from fp4pass.pipeline import convert

    moe = Path(__file__).resolve().parents[2] / "models" / "moe.onnx"
    with caplog.at_level(logging.WARNING, logger="fp4pass.onnx.act_quant"):
        scale = {"amax": 2.688, "g_amax": 2.688, "input_scale": 0.001, "b_min": 0.1, "b_max": 2.688, "blocks": 64}
        model, report = convert(str(moe), scales={"calibrator": "max", "tensors": {"x_e": scale}})
    entries = {e["activation"]: e for e in report["activations"]}
    assert entries["x_e"]["inserted"] is True
    assert entries["h_act"]["inserted"] is False and entries["h_act"]["consumers"] == ["fc2"]
    assert "no scale" in entries["h_act"]["reason"] and "h_act" in caplog.text
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    fc2 = next(n for n in proto.graph.node if n.name == "fc2")
    assert "h_act" in fc2.input  # still reads the activation itself
