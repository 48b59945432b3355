"""Input forms real producers write that the patterns must take: a FLOAT-scale FP4 weight read by two
DequantizeLinear nodes, initializers also listed as graph inputs; and declines that name the op type.
Oracles: onnx.reference on the original and the converted graph, onnx.checker."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graph_variants as V
from fp4pass.onnx import convert

RNG = np.random.default_rng(21)


def _float_scaled(model: onnx.ModelProto, dtype=np.float32) -> onnx.ModelProto:
    """The same graph with every E8M0 scale initializer stored as float 2^(code-127) (the torch exporter's form)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == TensorProto.FLOAT8E8M0:
            codes = np.frombuffer(t.raw_data, np.uint8).reshape(tuple(t.dims))
            values = np.exp2(codes.astype(np.float64) - 127).astype(dtype)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, t.name))
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            for a in list(node.attribute):
                if a.name == "output_dtype":
                    node.attribute.remove(a)
    return model


def test_float_scale_weight_read_by_two_dequantize_nodes_converts_once():
    e8m0 = V.shared_weight()
    original = _float_scaled(e8m0)
    onnx.checker.check_model(original, full_check=True)
    out, report = convert(original)
    onnx.checker.check_model(out, full_check=True)
    assert report["declined"] == [] and len(report["tensors"]) == 1
    tensor = report["tensors"][0]
    assert tensor["pattern"] == "dq_float" and "read by 2 dequantize nodes" in tensor["form_note"]
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] == "W" for n in out.graph.node) == 2
    feeds = {"xa": RNG.standard_normal((3, 64)).astype(np.float32),
             "xb": RNG.standard_normal((3, 64)).astype(np.float32)}
    for a, b in zip(ReferenceEvaluator(original).run(None, feeds), ReferenceEvaluator(out).run(None, feeds)):
        assert a.tobytes() == b.tobytes()  # power-of-two scales: lossless, the same bytes out
    # the same weights in E8M0 form convert to the same initializers
    out_e8m0, _ = convert(e8m0)
    inits = {t.name: t.raw_data for t in out.graph.initializer}
    assert {t.name: t.raw_data for t in out_e8m0.graph.initializer} == inits


def test_float_scale_weight_read_by_something_else_is_still_declined():
    model = _float_scaled(V.shared_weight())
    model.graph.node.append(helper.make_node("Identity", ["W"], ["W_raw"], name="peek"))
    model.graph.output.append(helper.make_tensor_value_info("W_raw", TensorProto.FLOAT4E2M1, [48, 64]))
    _, report = convert(model)
    assert report["tensors"] == [] and report["declined"]
    assert all("'peek' (Identity)" in d["reason"] for d in report["declined"])
