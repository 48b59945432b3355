"""Helpers for the committed fixtures written by real producers (tests/fixtures/, see its README)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

FIXTURES = Path(__file__).parents[1] / "fixtures"
TORCH_FIXTURES = ("torch_fp4dq_f32.onnx", "torch_fp4dq_f16.onnx", "torch_fp4dq_arbitrary.onnx")
QUARK_MODEL = FIXTURES / "quark_mlp.onnx"
QUARK_VALUES = FIXTURES / "quark_mlp_reference.npz"


def constant_value(model: onnx.ModelProto, name: str) -> np.ndarray:
    """Evaluate tensor ``name`` of ``model`` from its initializers alone, with onnx.reference.

    Only the nodes ``name`` depends on are kept, so graph inputs need no values.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    inits = {i.name: i for i in model.graph.initializer}
    needed, stack, seen = [], [name], set()
    while stack:
        value = stack.pop()
        if value in seen or value in inits or value not in producers:
            seen.add(value)
            continue
        seen.add(value)
        node = producers[value]
        needed.append(node)
        stack.extend(i for i in node.input if i)
    order = {id(n): i for i, n in enumerate(model.graph.node)}
    nodes = sorted({id(n): n for n in needed}.values(), key=lambda n: order[id(n)])
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, "extract", [], [helper.make_empty_tensor_value_info(name)],
                              initializer=[inits[i] for i in used if i in inits])
    extracted = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    if name in inits:
        return numpy_helper.to_array(inits[name])
    return np.asarray(ReferenceEvaluator(extracted).run(None, {})[0])


def fp4_dq_outputs(model: onnx.ModelProto) -> list[str]:
    """Outputs of the FP4 DequantizeLinear nodes (data input FLOAT4E2M1 initializer), in graph order."""
    fp4 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT4E2M1}
    return [n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp4]
