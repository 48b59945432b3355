"""Clean-up after the rewrites: raise the default opset and set the IR version only as far as the types need.

1. Default-domain opset: raised to 23 when an FP4 DequantizeLinear was written into a model below 23
   (FLOAT4E2M1 input and ``output_dtype`` arrive in DequantizeLinear-23); never lowered.
   A local function whose default opset equalled the model's is raised with it (the checker wants a
   function's imports to agree with the model's).
2. IR version: the lowest that holds the model, max(IR of its opsets, 11 if FLOAT4E2M1/FLOAT8E4M3FN tensors
   are present, 12 if FLOAT8E8M0 remains), looking at the initializers and inputs of every graph and
   subgraph and at the ``Constant`` nodes everywhere (function bodies included). Always written explicitly:
   onnx 1.23 writes IR 14 by default and onnxruntime 1.31 loads IR <= 13.

:class:`SetOpsetAndIR` is an ``onnx_ir`` in-place pass; ``versions`` holds (old, new) for the report after it
ran, and ``PassResult.modified`` says whether either number changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from fp4pass.formats.constants import E8M0_MIN_IR_VERSION, FP4_MIN_IR_VERSION
from fp4pass.onnx.passes import all_nodes, constant_tensor

__all__ = ["SetOpsetAndIR", "VersionsResult"]

_IR_FOR_TYPE = {ir.DataType.FLOAT4E2M1: FP4_MIN_IR_VERSION, ir.DataType.FLOAT8E4M3FN: 11,
                ir.DataType.FLOAT8E8M0: E8M0_MIN_IR_VERSION}


def _min_ir_for_opset(version: int) -> int:
    try:
        return onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", version)])
    except ValueError:
        return onnx.IR_VERSION


@dataclass
class VersionsResult(ir.passes.PassResult):
    """What :class:`SetOpsetAndIR` did: ``versions`` ``{"before": {"ir_version", "opset"}, "after": {...}}``."""

    versions: dict = field(default_factory=dict)


class SetOpsetAndIR(ir.passes.InPlacePass):
    """Cases 1 and 2 of the module docstring. ``wrote_fp4_dq``: whether an FP4 DequantizeLinear was written
    (the rewrite's :class:`~fp4pass.onnx.pipeline.RewriteResult` says). Returns a :class:`VersionsResult`."""

    def __init__(self, wrote_fp4_dq: bool = False) -> None:
        super().__init__()
        self.wrote_fp4_dq = wrote_fp4_dq

    def call(self, model: ir.Model) -> VersionsResult:
        wrote = self.wrote_fp4_dq
        before = {"ir_version": model.ir_version, "opset": model.opset_imports.get("", None)}
        default = model.opset_imports.get("", 1)
        if wrote and default < 23:
            for function in model.functions.values():
                if function.opset_imports.get("") == default:
                    function.opset_imports[""] = 23
            model.opset_imports[""] = default = 23
            model.graph.opset_imports[""] = 23
        needed = _min_ir_for_opset(default)
        for graph in model.graphs():
            for value in graph.initializers.values():
                dtype = value.const_value.dtype if value.const_value is not None else value.dtype
                needed = max(needed, _IR_FOR_TYPE.get(dtype, 0))
            for value in graph.inputs:
                needed = max(needed, _IR_FOR_TYPE.get(value.dtype, 0))
        for node in all_nodes(model):
            if node.op_type == "Constant" and node.domain == "" and node.outputs:
                stored = constant_tensor(node.outputs[0])
                needed = max(needed, _IR_FOR_TYPE.get(stored.dtype, 0) if stored is not None else 0)
        model.ir_version = needed
        versions = {"before": before, "after": {"ir_version": needed, "opset": model.opset_imports.get("")}}
        return VersionsResult(model, versions["after"] != before, versions)
