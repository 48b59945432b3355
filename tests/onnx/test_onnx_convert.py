"""The ONNX pass on small hand-built models: every pattern in and out, checked with onnx.checker (full check),
onnx.reference and numpy/ml_dtypes oracles; declines; Python API kinds; determinism; external data."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import conversion_oracle as O
import onnx_builders as B
from oracles import qmoe_nvfp4_kernel_dequant
from fp4pass.onnx import convert
from oracles import mx_dq_model
from spies import spy_conversion_options  # noqa: E402

RNG = np.random.default_rng(7)


def run(model, **feeds):
    return ReferenceEvaluator(model).run(None, feeds)


def full_check(model):
    onnx.checker.check_model(model, full_check=True)


def op_types(model):
    return [n.op_type for n in model.graph.node]


def test_linear_dq_is_lossless_bit_for_bit():
    original = B.linear_model()
    out, report = convert(original)
    full_check(out)
    assert op_types(out) == ["DequantizeLinear", "DequantizeLinear", "Transpose", "MatMul"]
    scale_dq, weight_dq = out.graph.node[:2]
    assert {a.name: a.i for a in weight_dq.attribute if a.name in ("axis", "block_size")} == {"axis": -1, "block_size": 16}
    assert B.init(out, "W_scale_e4m3").data_type == onnx.TensorProto.FLOAT8E4M3FN
    assert list(B.init(out, "W_global_scale").dims) == []
    assert "W_scale" not in {t.name for t in out.graph.initializer}  # the E8M0 scales are gone
    x = RNG.standard_normal((5, 64)).astype(np.float32)
    (y0,), (y1,) = run(original, x=x), run(out, x=x)
    assert y0.tobytes() == y1.tobytes()
    entry = report["tensors"][0]
    assert entry["mse"] == 0 and entry["snr_db"] is None and entry["pattern"] == "dq" and entry["target_form"] == "dq"
    assert report["summary"]["lossless"] == 1


def test_expert_weights_get_one_global_scale_per_expert():
    original = B.expert_model()
    out, report = convert(original)
    full_check(out)
    g = numpy_helper.to_array(B.init(out, "W_global_scale"))
    assert g.shape == (3,)
    assert next(a.i for a in out.graph.node[0].attribute if a.name == "axis") == 0
    x = RNG.standard_normal((3, 4, 64)).astype(np.float32)
    assert run(original, x=x)[0].tobytes() == run(out, x=x)[0].tobytes()
    assert report["tensors"][0]["experts"] == 3 and report["tensors"][0]["mse"] == 0


def test_lossy_expert_has_exactly_the_reported_weight_error():
    original = B.expert_model(spread_expert=1)
    out, report = convert(original)
    full_check(out)
    err = B.nv_dequant(out, "W").astype(np.float64) - B.mx_dequant(original, "W", "W_scale")
    entry = report["tensors"][0]
    assert entry["snr_db"] is not None and entry["mse"] > 0
    assert np.mean(err**2) == pytest.approx(entry["mse"], rel=1e-9)
    assert np.abs(err).max() == pytest.approx(entry["max_abs_err"], rel=1e-9)
    # the reference runtime executes the written DQ chain exactly as the oracle decodes it
    scale_dq_out = ReferenceEvaluator(out).run(["W_dq"], {"x": np.zeros((3, 1, 64), np.float32)})
    assert np.array_equal(scale_dq_out[0], B.nv_dequant(out, "W"))


def test_one_dq_feeding_two_consumers_through_cast_and_transpose():
    original = B.linear_model(shared=True)
    out, report = convert(original)
    full_check(out)
    assert sum(t == "DequantizeLinear" for t in op_types(out)) == 2 and len(report["tensors"]) == 1
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    for a, b in zip(run(original, x=x), run(out, x=x)):
        assert a.tobytes() == b.tobytes()


def test_alpha_form_multiplies_the_consumer_output():
    original = B.linear_model(shared=True)
    out, report = convert(original, scale_form="alpha")
    full_check(out)
    g = float(numpy_helper.to_array(B.init(out, "W_global_scale")) if any(
        t.name == "W_global_scale" for t in out.graph.initializer) else report["tensors"][0]["global_scale"][0])
    alphas = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer if t.name.startswith("W_alpha")}
    assert set(alphas) == {"W_alpha", "W_alpha_1"} and all(float(a) == g for a in alphas.values())
    assert op_types(out).count("Mul") == 2
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    for a, b in zip(run(original, x=x), run(out, x=x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert [o.name for o in out.graph.output] == ["y", "z"]  # names kept on the scaled values


def test_alpha_per_expert_broadcasts_over_the_expert_axis():
    original = B.expert_model()
    out, _ = convert(original, scale_form="alpha")
    full_check(out)
    assert numpy_helper.to_array(B.init(out, "W_alpha")).shape == (3, 1, 1)
    x = RNG.standard_normal((3, 4, 64)).astype(np.float32)
    np.testing.assert_allclose(run(original, x=x)[0], run(out, x=x)[0], rtol=1e-5, atol=1e-12)


def test_alpha_gemm_with_bias_uses_gemm_alpha():
    from fp4pass.examples.moe import build_tiny_mlp

    original = build_tiny_mlp()
    out, report = convert(original, scale_form="alpha")
    full_check(out)
    gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
    g = report["tensors"][1]["global_scale"][0]
    assert next(a.f for a in gemm.attribute if a.name == "alpha") == pytest.approx(g, rel=1e-7)
    assert "Gemm alpha" in report["tensors"][1]["form_note"]
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(run(original, x=x)[0], run(out, x=x)[0], rtol=1e-5, atol=1e-7)


def test_alpha_falls_back_to_dq_for_a_non_linear_consumer():
    model = B.make([B.dq_node("W"), onnx.helper.make_node("Relu", ["W_dq"], ["y"], name="r")],
                   [], [B.vi("y", [8, 32])], B.mx_inits("W", B.weight((8, 32))))
    out, report = convert(model, scale_form="alpha")
    assert report["tensors"][0]["target_form"] == "dq"
    assert "not a linear op" in report["tensors"][0]["form_note"]
    assert run(model)[0].tobytes() == run(out)[0].tobytes()


def test_qmoe_fp4_becomes_nvfp4():
    original = B.qmoe_model(global_scale=[1.0, 0.5])
    out, report = convert(original, target="ort")
    onnx.checker.check_model(out)
    node = out.graph.node[0]
    attrs = {a.name: (a.s.decode() if a.type == onnx.AttributeProto.STRING else a.i) for a in node.attribute}
    assert attrs["quant_type"] == "nvfp4" and attrs["block_size"] == 16
    assert node.input[3] == "fc1.weight_scale_e4m3" and node.input[15] == "fc1.global_scale"
    for name in ("fc1", "fc2"):
        w_in = B.unpack_fp4(numpy_helper.to_array(B.init(original, f"{name}.weight")),
                            [*B.init(original, f"{name}.weight").dims[:2], 2 * B.init(original, f"{name}.weight").dims[2]])
        s_in = numpy_helper.to_array(B.init(original, f"{name}.scales")).astype(np.float32)
        g_in = numpy_helper.to_array(B.init(original, f"{name}.global_scale"))[:, None, None]
        before = w_in * np.repeat(s_in, 32, -1) * g_in
        # written in the CUDA kernel's layout [E, K, N/2] whatever the input's layout
        w_out = numpy_helper.to_array(B.init(out, f"{name}.weight"))
        assert w_out.shape == (before.shape[0], before.shape[2], before.shape[1] // 2)
        s_out = numpy_helper.to_array(B.init(out, f"{name}.weight_scale_e4m3"))
        g_out = numpy_helper.to_array(B.init(out, f"{name}.global_scale"))
        assert s_out.shape == (*before.shape[:2], before.shape[2] // 16) and g_out.shape == (2,)
        assert np.array_equal(before, qmoe_nvfp4_kernel_dequant(w_out, s_out, g_out))
    assert {p.key: p.value for p in node.metadata_props} == {"fp4pass.qmoe_weight_layout": "kernel"}
    assert report["tensors"][0]["layout_read"] == "schema" and report["tensors"][0]["layout_written"] == "kernel"
    assert "fc*_global_scale" in report["tensors"][0]["form_note"]


def test_gather_block_quantized_fp4_gets_e4m3_scales():
    original = B.gbq_model()
    out, report = convert(original)
    node = next(n for n in out.graph.node if n.op_type == "GatherBlockQuantized")
    assert next(a.i for a in node.attribute if a.name == "block_size") == 16
    before = B.mx_dequant(original, "emb", "emb_scale")
    assert np.array_equal(before, B.nv_dequant(out, "emb"))
    assert report["tensors"][0]["pattern"] == "gbq"


@pytest.mark.parametrize("case, reason", [
    ("graph_input", "is a graph input"),
    ("runtime_scale", "computed at run time"),
    ("block16", "block size 16"),
    ("block64", "block size 64"),
    ("axis0", "not the last axis"),
])
def test_declined_patterns_are_left_untouched_and_named(case, reason):
    w = B.weight((8, 64))
    inits = B.mx_inits("W", w, block=64 if case == "block64" else (16 if case == "block16" else 32))
    inputs, nodes = [], []
    if case == "graph_input":
        inputs = [onnx.helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT4E2M1, [8, 64])]
        inits = inits[1:]
    if case == "runtime_scale":
        nodes.append(onnx.helper.make_node("Identity", ["W_scale"], ["W_scale_rt"], name="id"))
    block = {"block16": 16, "block64": 64}.get(case, 32)
    dq = B.dq_node("W", block=block, scale="W_scale_rt" if case == "runtime_scale" else None)
    if case == "axis0":
        codes, scales = B.mx_quantize_axis0(B.weight((64, 8)))
        inits = [numpy_helper.from_array(codes, "W"), numpy_helper.from_array(scales, "W_scale")]
        dq = B.dq_node("W", axis=0)
    model = B.make([*nodes, dq], inputs, [B.vi("W_dq", None)], inits)
    out, report = convert(model)
    assert report["tensors"] == []
    assert len(report["declined"]) == 1 and reason in report["declined"][0]["reason"]
    assert report["declined"][0]["tensor"] == "W"
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]
    assert {t.name for t in out.graph.initializer} == {t.name for t in model.graph.initializer}


def test_unknown_custom_op_and_metadata_kept():
    model = B.linear_model()
    model.graph.node.append(onnx.helper.make_node("Frob", ["y"], ["f"], name="frob", domain="acme", knob=3))
    model.graph.output.append(B.vi("f", None))
    model.opset_import.append(onnx.helper.make_opsetid("acme", 2))
    model.metadata_props.append(onnx.StringStringEntryProto(key="author", value="me"))
    out, _ = convert(model)
    frob = out.graph.node[-1]
    assert (frob.domain, frob.name, frob.attribute[0].i) == ("acme", "frob", 3)
    assert {o.domain: o.version for o in out.opset_import} == {"": 24, "acme": 2}
    assert out.metadata_props[0].value == "me"


def test_python_api_returns_the_kind_given(tmp_path):
    gs = pytest.importorskip("onnx_graphsurgeon", reason="the 'graphsurgeon' extra")

    proto = B.linear_model()
    out_ir, _ = convert(ir.serde.deserialize_model(proto))
    assert isinstance(out_ir, ir.Model)
    graph = gs.import_onnx(proto)
    out_gs, report = convert(graph)
    assert type(out_gs).__name__ == "Graph" and report["summary"]["tensors_converted"] == 1
    path = tmp_path / "in.onnx"
    onnx.save(proto, path)
    out_path, _ = convert(str(path), output=tmp_path / "out.onnx")
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    assert run(proto, x=x)[0].tobytes() == run(onnx.load(out_path), x=x)[0].tobytes()


def test_same_input_gives_byte_identical_output(tmp_path):
    path = tmp_path / "in.onnx"
    onnx.save(B.expert_model(spread_expert=2), path)
    for mode in ("never", "always"):
        a, b = tmp_path / f"a_{mode}.onnx", tmp_path / f"b_{mode}.onnx"
        convert(str(path), output=a, external_data=mode)
        convert(str(path), output=b, external_data=mode)
        assert a.read_bytes().replace(b"a_", b"b_") == b.read_bytes()
        if mode == "always":
            assert (tmp_path / "a_always.onnx.data").read_bytes() == (tmp_path / "b_always.onnx.data").read_bytes()


def test_external_data_in_and_out(tmp_path):
    proto = B.expert_model()
    path = tmp_path / "in.onnx"
    onnx.save(onnx.ModelProto.FromString(proto.SerializeToString()), path, save_as_external_data=True, all_tensors_to_one_file=True, location="in.onnx.data",
              size_threshold=0)
    out_path = tmp_path / "out.onnx"
    _, report = convert(str(path), output=out_path)
    assert report["external_data"] is True and (tmp_path / "out.onnx.data").exists()
    x = RNG.standard_normal((3, 2, 64)).astype(np.float32)
    assert run(proto, x=x)[0].tobytes() == run(onnx.load(out_path), x=x)[0].tobytes()


# -- error bounds, per expert, against independent oracles ------------------------------------------------

@pytest.mark.parametrize("method", ["auto", "hybrid", "requant"])
def test_every_expert_is_within_its_oracle_bound_and_reported_exactly(method):
    """Per expert: the converted weight, decoded by onnx.reference, is identical to the MXFP4 one where the
    spread allows (<= 17), and elsewhere no worse than min(Algo 1, Algo 3) of an independent numpy oracle
    (hybrid and requant: equal to their oracle). The reported per-expert figures are the oracle's."""
    codes, e8m0 = O.expert_codes(11)
    original = mx_dq_model(codes, e8m0)
    out, report = convert(original, method=method)
    (nv,) = ReferenceEvaluator(out).run(None, {})  # the written DQ chain, decoded by onnx.reference
    nv_codes = numpy_helper.to_array(B.init(out, "w")).view(np.uint8)
    assert np.array_equal(nv, O.nv_dequant(nv_codes, numpy_helper.to_array(B.init(out, "w_scale_e4m3")).view(np.uint8),
                                           numpy_helper.to_array(B.init(out, "w_global_scale"))))
    entry = report["tensors"][0]
    assert len(entry["per_expert"]) == 4
    total_sse = 0.0
    for e, reported in enumerate(entry["per_expert"]):
        mx = O.mx_dequant(codes[e], e8m0[e]).astype(np.float32)
        err = nv[e].astype(np.float64) - mx
        hybrid, requant = O.hybrid(codes[e], e8m0[e]), O.requant(codes[e], e8m0[e])
        if method == "hybrid":
            assert np.array_equal(nv[e], hybrid)
        elif method == "requant":
            assert np.array_equal(nv[e], requant)
        else:
            if O.spread(codes[e], e8m0[e]) <= 17:
                assert np.array_equal(nv[e], mx)
            bound = min(O.mse(hybrid, mx), O.mse(requant, mx))
            assert O.mse(nv[e], mx) <= bound * (1 + 1e-9)
            assert np.sum(err**2) <= O.auto_bound(codes[e], e8m0[e]) * (1 + 1e-9)
        total_sse += float(np.sum(err**2))
        assert reported["expert"] == e and reported["blocks16_total"] == mx.size // 16
        assert reported["blocks16_verbatim"] == O.verbatim_count(codes[e], mx, nv_codes[e], nv[e])
        assert reported["lossless"] == bool(np.array_equal(nv[e], mx))
        assert reported["mse"] == pytest.approx(float(np.mean(err**2)), rel=1e-9, abs=0)
        expected_snr = O.snr_db(mx, err)
        assert (reported["snr_db"] is None) == (expected_snr is None)
        if expected_snr is not None:
            assert reported["snr_db"] == pytest.approx(expected_snr, rel=1e-9)
    mx_all = O.mx_dequant(codes, e8m0)
    assert entry["mse"] == pytest.approx(total_sse / codes.size, rel=1e-9, abs=0)
    assert entry["blocks16_verbatim"] == O.verbatim_count(codes, mx_all, nv_codes, nv)
    if method != "requant":
        assert entry["per_expert"][0]["lossless"]
        # expert 1: the block at k_max - 18 is requantized to the same values with other nibbles
        assert entry["per_expert"][1]["blocks16_verbatim"] < entry["per_expert"][1]["blocks16_total"]



def test_effort_and_threads_reach_every_weight_conversion_by_argument(monkeypatch, tmp_path):
    """``fp4pass.onnx.convert`` and the ``convert`` command name effort and threads to each weight's
    conversion; one run's choice leaves nothing behind for the next (no process-wide setting)."""
    import fp4pass.convert as convert_mod
    import fp4pass.onnx
    from fp4pass.cli import main

    seen = spy_conversion_options(monkeypatch, convert_mod)
    fp4pass.onnx.convert("models/moe.onnx", effort="fast", threads=2)
    assert seen == [("fast", 2)] * 2
    seen.clear()
    assert main(["convert", "models/moe.onnx", "-o", str(tmp_path / "a.onnx"), "--effort", "fast", "--threads", "3",
                 "--quiet"]) == 0
    assert seen == [("fast", 3)] * 2
    seen.clear()
    assert main(["convert", "models/moe.onnx", "-o", str(tmp_path / "b.onnx"), "--quiet"]) == 0
    assert seen == [("best", 1)] * 2
