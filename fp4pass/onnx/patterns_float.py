"""MXFP4 patterns 4 and 5 of :mod:`fp4pass.onnx.patterns`: FP4 codes under float scales, and float weights
that AMD Quark fake-quantizes to MXFP4.

4. :class:`FP4FloatScaleDequantize` - ``DequantizeLinear-23/24(W FLOAT4E2M1, S FLOAT|FLOAT16|BFLOAT16,
   block_size=32)``, the torch exporter's form: MXFP4 where every scale is a power of two in E8M0's range,
   else FP4 with arbitrary scales (lossy path).
5. :class:`QuarkMXFakeQuant` - ``com.amd.quark::MXQuantizeDequantize(W float, element_dtype='fp4_e2m1',
   block_size=32, axis)`` on a linear weight initializer: W is quantized with Quark's own rule, into a
   :class:`QuarkWeight` record.

They share the records, labels and reasons of :mod:`fp4pass.onnx.patterns`; the registry that runs every
pattern is :data:`fp4pass.onnx.matching.PATTERNS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fp4pass.formats.constants import QUARK_DOMAIN
from fp4pass.onnx.patterns import (FLOAT_SCALE_TYPES, LINEAR_CONSUMERS, FP4Weight, dequantized_constants_reason,
                                   dq_layout_reason, float_scaled, initializer_reason, node_attr, shared_reason,
                                   trace_consumers, value_dtype)

__all__ = ["FP4FloatScaleDequantize", "QuarkMXFakeQuant", "QuarkWeight", "quark_constant", "quark_fp4", "QUARK_MX_OP",
           "QUARK_FP4"]

QUARK_MX_OP = "MXQuantizeDequantize"
QUARK_FP4 = "fp4_e2m1"


class FP4FloatScaleDequantize:
    """Pattern 4: ``DequantizeLinear-23/24(W FLOAT4E2M1, S FLOAT|FLOAT16|BFLOAT16, axis=last, block_size=32)``.

    The torch exporter's form (torch 2.13 ``torch.onnx.export(dynamo=True)`` has no E8M0 type, so a
    ``torch.onnx.ops.symbolic("DequantizeLinear", ...)`` on a float4_e2m1fn_x2 buffer carries float scales).
    Math: x_hat[..., i] = e2m1(W[..., i]) * S[..., i // 32], one multiply in the scale's float type.

    Where every S is a power of two 2^k with k in [-127, 127] (or 0 over a block whose codes are all ±0), it
    is MXFP4 by value: E8M0 code k + 127 (0 for the zero scales), converted exactly as pattern 1. Otherwise
    it is FP4 with arbitrary block scales, converted through the lossy path (:mod:`fp4pass.convert.scaled`),
    and the report says so. FP4 DequantizeLinear at block 16 whose scale is fp4pass's own ``DQ(E4M3, G)`` is
    NVFP4 already and is neither matched nor declined.
    """

    name = "dq_float"

    def match(self, node: ir.Node) -> bool:
        return (node.domain == "" and node.op_type == "DequantizeLinear"
                and value_dtype(node.inputs[0]) == ir.DataType.FLOAT4E2M1 and float_scaled(node))

    def check(self, node: ir.Node) -> str | None:
        w, s = node.inputs[0], node.inputs[1]
        reason = dequantized_constants_reason(node, w, s)
        if reason:
            return reason
        reason = dq_layout_reason(node, w)
        if reason:
            return reason
        block = node_attr(node, "block_size", 0)
        if block != 32:
            fix = ("store its block scales as FLOAT8E4M3FN with an FP32 global scale (NVFP4's two-DQ form)"
                   if block == 16 else "requantize it with blocks of 32 along the last axis")
            return f"weight {w.name!r} has block size {block} with float scales; FP4 converts at block 32 only ({fix})"
        shape = tuple(w.const_value.shape.numpy())
        if tuple(s.const_value.shape.numpy()) != (*shape[:-1], shape[-1] // 32) or shape[-1] % 32:
            return (f"scale {s.name!r} has shape {list(s.const_value.shape.numpy())}, "
                    f"expected {[*shape[:-1], shape[-1] // 32]} for weight {list(shape)}")
        return None

    def records(self, node: ir.Node) -> list[FP4Weight]:
        w, s = node.inputs[0], node.inputs[1]
        return [FP4Weight(self.name, node, w, s, tuple(w.const_value.shape.numpy()),
                          consumers=trace_consumers(node.outputs[0]))]


@dataclass
class QuarkWeight(FP4Weight):
    """A float weight under Quark's MX fake-quant, quantized to MXFP4 (``codes``/``scales`` are new values not
    yet in the graph). ``source`` is the float initializer; ``perm`` the axis swap that brings Quark's block
    axis last (None when it is last already): codes are stored permuted and a Transpose restores the layout."""

    source: ir.Value | None = None
    perm: list[int] | None = None


def quark_fp4(node: ir.Node) -> bool:
    element = node_attr(node, "element_dtype", "")
    if isinstance(element, bytes):
        element = element.decode()
    return node.domain == QUARK_DOMAIN and node.op_type == QUARK_MX_OP and element == QUARK_FP4


def quark_constant(node: ir.Node) -> bool:
    """A Quark FP4 fake-quant whose input is a stored constant (weight or bias), not an activation."""
    x = node.inputs[0] if node.inputs else None
    return quark_fp4(node) and x is not None and not x.is_graph_input() and x.const_value is not None


def _linear_weight(value: ir.Value) -> bool:
    consumers = trace_consumers(value)
    return bool(consumers) and all(c.node.domain == "" and c.node.op_type in LINEAR_CONSUMERS
                                   and c.activation_input is not None for c in consumers)


class QuarkMXFakeQuant:
    """Pattern 5: ``com.amd.quark::MXQuantizeDequantize(W, element_dtype='fp4_e2m1', block_size=32, axis)`` on a
    float weight initializer that MatMul / Gemm / Einsum read as their weight (AMD Quark ``quark.onnx``).

    Quark's rule (its ``mx_kernel.cc`` / ``funcs.cuh``, amd-quark 0.13): the block exponent is the largest
    float32 exponent in the block minus E2M1's emax 2, k = floor(log2(amax)) - 2 (OCP's rule, ``ScaleRule.FLOOR``),
    and each x / 2^k is rounded to nearest, ties to even, on the E2M1 grid, saturating at ±6. The weight is
    quantized so, its block axis moved last, then converted to NVFP4 like any MXFP4 weight; the fake-quant
    node is dropped. Biases and other constants under the fake-quant are folded (:mod:`rewrite_quark`), and
    activations are left to the activation step.
    """

    name = "quark"

    def match(self, node: ir.Node) -> bool:
        return quark_constant(node) and node.inputs[0].const_value.shape.rank() >= 2 and _linear_weight(node.outputs[0])

    def check(self, node: ir.Node) -> str | None:
        w = node.inputs[0]
        reason = initializer_reason(w, "weight") or shared_reason(w, node, "weight")
        if reason:
            return reason
        if value_dtype(w) not in FLOAT_SCALE_TYPES:
            return f"weight {w.name!r} is {value_dtype(w)}, not a float type"
        shape = tuple(w.const_value.shape.numpy())
        rank = len(shape)
        if rank not in (2, 3):
            return f"weight {w.name!r} has rank {rank}; 2-D or 3-D is supported"
        block = node_attr(node, "block_size", 32)
        if block != 32:
            return f"weight {w.name!r} has MX block size {block}; MXFP4 needs 32 (re-run Quark with block_size 32)"
        axis = node_attr(node, "axis", 1)
        if not -rank <= axis < rank:
            return f"weight {w.name!r}: axis {axis} is out of range for rank {rank}"
        if shape[axis] % 32:
            return f"weight {w.name!r}: dim {shape[axis]} along the block axis {axis} is not a multiple of 32"
        if rank == 3 and axis % rank == 0:
            return f"weight {w.name!r} is blocked along the expert axis 0"
        return None

    def records(self, node: ir.Node) -> list[FP4Weight]:
        from fp4pass.onnx.quark_mx import quantize_weight

        w = node.inputs[0]
        rank = w.const_value.shape.rank()
        axis = node_attr(node, "axis", 1) % rank
        perm = None
        if axis != rank - 1:
            perm = list(range(rank))
            perm[axis], perm[-1] = perm[-1], perm[axis]
        codes, scales, shape = quantize_weight(w, perm)
        return [QuarkWeight(self.name, node, codes, scales, shape, consumers=trace_consumers(node.outputs[0]),
                            source=w, perm=perm)]
