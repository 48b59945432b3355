"""The tensors of a graph that hold an NVFP4 weight (or activation) without its global scale: the alpha form.

NVFP4 dequantizes as x = e2m1(code) * (s_e4m3 * G), s the E4M3 block scale (a multiplier) and G the FP32
global scale (a multiplier). In the ``dq`` form G sits in the scales' DequantizeLinear, so every tensor after
the FP4 ``DequantizeLinear`` holds x. In the ``alpha`` form the scales dequantize with the scale 1 (or a bare
Cast) and G multiplies the consumer's output instead: a ``Mul`` by a constant after it, or Gemm's own
``alpha`` attribute. Every tensor on the way (the dequantized weight, its Transpose/Reshape/Cast, the
consumer's raw output) holds x / G per expert. Compared by name with a graph that holds x (the MXFP4
original, or the ``dq`` form) such a tensor is off by G, not wrong: :func:`missing_global_scale` names
them, so that a diff compares like with like.

The walk follows the shape the alpha form has, and nothing else: from the FP4 dequantize through layout ops
(Transpose, Reshape, Cast, ...) to a linear consumer (MatMul, Einsum, Gemm), then through Casts only to a
``Mul`` by a constant (or the consumer is a Gemm whose ``alpha`` is not 1). A dequantize with any other path
(a Relu after the MatMul, a graph output) is not in the alpha form, and none of its tensors is claimed: a
``dq``-form weight whose global scale happens to be 1 is compared as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.passes import constant_tensor
from fp4pass.onnx.patterns import node_label

__all__ = ["missing_global_scale"]

# between a dequantize and its consumer (a layout change of the weight); after the consumer only Cast
_LAYOUT_OPS = ("Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Identity", "Flatten")
_LINEAR_OPS = ("MatMul", "Einsum", "Gemm")


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
    return False


def _default(node: ir.Node, *ops: str) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in ops


def _gemm_alpha(node: ir.Node) -> float:
    alpha = node.attributes.get("alpha")
    return 1.0 if alpha is None else float(alpha.value)


def _walk(value: ir.Value, path: list[str], appliers: list[str], after_consumer: bool) -> bool:
    """Follow ``value`` along the alpha form's shape (module docstring), adding the names it passes to ``path``
    and the nodes that scale back to ``appliers``; False when some use leaves that shape."""
    if value.name:
        path.append(value.name)
    if value.is_graph_output() or not value.uses():
        return False
    for usage in value.uses():
        node = usage.node
        out = node.outputs[0] if node.outputs else None
        if after_consumer and _applies_scale(node, value):
            appliers.append(node_label(node))
        elif _default(node, "Cast") or (not after_consumer and _default(node, *_LAYOUT_OPS) and usage.idx == 0):
            if out is None or not _walk(out, path, appliers, after_consumer):
                return False
        elif not after_consumer and _default(node, "Gemm") and _gemm_alpha(node) != 1.0:
            appliers.append(node_label(node))  # alpha * A @ B + beta * C: the scale is in the Gemm itself
        elif not after_consumer and _default(node, *_LINEAR_OPS):
            if out is None or not _walk(out, path, appliers, True):
                return False
        else:
            return False
    return True


def missing_global_scale(model: ir.Model) -> dict[str, str]:
    """``tensor name -> label of the node that multiplies the global scale back in`` for every tensor of the
    main graph that holds an FP4 value dequantized without its global scale (module docstring). A dequantize
    counts only when every path from it has that shape; with a global scale of exactly 1 in the ``dq`` form
    (the same DQ(s, 1) at the start) nothing downstream is claimed unless the scale is multiplied back in."""
    found: dict[str, str] = {}
    for seed in model.graph:
        if not (_default(seed, "DequantizeLinear") and len(seed.inputs) >= 2 and _is_fp4(seed.inputs[0])
                and _unit_scales(seed.inputs[1])):
            continue
        path: list[str] = []
        appliers: list[str] = []
        if not _walk(seed.outputs[0], path, appliers, False):
            continue
        label = ", ".join(dict.fromkeys(appliers))
        for name in path:
            found.setdefault(name, label)
    return found
