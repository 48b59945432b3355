"""The fixtures written by real producers convert, checked against independent decodes of the source.

Oracles: onnx.reference (DequantizeLinear FP4 with float / E8M0 scales, and fp4pass's NVFP4 two-DQ output),
ml_dtypes / numpy NVFP4 quantization (tests/support/oracles.py), and Quark's own fake-quant values computed by
onnxruntime with Quark's custom-op library when the fixture was made (quark_mlp_reference.npz).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fp4pass.cli import main
from fp4pass.onnx import convert
from oracles import nv_quantize_np
from producer_fixtures import FIXTURES, QUARK_MODEL, QUARK_VALUES, TORCH_FIXTURES, constant_value, fp4_dq_outputs


def _convert(tmp_path, name, **kwargs):
    out = tmp_path / f"out_{name}"
    _, report = convert(str(FIXTURES / name), output=str(out), **kwargs)
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    return model, report


@pytest.mark.parametrize("name,scale_type", [("torch_fp4dq_f32.onnx", onnx.TensorProto.FLOAT),
                                             ("torch_fp4dq_f16.onnx", onnx.TensorProto.FLOAT16),
                                             ("torch_fp4dq_arbitrary.onnx", onnx.TensorProto.FLOAT)])
def test_torch_fixture_is_the_exporters_form(name, scale_type):
    model = onnx.load(str(FIXTURES / name))
    assert model.producer_name == "pytorch" and model.producer_version.startswith("2.13")
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    inits = {i.name: i for i in model.graph.initializer}
    assert len(dqs) == 2
    for node in dqs:
        assert inits[node.input[0]].data_type == onnx.TensorProto.FLOAT4E2M1
        assert inits[node.input[1]].data_type == scale_type
        assert {a.name: a.i for a in node.attribute} == {"axis": -1, "block_size": 32}
    assert [len(inits[n.input[0]].dims) for n in dqs] == [2, 3]


@pytest.mark.parametrize("name", TORCH_FIXTURES[:2])
def test_torch_power_of_two_scales_convert_bit_exactly(tmp_path, name):
    source = onnx.load(str(FIXTURES / name))
    model, report = _convert(tmp_path, name)
    assert [t["pattern"] for t in report["tensors"]] == ["dq_float", "dq_float"]
    assert all(t["mse"] == 0 and t["snr_db"] is None for t in report["tensors"])
    assert report["declined"] == []
    for value in fp4_dq_outputs(source):
        before, after = constant_value(source, value), constant_value(model, value)
        assert before.dtype == after.dtype  # FLOAT16 scales: the output stays FLOAT16
        np.testing.assert_array_equal(after.view(np.uint8), before.view(np.uint8))


def _as_e8m0_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same weights with E8M0 scales (DequantizeLinear-24): the standard MXFP4 form."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    scales = {n.input[1] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    for i, init in enumerate(model.graph.initializer):
        if init.name in scales:
            values = numpy_helper.to_array(init).astype(np.float32)
            e8m0 = values.astype(ml_dtypes.float8_e8m0fnu)
            e8m0[values == 0] = np.float32(2.0**-127)  # the zero scale of an all-zero block
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(e8m0, init.name))
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            node.attribute.append(onnx.helper.make_attribute("output_dtype", onnx.TensorProto.FLOAT))
    model.opset_import[0].version = 24
    model.ir_version = 12
    return model


def test_torch_power_of_two_scales_match_the_e8m0_path(tmp_path):
    source = onnx.load(str(FIXTURES / "torch_fp4dq_f32.onnx"))
    e8m0_path = tmp_path / "e8m0.onnx"
    onnx.save(_as_e8m0_model(source), str(e8m0_path))
    float_model, _ = _convert(tmp_path, "torch_fp4dq_f32.onnx")
    _, e8m0_report = convert(str(e8m0_path), output=str(tmp_path / "e8m0_out.onnx"))
    assert [t["pattern"] for t in e8m0_report["tensors"]] == ["dq", "dq"]
    e8m0_model = onnx.load(str(tmp_path / "e8m0_out.onnx"))
    ours = {i.name: i.raw_data for i in float_model.graph.initializer}
    theirs = {i.name: i.raw_data for i in e8m0_model.graph.initializer}
    for name in ("linear.weight", "linear.weight_scale_e4m3", "linear.weight_global_scale",
                 "experts.weight", "experts.weight_scale_e4m3", "experts.weight_global_scale"):
        assert ours[name] == theirs[name], name


def _requant_mse(x: np.ndarray) -> float:
    """NVFP4 requantization by the independent oracle, one global scale per expert for 3-D weights."""
    groups = x if x.ndim == 3 else x[None]
    sse = 0.0
    for group in groups:
        codes, e4m3, g = nv_quantize_np(group)
        values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(*e4m3.shape, 16)
        scales = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g
        sse += float(np.square((values * scales[..., None]).reshape(group.shape).astype(np.float64) - group).sum())
    return sse / x.size


@pytest.mark.parametrize("method", ["auto", "hybrid", "verbatim"])
def test_torch_arbitrary_scales_take_the_lossy_path(tmp_path, method):
    source = onnx.load(str(FIXTURES / "torch_fp4dq_arbitrary.onnx"))
    model, report = _convert(tmp_path, "torch_fp4dq_arbitrary.onnx", method=method)
    requant_model, requant_report = _convert(tmp_path, "torch_fp4dq_arbitrary.onnx", method="requant")
    for value, entry, requant_entry in zip(fp4_dq_outputs(source), report["tensors"], requant_report["tensors"]):
        assert entry["pattern"] == "dq_float" and "lossy" in entry["form_note"] and "power of two" in entry["form_note"]
        x = constant_value(source, value).astype(np.float64)
        mse = float(np.mean(np.square(constant_value(model, value) - x)))
        requant_mse = float(np.mean(np.square(constant_value(requant_model, value) - x)))
        assert mse == pytest.approx(entry["mse"], rel=1e-9)
        assert requant_mse == pytest.approx(_requant_mse(x), rel=1e-9)  # fp4pass's requant is the oracle's
        if method != "verbatim":
            assert mse <= requant_mse
        assert 0 < mse < 0.1 * float(np.mean(x * x))


def test_torch_arbitrary_auto_within_hybrid(tmp_path):
    source = onnx.load(str(FIXTURES / "torch_fp4dq_arbitrary.onnx"))
    auto, _ = _convert(tmp_path, "torch_fp4dq_arbitrary.onnx", method="auto")
    hybrid, _ = _convert(tmp_path, "torch_fp4dq_arbitrary.onnx", method="hybrid")
    for value in fp4_dq_outputs(source):
        x = constant_value(source, value).astype(np.float64)
        assert np.mean(np.square(constant_value(auto, value) - x)) <= np.mean(np.square(constant_value(hybrid, value) - x))


def test_torch_fixtures_diff_runs(tmp_path, capsys):
    out = tmp_path / "f16.onnx"
    assert main(["convert", str(FIXTURES / "torch_fp4dq_f16.onnx"), "-o", str(out), "--quiet"]) == 0
    report = tmp_path / "diff.json"
    assert main(["diff", str(FIXTURES / "torch_fp4dq_f16.onnx"), str(out), "--json", str(report)]) == 0
    outputs = json.loads(report.read_text())["outputs"]
    assert [o["name"] for o in outputs] == ["y", "y_experts"]
    assert all(o["max_abs_err"] == 0 for o in outputs)


def _quark_axes(model: onnx.ModelProto) -> dict[str, int]:
    return {n.input[0]: next(a.i for a in n.attribute if a.name == "axis")
            for n in model.graph.node if n.op_type == "MXQuantizeDequantize"}


def test_quark_fixture_is_quarks_form():
    model = onnx.load(str(QUARK_MODEL))
    quark_nodes = [n for n in model.graph.node if n.domain == "com.amd.quark"]
    assert len(quark_nodes) == 7 and {n.op_type for n in quark_nodes} == {"MXQuantizeDequantize"}
    assert all(onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "element_dtype")) == b"fp4_e2m1"
               for n in quark_nodes)
    assert _quark_axes(model)["w1"] == 0  # Quark blocks MatMul weights [K, N] along K


def test_quark_weights_convert_to_quarks_own_values(tmp_path):
    source = onnx.load(str(QUARK_MODEL))
    reference = np.load(QUARK_VALUES)
    model, report = _convert(tmp_path, "quark_mlp.onnx")
    assert {t["name"]: t["pattern"] for t in report["tensors"]} == {"w1": "quark", "w2": "quark"}
    assert all(t["mse"] == 0 for t in report["tensors"])  # Quark's MXFP4 grid converts losslessly here
    outputs = {n.input[0]: n.output[0] for n in source.graph.node if n.op_type == "MXQuantizeDequantize"}
    for name in ("w1", "w2", "b1"):
        np.testing.assert_array_equal(constant_value(model, outputs[name]), reference[name])
    assert not [n for n in model.graph.node if n.domain == "com.amd.quark" and n.input[0] in ("w1", "b1", "w2")]
    assert report["quark"][0]["tensor"] == "b1" and report["quark"][0]["kind"] == "constant"


def test_quark_activations_without_calib_are_kept_and_declined(tmp_path):
    model, report = _convert(tmp_path, "quark_mlp.onnx")
    kept = [n.input[0] for n in model.graph.node if n.domain == "com.amd.quark"]
    assert kept == ["x", "hb", "r", "y_QuantizeLinear_Input"]
    declined = {d["tensor"]: d for d in report["declined"]}
    assert set(declined) == set(kept)
    assert all("custom-op library" in d["reason"] and "--calib" in d["reason"] for d in declined.values())
    assert any(o.domain == "com.amd.quark" for o in model.opset_import)


def test_quark_with_calib_runs_without_quark(tmp_path):
    import onnxruntime as ort

    reference = np.load(QUARK_VALUES)
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32))
    model, report = _convert(tmp_path, "quark_mlp.onnx", calib=str(data), target="reference")
    assert not [n for n in model.graph.node if n.domain == "com.amd.quark"]
    assert not [o for o in model.opset_import if o.domain == "com.amd.quark"]
    actions = {e["tensor"]: e["action"] for e in report["quark"] if e["kind"] == "activation"}
    assert actions["x"].startswith("removed; replaced") and actions["r"].startswith("removed; replaced")
    assert actions["hb"].startswith("removed; not replaced")
    assert {a["activation"] for a in report["activations"] if a["inserted"]} == {"x", "r"}
    from fp4pass.onnx.lower import lower_for_ort
    import onnx_ir as ir

    lowered = ir.serde.serialize_model(lower_for_ort(ir.serde.deserialize_model(model)))
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": reference["x"]})
    # NVFP4 activations against Quark's MXFP4 everywhere: the same function, up to quantization noise
    snr = 10 * np.log10(np.sum(reference["y"] ** 2) / np.sum((y - reference["y"]) ** 2))
    assert snr > 8


def test_quark_diff_needs_quarks_library_or_says_so(tmp_path, capsys):
    out = tmp_path / "q.onnx"
    assert main(["convert", str(QUARK_MODEL), "-o", str(out), "--quiet"]) == 0
    code = main(["diff", str(QUARK_MODEL), str(out)])
    try:
        import quark  # noqa: F401
    except ImportError:
        assert code == 2
        assert "custom-op library" in capsys.readouterr().err
    else:
        assert code == 0


def test_alpha_form(tmp_path):
    """Alpha form: the weight's DQ carries the E4M3 block scales only; times the global scale (a power of two
    here, so exact) it is the source weight; Quark's Gemm takes the global scale in its own alpha."""
    source = onnx.load(str(FIXTURES / "torch_fp4dq_f32.onnx"))
    model, report = _convert(tmp_path, "torch_fp4dq_f32.onnx", scale_form="alpha")
    assert [t["target_form"] for t in report["tensors"]] == ["alpha", "alpha"]
    for value, entry in zip(fp4_dq_outputs(source), report["tensors"]):
        g = np.asarray(entry["global_scale"], np.float32).reshape([-1, 1, 1] if entry["experts"] else [])
        np.testing.assert_array_equal(constant_value(model, value) * g, constant_value(source, value))
    quark, report = _convert(tmp_path, "quark_mlp.onnx", scale_form="alpha")
    (gemm,) = [n for n in quark.graph.node if n.op_type == "Gemm"]
    alpha = next(a.f for a in gemm.attribute if a.name == "alpha")
    assert alpha == pytest.approx(report["tensors"][0]["global_scale"][0], rel=0)
