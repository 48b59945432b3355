"""The ONNX pass on FLOAT16 and BFLOAT16 graphs: both scale forms, with and without activation quantizers.

Oracles: onnx.checker (full check: strict shape and type inference refuses any mixed-type node), onnx.reference,
the original model run the same way, numpy/ml_dtypes NVFP4 formulas (tests/support/oracles.py) and, for FLOAT16, the
onnxruntime CPU diff. onnxruntime has no CPU kernels for BFLOAT16 MatMul/Mul/Relu (and its Python binding takes
no bfloat16 array), so BFLOAT16 graphs are run with onnx.reference only.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import graph_variants as V
from fp4pass.calib import ActivationScale, ActivationScales, input_scale_from_g_amax
from fp4pass.onnx import convert
from fp4pass.onnx.numerics import diff

DTYPES = [pytest.param(TensorProto.FLOAT16, id="fp16"), pytest.param(TensorProto.BFLOAT16, id="bf16")]
FORMS = ["dq", "alpha"]


def full_check(model):
    onnx.checker.check_model(model, full_check=True)


def scales_json(g_amax_x=3.0, g_amax_h=20.0) -> dict:
    return ActivationScales("max", {
        name: ActivationScale(g, g, input_scale_from_g_amax(g), 0.0, g, 1)
        for name, g in (("x", g_amax_x), ("h", g_amax_h))}).to_json()


def initializer(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_lossless_weights_give_identical_outputs(dtype, form):
    original = V.mlp(dtype)
    out, report = convert(original, scale_form=form)
    full_check(out)
    assert all(e["target_form"] == form and e["mse"] == 0 for e in report["tensors"])
    for name in ("W1", "W2"):
        assert numpy_helper.to_array(initializer(out, f"{name}_scale_e4m3")).dtype.name == "float8_e4m3fn"
    x = V.random_input((5, 64), dtype, scale=0.05)  # small enough for the alpha form's FLOAT16 intermediates
    (y0,), (y1,) = V.run_reference(original, {"x": x}), V.run_reference(out, {"x": x})
    assert y1.dtype == y0.dtype and y0.tobytes() == y1.tobytes()
    if form == "alpha":
        alphas = [t for t in out.graph.initializer if t.name.endswith("_alpha")]
        assert len(alphas) == 2 and all(t.data_type == TensorProto.FLOAT for t in alphas)
        ops = [n.op_type for n in out.graph.node]
        assert ops.count("Cast") == 4 and ops.count("Mul") == 2  # FLOAT product between two Casts per consumer
        assert "alpha multiply in FLOAT between Casts" in report["tensors"][0]["form_note"]
    if dtype == TensorProto.FLOAT16:
        result = diff(original, out, inputs={"x": x}, provider="cpu")
        assert result.provider.lower().startswith("cpu")
        assert [m.snr_db for m in result.outputs] == [None] and result.outputs[0].max_abs_err == 0
    # BFLOAT16 (and FLOAT16) under the reference provider: fp4pass diff runs what onnxruntime CPU cannot
    result = diff(original, out, inputs={"x": x}, provider="reference")
    assert result.provider == "reference" and result.passed
    assert [m.snr_db for m in result.outputs] == [None] and result.outputs[0].max_abs_err == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_provider_sees_a_lossy_16_bit_conversion_as_the_evaluator_does(dtype):
    """diff(provider="reference") on a lossy conversion gives the SNR of the two models' onnx.reference
    outputs computed here by hand; onnxruntime CPU cannot run BFLOAT16, so provider "cpu" falls back to the
    same figures under onnx.reference, with a note."""
    from fp4pass.metrics import snr_db

    original = V.mlp(dtype)
    out, _ = convert(original, method="requant")
    x = V.random_input((5, 64), dtype, scale=0.05)
    (y0,), (y1,) = V.run_reference(original, {"x": x}), V.run_reference(out, {"x": x})
    a, b = y0.astype(np.float64), y1.astype(np.float64)
    expected = snr_db(float(np.sum(a * a)), float(np.sum((a - b) ** 2)))
    result = diff(original, out, inputs={"x": x}, provider="reference")
    assert result.outputs[0].snr_db == pytest.approx(expected, abs=1e-6) and expected < 60
    if dtype == TensorProto.BFLOAT16:
        fallback = diff(original, out, inputs={"x": x}, provider="cpu")
        assert fallback.provider == "reference" and "onnxruntime has no kernel" in fallback.notes[0]
        assert fallback.outputs[0].snr_db == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossy_alpha_and_dq_forms_round_once_to_the_graph_dtype(dtype):
    """requant: G is not a power of two, so not a 16-bit number; both forms give the FLOAT product rounded once."""
    original = V.mlp(dtype)
    dq_model, dq_report = convert(original, method="requant", scale_form="dq")
    alpha_model, _ = convert(original, method="requant", scale_form="alpha")
    full_check(dq_model)
    full_check(alpha_model)
    g = np.float32(dq_report["tensors"][0]["global_scale"][0])
    assert g.astype(V.NP_TYPES[dtype]).astype(np.float32) != g  # the case the Casts are there for
    x = V.random_input((4, 64), dtype, seed=1, scale=0.05)
    # h = Relu(x @ W1^T): the first layer alone, from each model, against numpy from the written initializers
    codes = numpy_helper.to_array(initializer(alpha_model, "W1")).astype(np.float32)
    s = numpy_helper.to_array(initializer(alpha_model, "W1_scale_e4m3")).astype(np.float32)
    w_unscaled = (codes * np.repeat(s, 16, -1)).astype(V.NP_TYPES[dtype])  # exact in 16 bits
    assert w_unscaled.astype(np.float32).tobytes() == (codes * np.repeat(s, 16, -1)).tobytes()
    (h_alpha,) = V.run_reference(alpha_model, {"x": x}, ["h"])
    h_pre = (x @ w_unscaled.T).astype(np.float32)  # the reference evaluator's MatMul, in the graph dtype
    expected = np.maximum((h_pre.astype(V.NP_TYPES[dtype]).astype(np.float32) * g), 0).astype(V.NP_TYPES[dtype])
    assert h_alpha.tobytes() == expected.tobytes()
    (y_dq,), (y_alpha,) = V.run_reference(dq_model, {"x": x}), V.run_reference(alpha_model, {"x": x})
    y_alpha, y_dq = y_alpha.astype(np.float32), y_dq.astype(np.float32)
    assert np.abs(y_alpha - y_dq).max() <= 0.02 * np.abs(y_dq).max()  # the same model up to 16-bit roundings


def test_fp16_alpha_note_gives_the_overflow_bound_that_large_outputs_hit():
    original = V.mlp(TensorProto.FLOAT16)
    out, report = convert(original, scale_form="alpha")
    entry = report["tensors"][0]
    bound = 65504.0 * entry["global_scale"][0]
    assert f"overflows past |y| = {bound:.4g}" in entry["form_note"]
    x = V.random_input((4, 64), TensorProto.FLOAT16, seed=5, scale=40.0)
    (h0,), (h1,) = V.run_reference(original, {"x": x}, ["h"]), V.run_reference(out, {"x": x}, ["h"])
    big = np.abs(h0.astype(np.float32)) > bound
    assert big.any() and np.isfinite(h0).all()
    assert np.isinf(h1[big]).all()  # the risk the note names: the dq form has no such intermediate
    _, report = convert(V.mlp(TensorProto.BFLOAT16), scale_form="alpha")
    assert "overflow" not in report["tensors"][0]["form_note"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_reference_activation_quantizer_is_bit_exact_in_the_graph_dtype(dtype, form):
    original = V.mlp(dtype)
    scales = scales_json()
    out, report = convert(original, scale_form=form, target="reference", scales=scales)
    full_check(out)
    assert [a["inserted"] for a in report["activations"]] == [True, True]
    x = V.random_input((6, 64), dtype, seed=2, scale=1.5)
    fq, = V.run_reference(out, {"x": x}, ["x_nvfp4/fake_quant"])
    g = scales["tensors"]["x"]["input_scale"]
    expected = V.fake_quant_np(x, g, dequant_global=(form == "dq"))
    assert fq.dtype == x.dtype and fq.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_trt_activation_quantizer_reads_and_writes_the_graph_dtype(dtype, form):
    original = V.mlp(dtype)
    trt, _ = convert(original, scale_form=form, target="trt", scales=scales_json())
    reference, _ = convert(original, scale_form=form, target="reference", scales=scales_json())
    full_check(trt)
    quantizers = [n for n in trt.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert [q.input[0] for q in quantizers] == ["x", "h"]  # no Cast in front: the quantizer reads the graph dtype
    assert "Cast" not in {n.op_type for n in trt.graph.node if n.name.startswith(("x_nvfp4", "h_nvfp4"))}
    g = initializer(trt, quantizers[0].input[1])
    assert g.data_type == TensorProto.FLOAT and list(g.dims) == []
    x = V.random_input((3, 64), dtype, seed=3)
    (y_trt,), (y_ref,) = V.run_reference(trt, {"x": x}), V.run_reference(reference, {"x": x})
    assert y_trt.dtype == x.dtype and y_trt.tobytes() == y_ref.tobytes()
    if dtype == TensorProto.FLOAT16:  # onnxruntime runs the lowered trt form and the reference form alike
        result = diff(reference, trt, inputs={"x": x}, provider="cpu")
        assert result.outputs[0].snr_db is None
        result = diff(original, trt, inputs={"x": x}, provider="cpu")
        assert result.outputs[0].snr_db is not None and result.outputs[0].snr_db > 10
        assert result.outputs[0].nan == 0 and result.outputs[0].inf == 0


@pytest.mark.parametrize("form", FORMS)
def test_fp16_calibration_then_quantizers(tmp_path, form):
    original = V.mlp(TensorProto.FLOAT16)
    data = tmp_path / "calib.npz"
    np.savez(data, x=V.random_input((16, 64), TensorProto.FLOAT16, seed=4))
    out, report = convert(original, scale_form=form, target="trt", calib=str(data), check=True, provider="cpu")
    full_check(out)
    assert sorted(a["activation"] for a in report["activations"] if a["inserted"]) == ["h", "x"]
    check = report["check"]["outputs"][0]
    assert check["nan"] == 0 and check["inf"] == 0 and check["snr_db"] > 10


def test_a_dequantize_typed_by_its_scale_keeps_its_type_once_the_scale_is_fp32():
    """A DQ without output_dtype takes its scale's type (FLOAT16 scales: the torch exporter's form); the new
    scale is FP32, so the rewrite writes output_dtype to keep the graph's type."""
    import onnx_ir as ir

    model = ir.serde.deserialize_model(V.mlp(TensorProto.FLOAT16))
    dq_node = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    del dq_node.attributes["output_dtype"]
    dq_node.outputs[0].dtype = ir.DataType.FLOAT16  # what a FLOAT16 scale gives
    out, _ = convert(model)
    proto = ir.serde.serialize_model(out)
    full_check(proto)
    rewritten = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "W1")
    assert {a.name: a.i for a in rewritten.attribute}["output_dtype"] == TensorProto.FLOAT16


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_expert_alpha_in_a_16_bit_graph(dtype):
    import onnx_builders as B

    original = B.expert_model()  # 3-D weight [3, 32, 64], exponents spread over experts
    for node in original.graph.node:
        if node.op_type == "DequantizeLinear":
            next(a for a in node.attribute if a.name == "output_dtype").i = dtype
    for value in (*original.graph.input, *original.graph.output):
        value.type.tensor_type.elem_type = dtype
    full_check(original)
    out, _ = convert(original, scale_form="alpha")
    full_check(out)
    alpha = numpy_helper.to_array(initializer(out, "W_alpha"))
    assert alpha.dtype == np.float32 and alpha.shape == (3, 1, 1)
    x = V.random_input((3, 4, 64), dtype, seed=6, scale=0.01)
    (y0,), (y1,) = V.run_reference(original, {"x": x}), V.run_reference(out, {"x": x})
    assert y1.dtype == x.dtype
    if dtype == TensorProto.BFLOAT16:
        assert y0.tobytes() == y1.tobytes()
    else:
        # Expert 1 (weights * 2^-7) has outputs below 2^-14, FLOAT16's subnormals: there the alpha form rounds
        # twice (the unscaled FLOAT16 MatMul output, then the product) and may be one unit 2^-24 off.
        y0, y1 = y0.astype(np.float64), y1.astype(np.float64)
        normal = np.abs(y0) >= 2.0**-14
        assert np.array_equal(y0[normal], y1[normal]) and (~normal).any()
        assert np.abs(y0 - y1).max() <= 2.0**-24
