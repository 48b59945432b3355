"""Shared weights and tied scales in the ONNX pass: one conversion per weight, every reader rewritten, a scale kept
while something still reads it. Oracles: onnx.checker (full check), onnx.reference, the onnxruntime CPU diff,
and E2M1/E4M3 decoding of the written initializers in numpy/ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graph_variants as V
import onnx_builders as B
from fp4pass.onnx import convert
from fp4pass.onnx.numerics import diff

RNG = np.random.default_rng(11)


def full_check(model):
    onnx.checker.check_model(model, full_check=True)


def initializers(model) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def weight_readers(model, name):
    return [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == name]


def block_size(node) -> int:
    return next(a.i for a in node.attribute if a.name == "block_size")


@pytest.mark.parametrize("form", ["dq", "alpha"])
def test_weight_read_by_two_dequantize_nodes_converts_once(form):
    original = V.shared_weight()
    out, report = convert(original, scale_form=form)
    full_check(out)
    assert len(report["tensors"]) == 1 and report["declined"] == []
    assert report["tensors"][0]["target_form"] == form and report["tensors"][0]["mse"] == 0
    assert "read by 2 dequantize nodes (W_dq_a, DequantizeLinear -> W_dq_b)" in report["tensors"][0]["form_note"]
    readers = weight_readers(out, "W")
    assert len(readers) == 2 and [block_size(n) for n in readers] == [16, 16]
    inits = initializers(out)
    assert "W_scale" not in inits and sum(name.startswith("W_scale_e4m3") for name in inits) == 1
    feeds = {"xa": RNG.standard_normal((3, 64)).astype(np.float32),
             "xb": RNG.standard_normal((3, 64)).astype(np.float32)}
    for a, b in zip(ReferenceEvaluator(original).run(None, feeds), ReferenceEvaluator(out).run(None, feeds)):
        if form == "dq":
            assert a.tobytes() == b.tobytes()
        else:  # MatMul(x, W/G) * G: FP32 re-association of a power-of-two scale
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    result = diff(original, out, inputs=feeds, provider="cpu")
    assert len(result.outputs) == 2
    if form == "dq":
        assert all(m.snr_db is None for m in result.outputs)


def test_lossy_shared_weight_readers_see_one_weight():
    original = V.shared_weight()
    out, report = convert(original, method="requant")
    full_check(out)
    assert report["tensors"][0]["mse"] > 0
    inits = initializers(out)
    codes = numpy_helper.to_array(inits["W"]).astype(np.float32)
    s = numpy_helper.to_array(inits["W_scale_e4m3"]).astype(np.float32)
    g = numpy_helper.to_array(inits["W_global_scale"]).astype(np.float32)
    w = codes * np.repeat(s * g, 16, -1)
    wa, wb = ReferenceEvaluator(out).run(["W_dq_a", "W_dq_b"], {"xa": np.zeros((1, 64), np.float32),
                                                                "xb": np.zeros((1, 64), np.float32)})
    assert wa.tobytes() == wb.tobytes() == w.tobytes()


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_shared_weight_in_a_16_bit_graph(dtype):
    original = V.shared_weight(dtype)
    out, _ = convert(original, scale_form="alpha")
    full_check(out)
    feeds = {"xa": V.random_input((2, 64), dtype, 1, 0.1), "xb": V.random_input((2, 64), dtype, 2, 0.1)}
    for a, b in zip(V.run_reference(original, feeds), V.run_reference(out, feeds)):
        assert a.tobytes() == b.tobytes()


def test_tied_scale_gives_each_weight_its_own_scales_and_drops_the_old_one():
    original, _ = V.tied_scale()
    out, report = convert(original)
    full_check(out)
    assert sorted(t["name"] for t in report["tensors"]) == ["W1", "W2"] and report["declined"] == []
    inits = initializers(out)
    assert "S" not in inits and {"W1_scale_e4m3", "W2_scale_e4m3"} <= set(inits)
    for name in ("W1", "W2"):
        codes = numpy_helper.to_array(initializers(original)[name]).astype(np.float32)
        before = codes * np.repeat(numpy_helper.to_array(initializers(original)["S"]).astype(np.float32), 32, -1)
        assert np.array_equal(before, B.nv_dequant(out, name))
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    for a, b in zip(ReferenceEvaluator(original).run(None, {"x": x}), ReferenceEvaluator(out).run(None, {"x": x})):
        assert a.tobytes() == b.tobytes()
    assert all(m.snr_db is None for m in diff(original, out, inputs={"x": x}, provider="cpu").outputs)


def test_tied_scale_with_a_weight_that_is_a_graph_input_keeps_the_scale_for_it():
    original, codes2 = V.tied_scale(second_is_input=True)
    out, report = convert(original)
    full_check(out)
    assert [t["name"] for t in report["tensors"]] == ["W1"]
    assert len(report["declined"]) == 1 and "graph input" in report["declined"][0]["reason"]
    assert report["declined"][0]["node"] == "W2_dq_node"
    inits = initializers(out)
    assert "S" in inits and "W1_scale_e4m3" in inits  # S stays for W2's dequantize, W1 has its own scales
    w2_dq = weight_readers(out, "W2")[0]
    assert list(w2_dq.input) == ["W2", "S"] and block_size(w2_dq) == 32
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    feeds = {"x": x, "W2": codes2}
    for a, b in zip(ReferenceEvaluator(original).run(None, feeds), ReferenceEvaluator(out).run(None, feeds)):
        assert a.tobytes() == b.tobytes()


def test_new_names_do_not_clash_with_a_kept_scale():
    """W1's scale initializer is named 'W1_scale' and stays (an unconverted weight reads it): the value the
    rewrite would call 'W1_scale' gets another name, and the model stays valid."""
    original, codes2 = V.tied_scale(second_is_input=True)
    for t in original.graph.initializer:
        if t.name == "S":
            t.name = "W1_scale"
    for n in original.graph.node:
        n.input[:] = ["W1_scale" if i == "S" else i for i in n.input]
    out, _ = convert(original)
    full_check(out)
    names = [o for n in out.graph.node for o in n.output] + [t.name for t in out.graph.initializer]
    assert len(names) == len(set(names)) and "W1_scale" in initializers(out)


def test_a_declined_reader_declines_the_weight_for_every_reader_and_names_it():
    w = B.weight((8, 64))
    inits = B.mx_inits("W", w)
    codes, scales = B.mxfp4_quantize(w)
    other = numpy_helper.from_array(np.repeat(scales.astype(np.float32), 2, -1).astype(ml_dtypes.float8_e8m0fnu),
                                    "W_scale16")  # the same codes read as block 16: a DQ the pass declines
    nodes = [V.dq("W", "W_dq", TensorProto.FLOAT, name="good"),
             helper.make_node("DequantizeLinear", ["W", "W_scale16"], ["W_dq16"], axis=-1, block_size=16)]
    model = B.make(nodes, [], [B.vi("W_dq", None), B.vi("W_dq16", None)], [*inits, other])
    out, report = convert(model)
    assert report["tensors"] == []
    by_node = {d["node"]: d["reason"] for d in report["declined"]}
    assert set(by_node) == {"good", "DequantizeLinear -> W_dq16"}
    assert "block size 16" in by_node["DequantizeLinear -> W_dq16"]
    assert "also read by node 'DequantizeLinear -> W_dq16'" in by_node["good"] and "block size 16" in by_node["good"]
    assert [list(n.input) for n in out.graph.node] == [list(n.input) for n in model.graph.node]


def test_tied_embedding_falls_back_to_dq_for_every_reader():
    """W read by a DQ feeding Gather (embedding) and by another DQ feeding the output MatMul: alpha is not
    possible for the Gather, so both readers get the dq form."""
    inits = B.mx_inits("W", B.weight((40, 64), 6))
    nodes = [V.dq("W", "emb_table", TensorProto.FLOAT, name="dq_emb"),
             helper.make_node("Gather", ["emb_table", "ids"], ["h"], name="embed"),
             V.dq("W", "head_w", TensorProto.FLOAT, name="dq_head"), *V.linear("h", "head_w", "logits", "lm_head")]
    model = B.make(nodes, [B.vi("ids", ["t"], TensorProto.INT64)], [B.vi("logits", ["t", 40])], inits)
    out, report = convert(model, scale_form="alpha")
    full_check(out)
    entry = report["tensors"][0]
    assert entry["target_form"] == "dq" and "'embed' (Gather)" in entry["form_note"]
    assert [block_size(n) for n in weight_readers(out, "W")] == [16, 16]
    ids = np.array([0, 5, 39], np.int64)
    assert ReferenceEvaluator(model).run(None, {"ids": ids})[0].tobytes() == \
        ReferenceEvaluator(out).run(None, {"ids": ids})[0].tobytes()
