"""Quark's MX fake-quant rule and its rewrite (fp4pass.onnx.rewrite_quark).

Oracles: Quark's own values (committed fixture, computed by Quark's custom-op library under onnxruntime; and
live, where amd-quark is installed), and the numpy/ml_dtypes MXFP4 quantizer of tests/support/oracles.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from fp4pass.onnx import convert
from fp4pass.onnx.rewrite_quark import QUARK_SCALE_RULE, quark_fake_quant, quantize_weight
from oracles import mx_quantize_np
from producer_fixtures import QUARK_MODEL, QUARK_VALUES, constant_value


def _oracle_fake_quant(x: np.ndarray, axis: int) -> np.ndarray:
    """Zero-pad to a multiple of 32 along ``axis`` (as Quark's kernel does), quantize with the oracle, slice."""
    moved = np.moveaxis(x.astype(np.float32), axis, -1)
    k = moved.shape[-1]
    moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], -k % 32), np.float32)], -1)
    codes, e8m0 = mx_quantize_np(moved, "floor")
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64).reshape(*e8m0.shape, 32)
    y = (values * np.exp2(e8m0.astype(np.float64) - 127)[..., None]).reshape(moved.shape)[..., :k]
    return np.moveaxis(y, -1, axis).astype(np.float32)


def test_rule_is_floor():
    assert QUARK_SCALE_RULE.value == "floor"


def test_fixture_values_are_quarks_rule():
    model = onnx.load(str(QUARK_MODEL))
    reference = np.load(QUARK_VALUES)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MXQuantizeDequantize" and node.input[0] in inits:
            axis = next(a.i for a in node.attribute if a.name == "axis")
            np.testing.assert_array_equal(quark_fake_quant(inits[node.input[0]], axis), reference[node.input[0]])


def test_fixture_holds_e2m1_ties_rounded_to_even():
    reference = np.load(QUARK_VALUES)
    # w1[:8, 0] * 16 were 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6 (block amax 6/16: scale 2^-4)
    np.testing.assert_array_equal(reference["w1"][:8, 0] * 16, [0, 1, 1, 2, 2, 4, 4, 6])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(-30, 30), st.sampled_from([0, 1]))
def test_fake_quant_matches_the_oracle(seed, exponent, axis):
    x = (np.random.default_rng(seed).standard_normal((64, 96)) * 2.0**exponent).astype(np.float32)
    np.testing.assert_array_equal(quark_fake_quant(x, axis), _oracle_fake_quant(x, axis))


def test_fake_quant_pads_a_short_axis():
    x = np.random.default_rng(1).standard_normal(40).astype(np.float32)
    padded = np.concatenate([x, np.zeros(24, np.float32)])
    np.testing.assert_array_equal(quark_fake_quant(x, 0), quark_fake_quant(padded, 0)[:40])
    np.testing.assert_array_equal(quark_fake_quant(x, 0), _oracle_fake_quant(x, 0))


@pytest.mark.parametrize("shape,perm", [((64, 48), [1, 0]), ((48, 64), None), ((2, 64, 32), [0, 2, 1])])
def test_quantize_weight_codes(shape, perm):
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    weight = ir.Value(name="w", const_value=ir.tensor(x, name="w"))
    codes, scales, logical = quantize_weight(weight, perm)
    moved = x if perm is None else x.transpose(perm)
    expect_codes, expect_e8m0 = mx_quantize_np(moved, "floor")
    assert logical == moved.shape
    assert codes.const_value.dtype == ir.DataType.FLOAT4E2M1 and scales.const_value.dtype == ir.DataType.FLOAT8E8M0
    packed = np.frombuffer(codes.const_value.tobytes(), np.uint8)
    unpacked = np.stack([packed & 0xF, packed >> 4], -1).reshape(moved.shape)
    np.testing.assert_array_equal(unpacked, expect_codes)
    np.testing.assert_array_equal(np.frombuffer(scales.const_value.tobytes(), np.uint8).reshape(expect_e8m0.shape),
                                  expect_e8m0)


