"""Patterns 4 and 5 and the decline-only patterns (fp4pass.onnx.patterns), on small hand-built graphs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp4pass.onnx import convert
from fp4pass.onnx.loading import load
from fp4pass.onnx.matching import find_mxfp4
from producer_fixtures import FIXTURES, constant_value


def _fp4(codes: np.ndarray, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(codes.view(ml_dtypes.float4_e2m1fn), name)


def _dq_model(entries, opset=23) -> onnx.ModelProto:
    """One MatMul per entry (name, codes [N, K] one per byte, scales, attrs, node name), y_i = x @ DQ(W)^T."""
    nodes, inits, outputs = [], [], []
    k = entries[0][1].shape[-1]
    dtype = helper.np_dtype_to_tensor_dtype(entries[0][2].dtype)
    for name, codes, scales, attrs, node_name in entries:
        inits += [_fp4(codes, name), numpy_helper.from_array(scales, f"{name}_s")]
        nodes += [helper.make_node("DequantizeLinear", [name, f"{name}_s"], [f"{name}_dq"], name=node_name, **attrs),
                  helper.make_node("Transpose", [f"{name}_dq"], [f"{name}_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["x", f"{name}_t"], [f"y_{name}"])]
        outputs.append(helper.make_tensor_value_info(f"y_{name}", dtype, [2, codes.shape[0]]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [2, k])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def _codes(rng, n, k):
    return rng.integers(0, 16, (n, k), dtype=np.uint8)


def _pow2(rng, shape, dtype=np.float32):
    return np.ldexp(np.float32(1), rng.integers(-6, 4, shape)).astype(dtype)


def test_bfloat16_scales_at_opset_24(tmp_path):
    rng = np.random.default_rng(0)
    codes, scales = _codes(rng, 16, 64), _pow2(rng, (16, 2), ml_dtypes.bfloat16)
    model = _dq_model([("w", codes, scales, {"axis": -1, "block_size": 32}, "dq_w")], opset=24)
    path = tmp_path / "bf16.onnx"
    onnx.save(model, str(path))
    _, report = convert(str(path), output=str(tmp_path / "out.onnx"))
    out = onnx.load(str(tmp_path / "out.onnx"))
    onnx.checker.check_model(out, full_check=True)
    assert [t["pattern"] for t in report["tensors"]] == ["dq_float"] and report["tensors"][0]["mse"] == 0
    after = constant_value(out, "w_dq")
    assert after.dtype == ml_dtypes.bfloat16
    expect = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(16, 2, 32)
              * scales.astype(np.float32)[..., None]).reshape(16, 64)
    np.testing.assert_array_equal(after.astype(np.float32), expect)


def test_malformed_node_is_declined_and_the_rest_converts(tmp_path):
    rng = np.random.default_rng(1)
    good = ("a", _codes(rng, 16, 64), _pow2(rng, (16, 2)), {"axis": -1, "block_size": 32}, "dq_a")
    bad_scales = ("b", _codes(rng, 16, 64), _pow2(rng, (16, 3)), {"axis": -1, "block_size": 32}, "")
    block16 = ("c", _codes(rng, 16, 64), _pow2(rng, (16, 4)), {"axis": -1, "block_size": 16}, "dq_c")
    path = tmp_path / "m.onnx"
    onnx.save(_dq_model([good, bad_scales, block16]), str(path))
    _, report = convert(str(path), output=str(tmp_path / "out.onnx"))
    assert [t["name"] for t in report["tensors"]] == ["a"]
    declined = {d["tensor"]: d for d in report["declined"]}
    assert declined["b"]["node"] == "DequantizeLinear -> b_dq"  # unnamed: op type and output, never ''
    assert "has shape [16, 3], expected [16, 2]" in declined["b"]["reason"]
    assert declined["c"]["node"] == "dq_c"
    assert "block size 16" in declined["c"]["reason"] and "FLOAT8E4M3FN" in declined["c"]["reason"]


def test_own_nvfp4_output_is_neither_matched_nor_declined(tmp_path):
    out = tmp_path / "once.onnx"
    convert(str(FIXTURES / "torch_fp4dq_f32.onnx"), output=str(out))
    records, declined = find_mxfp4(load(str(out)).model)
    assert records == [] and declined == []


def _ms_model(node: onnx.NodeProto, inits, inputs) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, [helper.make_empty_tensor_value_info(node.output[0])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def test_matmul_bnb4_is_declined():
    b = numpy_helper.from_array(np.zeros(64 * 16 // 2, np.uint8), "B")
    absmax = numpy_helper.from_array(np.ones(16, np.float32), "absmax")
    node = helper.make_node("MatMulBnb4", ["A", "B", "absmax"], ["Y"], domain="com.microsoft", K=64, N=16,
                            block_size=64, quant_type=0)
    model = _ms_model(node, [b, absmax], [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 64])])
    records, declined = find_mxfp4(load(model).model)
    assert records == []
    (d,) = declined
    assert (d.pattern, d.node, d.tensor) == ("bnb4", "MatMulBnb4 -> Y", "B")
    assert "bitsandbytes FP4" in d.reason and "not OCP E2M1" in d.reason and "MXFP4" in d.reason


def test_int4_gather_block_quantized_is_declined():
    data = numpy_helper.from_array(np.zeros((32, 32), np.uint8), "table")
    scales = numpy_helper.from_array(np.ones((32, 2), np.float32), "scales")
    node = helper.make_node("GatherBlockQuantized", ["table", "ids", "scales"], ["emb"], domain="com.microsoft",
                            name="embed", bits=4, block_size=32, quantize_axis=1, gather_axis=0)
    model = _ms_model(node, [data, scales], [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])])
    records, declined = find_mxfp4(load(model).model)
    (d,) = declined
    assert (d.pattern, d.node, d.tensor) == ("gbq_int4", "embed", "table")
    assert "integer 4-bit" in d.reason and "not FP4" in d.reason


def test_inspect_forecasts_arbitrary_scales_by_converting_them(tmp_path):
    """FP4 with float scales that are not MXFP4 (a negative power of two; a non-power of two): inspect gives
    the lossy path's figures, the same as convert's, and calls the negative one lossless because its values
    are exact on the NVFP4 grid, which onnx.reference confirms on the converted model."""
    from onnx.reference import ReferenceEvaluator

    from fp4pass.onnx.inspection import inspect

    rng = np.random.default_rng(3)
    negative = -_pow2(rng, (16, 2))
    arbitrary = _pow2(rng, (16, 2)) * rng.uniform(1, 2, (16, 2)).astype(np.float32)  # a mantissa per block
    model = _dq_model([("n", _codes(rng, 16, 64), negative, {"axis": -1, "block_size": 32}, "dq_n"),
                       ("r", _codes(rng, 16, 64), arbitrary, {"axis": -1, "block_size": 32}, "dq_r")])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    forecast = {t["name"]: t for t in inspect(str(path))["tensors"]}
    out = tmp_path / "out.onnx"
    _, report = convert(str(path), output=str(out))
    converted = onnx.load(str(out))
    done = {t["name"]: t for t in report["tensors"]}
    assert forecast["n"]["lossless"] and not forecast["r"]["lossless"]
    for name in "nr":
        for key in ("mse", "max_abs_err", "blocks16_verbatim"):
            assert forecast[name][key] == done[name][key], (name, key)
    assert done["r"]["mse"] > 0
    x = rng.standard_normal((2, 64)).astype(np.float32)
    before = ReferenceEvaluator(model).run(["y_n"], {"x": x})[0]
    after = ReferenceEvaluator(converted).run(["y_n"], {"x": x})[0]
    np.testing.assert_array_equal(after, before)
