"""Clean-up after the rewrites: raise the default opset and set the IR version only as far as the types need.

1. Default-domain opset: raised to 23 when an FP4 DequantizeLinear was written into a model below 23
   (FLOAT4E2M1 input and ``output_dtype`` arrive in DequantizeLinear-23); never lowered.
2. IR version: the lowest that holds the model, max(IR of its opsets, 11 if FLOAT4E2M1/FLOAT8E4M3FN tensors
   are present, 12 if FLOAT8E8M0 remains). Always written explicitly: onnx 1.23 writes IR 14 by default and
   onnxruntime 1.31 loads IR <= 13.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from fp4pass.formats.constants import E8M0_MIN_IR_VERSION, FP4_MIN_IR_VERSION

__all__ = ["SetOpsetAndIR"]

_IR_FOR_TYPE = {ir.DataType.FLOAT4E2M1: FP4_MIN_IR_VERSION, ir.DataType.FLOAT8E4M3FN: 11,
                ir.DataType.FLOAT8E8M0: E8M0_MIN_IR_VERSION}


def _min_ir_for_opset(version: int) -> int:
    try:
        return onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", version)])
    except ValueError:
        return onnx.IR_VERSION


class SetOpsetAndIR:
    """Cases 1 and 2 of the module docstring. ``call`` returns (old, new) for the report."""

    def call(self, model: ir.Model, wrote_fp4_dq: bool) -> dict:
        before = {"ir_version": model.ir_version, "opset": model.opset_imports.get("", None)}
        default = model.opset_imports.get("", 1)
        if wrote_fp4_dq and default < 23:
            model.opset_imports[""] = default = 23
            model.graph.opset_imports[""] = 23
        needed = _min_ir_for_opset(default)
        for graph in model.graphs():
            for value in graph.initializers.values():
                dtype = value.const_value.dtype if value.const_value is not None else value.dtype
                needed = max(needed, _IR_FOR_TYPE.get(dtype, 0))
            for value in graph.inputs:
                needed = max(needed, _IR_FOR_TYPE.get(value.dtype, 0))
        model.ir_version = needed
        return {"before": before, "after": {"ir_version": needed, "opset": model.opset_imports.get("")}}
