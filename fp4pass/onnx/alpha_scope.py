"""The tensors of a graph that hold an NVFP4 weight (or activation) without its global scale: the alpha form.

NVFP4 dequantizes as x = e2m1(code) * (s_e4m3 * G), s the E4M3 block scale (a multiplier) and G the FP32
global scale (a multiplier). In the ``dq`` form G sits in the scales' DequantizeLinear, so every tensor after
the FP4 ``DequantizeLinear`` holds x. In the ``alpha`` form the scales dequantize with the scale 1 (or a bare
Cast) and G multiplies the consumer's output instead: a ``Mul`` by a constant after it, or Gemm's own
``alpha`` attribute. Every tensor on the way (the dequantized weight, its Transpose/Reshape/Cast, the
consumer's raw output) holds x / G per expert. Compared by name with a graph that holds x (the MXFP4
original, or the ``dq`` form) such a tensor is off by G, not wrong: :func:`missing_global_scale` names
them, so that a diff compares like with like.

Where the scale comes back: a ``Mul`` with a constant operand, or a ``Gemm`` whose ``alpha`` is not 1. The walk
stops there and never crosses such a node, so it never claims a tensor that carries the scale.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.passes import constant_tensor
from fp4pass.onnx.patterns import node_label

__all__ = ["missing_global_scale"]


def _is_fp4(value: ir.Value | None) -> bool:
    stored = constant_tensor(value)
    dtype = stored.dtype if stored is not None else (value.dtype if value is not None else None)
    return dtype == ir.DataType.FLOAT4E2M1


def _unit_scales(scale: ir.Value | None) -> bool:
    """``scale`` is E4M3 block scales dequantized without a global scale: DQ(s, 1) or Cast(s)."""
    producer = scale.producer() if scale is not None else None
    if producer is None or producer.domain not in ("", "ai.onnx") or not producer.inputs:
        return False
    source = producer.inputs[0]
    if source is None or source.dtype not in (ir.DataType.FLOAT8E4M3FN, None):
        return False
    if producer.op_type == "Cast":
        return True
    if producer.op_type != "DequantizeLinear" or len(producer.inputs) < 2:
        return False
    one = constant_tensor(producer.inputs[1])
    return one is not None and bool(np.all(np.asarray(one.numpy(), np.float64) == 1.0))


def _applies_scale(node: ir.Node, value: ir.Value) -> bool:
    """``node`` multiplies ``value`` by a constant: where an alpha-form global scale comes back."""
    if node.op_type == "Mul" and node.domain in ("", "ai.onnx"):
        return any(other is not value and constant_tensor(other) is not None for other in node.inputs)
    if node.op_type == "Gemm" and node.domain in ("", "ai.onnx"):
        alpha = node.attributes.get("alpha")
        return alpha is not None and alpha.value != 1.0
    return False


def missing_global_scale(model: ir.Model) -> dict[str, str]:
    """``tensor name -> label of the node that multiplies the global scale back in`` for every tensor of the
    main graph that holds an FP4 value dequantized without its global scale (module docstring)."""
    seeds = [node for node in model.graph
             if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx") and len(node.inputs) >= 2
             and _is_fp4(node.inputs[0]) and _unit_scales(node.inputs[1])]
    found: dict[str, str] = {}
    for seed in seeds:
        stack = [out for out in seed.outputs if out is not None]
        path: list[str] = []
        appliers: list[str] = []
        seen: set[int] = set()
        while stack:
            value = stack.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if value.name:
                path.append(value.name)
            for usage in value.uses():
                node = usage.node
                if _applies_scale(node, value):
                    appliers.append(node_label(node))
                    continue
                stack.extend(out for out in node.outputs if out is not None)
        label = ", ".join(dict.fromkeys(appliers)) or "none found"
        for name in path:
            found.setdefault(name, label)
    return found
