"""Which float type a graph computes in at a given value, for rewrites that must write nodes of that type.

An FP4 weight's dequantize writes its ``output_dtype`` (FLOAT, FLOAT16 or BFLOAT16; else the scale's type),
and the consumer computes in that type after any Cast on the way. Intermediate values of a model loaded
from a file often carry no type (no value_info), so :func:`value_dtype` derives it from the producers:

1. a value with a known type: that type;
2. ``Cast``: its ``to``; ``DequantizeLinear``: :func:`dequantize_dtype`;
3. ops whose output type is their first input's (Transpose, Reshape, Relu, MatMul, ...): that input's type;
4. anything else: unknown (None).

The NVFP4 scales themselves stay FLOAT in every graph (FP32 global scale, E4M3 x FP32 products): the
16-bit types cannot hold them exactly (the global scale of a small weight is 2^-20 and less: FLOAT16
subnormal or zero).
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["FLOAT_TYPES", "dequantize_dtype", "value_dtype"]

FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

# ops whose output 0 has the type of input 0 (standard domain)
_SAME_TYPE_OPS = frozenset({
    "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice", "Gather",
    "Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Gelu", "Softmax", "Mul", "Add", "Sub", "Div", "MatMul", "Gemm",
    "Einsum", "LayerNormalization", "RMSNormalization", "Concat", "Split",
})


def dequantize_dtype(node: ir.Node) -> ir.DataType:
    """Output type of a DequantizeLinear: ``output_dtype`` if set, else the scale's type, else FLOAT."""
    attr = node.attributes.get("output_dtype")
    if attr is not None and attr.value:
        return ir.DataType(attr.value)
    if node.outputs[0].dtype is not None:
        return node.outputs[0].dtype
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    if scale is not None and scale.dtype in FLOAT_TYPES:
        return scale.dtype
    return ir.DataType.FLOAT


def value_dtype(value: ir.Value | None, _depth: int = 0) -> ir.DataType | None:
    """The element type of ``value`` (module docstring); None when it cannot be told."""
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    producer = value.producer()
    if producer is None or producer.domain != "" or _depth > 64:
        return None
    if producer.op_type == "Cast":
        return ir.DataType(producer.attributes["to"].value)
    if producer.op_type == "DequantizeLinear":
        return dequantize_dtype(producer)
    if producer.op_type in _SAME_TYPE_OPS and producer.inputs:
        return value_dtype(producer.inputs[0], _depth + 1)
    return None