def _quark_model(w: np.ndarray, axis: int, b: np.ndarray | None = None, block: int = 32) -> onnx.ModelProto:
    """Quark's form, written by hand: fake-quant on a weight (and a bias) feeding MatMul (+ Add)."""
    attrs = dict(element_dtype="fp4_e2m1", block_size=block, axis=axis, rounding_mode=2, domain="com.amd.quark")
    nodes = [helper.make_node("MXQuantizeDequantize", ["w"], ["w_q"], name="w_fq", **attrs),
             helper.make_node("MatMul", ["x", "w_q"], ["y0"], name="mm")]
    inits = [numpy_helper.from_array(w, "w")]
    last = "y0"
    if b is not None:
        nodes += [helper.make_node("MXQuantizeDequantize", ["b"], ["b_q"], **{**attrs, "axis": 0}),
                  helper.make_node("Add", ["y0", "b_q"], ["y1"], name="add")]
        inits.append(numpy_helper.from_array(b, "b"))
        last = "y1"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    dtype = helper.np_dtype_to_tensor_dtype(w.dtype)
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", dtype, [2, w.shape[0]])],
                              [helper.make_tensor_value_info("y", dtype, [2, w.shape[1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.amd.quark", 1)],
                             ir_version=9)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_weight_and_bias_rewrite(tmp_path, dtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 40)).astype(dtype)
    b = rng.standard_normal(40).astype(dtype)  # 40: not a multiple of the block, Quark pads
    path, out = tmp_path / "q.onnx", tmp_path / "q_out.onnx"
    onnx.save(_quark_model(w, 0, b), str(path))
    _, report = convert(str(path), output=str(out))
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert [t["name"] for t in report["tensors"]] == ["w"] and report["tensors"][0]["mse"] == 0
    assert not [n for n in model.graph.node if n.domain == "com.amd.quark"]
    w_q = constant_value(model, "w_q")
    assert w_q.dtype == dtype
    np.testing.assert_array_equal(w_q, _oracle_fake_quant(w.astype(np.float32), 0).astype(dtype))
    np.testing.assert_array_equal(constant_value(model, "b_q"), _oracle_fake_quant(b.astype(np.float32), 0).astype(dtype))
    assert "b" not in {i.name for i in model.graph.initializer}  # nothing reads the float bias any more


def test_block_size_other_than_32_is_declined(tmp_path):
    w = np.random.default_rng(4).standard_normal((64, 32)).astype(np.float32)
    path = tmp_path / "q.onnx"
    onnx.save(_quark_model(w, 0, block=16), str(path))
    _, report = convert(str(path), output=str(tmp_path / "out.onnx"))
    assert report["tensors"] == []
    (declined,) = report["declined"]
    assert declined["pattern"] == "quark" and declined["node"] == "w_fq" and "block size 16" in declined["reason"]


@pytest.mark.parametrize("bad", [{"axis": 5}, {"block_size": 0}], ids=["axis", "block"])
def test_fake_quant_on_a_bias_that_makes_no_mx_block_is_declined_and_the_weight_converts(tmp_path, bad):
    """A malformed fake-quant on a bias (out-of-range axis, block 0) stays, declined with its reason; the
    weight beside it converts as usual and the bias is not folded."""
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((64, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    model = _quark_model(w, 0, b)
    (bias_fq,) = [n for n in model.graph.node if n.input[0] == "b"]
    for attr in bias_fq.attribute:
        if attr.name in bad:
            attr.i = bad[attr.name]
    path = tmp_path / "q.onnx"
    onnx.save(model, str(path))
    _, report = convert(str(path), output=str(tmp_path / "out.onnx"))
    assert [t["name"] for t in report["tensors"]] == ["w"]
    (declined,) = report["declined"]
    assert declined["pattern"] == "quark" and declined["tensor"] == "b"
    assert ("axis 5 is out of range" if "axis" in bad else "block_size 0") in declined["reason"]
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert [n.input[0] for n in out.graph.node if n.domain == "com.amd.quark"] == ["b"]


def test_live_quark_matches():
    """Where amd-quark is installed: its custom-op library's values against ours, on fresh random weights."""
    pytest.importorskip("quark")
    import onnxruntime as ort
    from quark.onnx.operators.custom_ops import get_library_path

    rng = np.random.default_rng(6)
    for axis in (0, 1):
        w = (rng.standard_normal((64, 96)) * 2.0 ** rng.integers(-20, 20)).astype(np.float32)
        model = _quark_model(w, axis)
        model.graph.output.append(helper.make_tensor_value_info("w_q", TensorProto.FLOAT, None))
        options = ort.SessionOptions()
        options.register_custom_ops_library(get_library_path("CPU"))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        (w_q,) = session.run(["w_q"], {"x": np.zeros((2, 64), np.float32)})
        np.testing.assert_array_equal(quark_fake_quant(w, axis), w_q)
