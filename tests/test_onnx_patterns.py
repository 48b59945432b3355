"""Pattern matching: find_mxfp4 records/declines and find_fp4_consumers on MXFP4 and NVFP4 forms."""

from __future__ import annotations

import onnx_ir as ir

import onnx_builders as B
from fp4pass.onnx import convert
from fp4pass.onnx.patterns import find_fp4_consumers, find_mxfp4
from models.build import build_tiny_mlp


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


def test_shared_weight_initializer_is_declined():
    model = B.make([B.dq_node("W"), B.dq_node("W", out="W_dq2")], [], [B.vi("W_dq", None), B.vi("W_dq2", None)],
                   B.mx_inits("W", B.weight((4, 64))))
    model.graph.node[1].name = "W_dq2"
    records, declined = find_mxfp4(ir.serde.deserialize_model(model))
    assert records == [] and len(declined) == 2 and "also used by node" in declined[0].reason
