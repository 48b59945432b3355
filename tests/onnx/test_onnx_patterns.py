"""Pattern matching: find_mxfp4 records/declines and find_fp4_consumers on MXFP4 and NVFP4 forms."""

from __future__ import annotations

import onnx
import onnx_ir as ir

import onnx_builders as B
from fp4pass.onnx import convert
from fp4pass.onnx.matching import find_fp4_consumers, find_mxfp4
from fp4pass.onnx.sharing import find_weights, reader_nodes
from fp4pass.examples.moe import build_tiny_mlp


def _consumers(model):
    return sorted((node.name, act) for node, act, _ in find_fp4_consumers(model))


def test_consumers_in_mxfp4_and_in_both_nvfp4_forms():
    mx = ir.serde.deserialize_model(build_tiny_mlp())
    assert _consumers(mx) == [("fc1", 0), ("fc2", 0)]
    for form in ("dq", "alpha"):
        nv, _ = convert(ir.serde.deserialize_model(build_tiny_mlp()), scale_form=form)
        assert _consumers(nv) == [("fc1", 0), ("fc2", 0)]


def test_qmoe_consumer_activation_is_input_0():
    model = ir.serde.deserialize_model(B.qmoe_model())
    assert _consumers(model) == [("moe", 0)]
    records, declined = find_mxfp4(model)
    assert [(r.slot, r.shape) for r in records] == [("fc1", (2, 64, 64)), ("fc2", (2, 64, 32))] and not declined


def test_two_dequantize_nodes_on_one_weight_are_one_record():
    model = B.make([B.dq_node("W"), B.dq_node("W", out="W_dq2")], [], [B.vi("W_dq", None), B.vi("W_dq2", None)],
                   B.mx_inits("W", B.weight((4, 64))))
    model.graph.node[1].name = "W_dq2"
    ir_model = ir.serde.deserialize_model(model)
    records, declined = find_mxfp4(ir_model)
    assert [r.node.name for r in records] == ["W_dq", "W_dq2"] and not declined  # one per reader
    records, declined = find_weights(ir_model)
    assert len(records) == 1 and [n.name for n in reader_nodes(records[0])] == ["W_dq", "W_dq2"] and not declined


def test_weight_also_read_by_another_op_is_declined_naming_an_unnamed_node():
    model = B.make([B.dq_node("W"), onnx.helper.make_node("Identity", ["W"], ["W_copy"])], [],
                   [B.vi("W_dq", None), B.vi("W_copy", None)], B.mx_inits("W", B.weight((4, 64))))
    records, declined = find_weights(ir.serde.deserialize_model(model))
    assert records == [] and len(declined) == 1
    assert "'Identity -> W_copy' (Identity)" in declined[0].reason and declined[0].node == "W_dq"
