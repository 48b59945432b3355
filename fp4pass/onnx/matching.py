"""Matching a whole ONNX model: every MXFP4 pattern of :mod:`fp4pass.onnx.patterns` and
:mod:`fp4pass.onnx.patterns_float`, in the order tried (:data:`PATTERNS`), over the main graph, its subgraphs
and its local functions' bodies.

:func:`find_mxfp4` lists the weights to convert and the near-misses with their reason (a weight inside a
function body is declined: :func:`function_reason`); fp4pass's own NVFP4 output (block-16 FP4 DQ fed by an
E4M3 DQ) is skipped. :func:`find_fp4_consumers` lists the nodes that compute with an FP4 weight, in the input
(MXFP4) or the output (NVFP4) forms, with the index of their activation input: what activation calibration
quantizes.
"""

from __future__ import annotations

import onnx_ir as ir

from fp4pass.formats.constants import MS_DOMAIN
from fp4pass.onnx import qmoe_layout
from fp4pass.onnx.passes import all_nodes, function_graphs, function_label, function_of
from fp4pass.onnx.patterns import (LINEAR_CONSUMERS, Bnb4Decline, DeclineOnly, Declined, FP4Weight,
                                   GatherBlockQuantizedFp4, GatherBlockQuantizedInt4Decline, MXFP4Dequantize, QMoEFp4,
                                   node_attr, node_label, op_label, trace_consumers, value_dtype)
from fp4pass.onnx.patterns_float import FP4FloatScaleDequantize, QuarkMXFakeQuant

__all__ = ["PATTERNS", "find_mxfp4", "find_fp4_consumers", "function_reason"]


PATTERNS = (MXFP4Dequantize(), QMoEFp4(), GatherBlockQuantizedFp4(), FP4FloatScaleDequantize(), QuarkMXFakeQuant(),
            Bnb4Decline(), GatherBlockQuantizedInt4Decline())


def _all_nodes(model: ir.Model):
    """Every node: main graph, subgraphs, function bodies (:func:`fp4pass.onnx.passes.all_nodes`)."""
    return all_nodes(model)


def function_reason(function: ir.Function) -> str:
    """Why a weight pattern inside ``function``'s body is declined, and what would make it convertible."""
    return (f"inside function {function_label(function)}: a function body holds no initializers, so the NVFP4 "
            "codes and scales have nowhere to be stored; inline the function "
            "(onnx.inliner.inline_local_functions) and lift its Constant nodes to initializers "
            "(onnx_ir.passes.common.LiftConstantsToInitializersPass(size_limit=0)), then convert")


def find_mxfp4(model: ir.Model, model_dir=None) -> tuple[list[FP4Weight], list[Declined]]:
    """Every MXFP4 weight pattern in ``model`` (subgraphs and function bodies included), and the near-misses
    with their reason. A weight pattern inside a local function's body is declined (:func:`function_reason`).

    ``model_dir``: the model's folder, where a ``genai_config.json`` tells an ambiguous QMoE layout.
    """
    found: list[FP4Weight] = []
    declined: list[Declined] = []
    hints = qmoe_layout.Hints.of(model, model_dir)
    patterns = tuple(QMoEFp4(hints) if isinstance(p, QMoEFp4) else p for p in PATTERNS)
    owners = function_graphs(model)
    for node in _all_nodes(model):
        if _is_nvfp4_dq(node):  # fp4pass's own NVFP4 output: nothing to convert, nothing to decline
            continue
        function = function_of(node, owners)
        for pattern in patterns:
            if not pattern.match(node):
                continue
            try:
                reason = pattern.check(node)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
                # a malformed node: declined with its reason, the others still convert
                reason = f"malformed node ({type(exc).__name__}: {exc})"
            if function is not None:
                reason = (f"inside function {function_label(function)}: {reason}" if isinstance(pattern, DeclineOnly)
                          else function_reason(function))
            if reason is None:
                found.extend(pattern.records(node))
            else:
                tensor = node.inputs[0].name if node.inputs and node.inputs[0] is not None else None
                if pattern.name == "qmoe":
                    tensor = node.inputs[2].name if len(node.inputs) > 2 and node.inputs[2] is not None else None
                if hasattr(pattern, "tensor"):
                    tensor = pattern.tensor(node)
                declined.append(Declined(pattern.name, node_label(node), tensor, reason, op_label(node)))
            break
    return found, declined


def _is_nvfp4_dq(node: ir.Node) -> bool:
    """``DQ(W FLOAT4E2M1, s, block_size=16)`` whose scale comes from ``DQ(S FLOAT8E4M3FN, G)`` (fp4pass's output)."""
    if not (node.domain == "" and node.op_type == "DequantizeLinear"
            and value_dtype(node.inputs[0]) == ir.DataType.FLOAT4E2M1):
        return False
    scale_producer = node.inputs[1].producer() if len(node.inputs) > 1 and node.inputs[1] is not None else None
    return (node_attr(node, "block_size", 0) == 16 and scale_producer is not None
            and scale_producer.op_type == "DequantizeLinear"
            and value_dtype(scale_producer.inputs[0]) == ir.DataType.FLOAT8E4M3FN)


def find_fp4_consumers(model: ir.Model) -> list[tuple[ir.Node, int, FP4Weight | ir.Value]]:
    """Nodes that compute with an FP4 weight: ``(node, activation_input_index, weight)``.

    Covers MatMul/Gemm/Einsum fed (through Transpose/Reshape/Cast) by an MXFP4 dequantize (pattern 1) or by the
    NVFP4 two-DQ form fp4pass writes, and QMoE nodes with quant_type 'fp4' or 'nvfp4' (activation input 0).
    ``weight`` is the :class:`FP4Weight` for MXFP4 inputs, else the FP4 codes value. Nodes where the weight
    is not a MatMul/Gemm/Einsum operand (e.g. a Gather of an embedding) are not listed.
    """
    result: list[tuple[ir.Node, int, FP4Weight | ir.Value]] = []
    seen: set[int] = set()

    def add(node, act, weight):
        if id(node) not in seen and act is not None:
            seen.add(id(node))
            result.append((node, act, weight))

    mx_patterns = (PATTERNS[0], FP4FloatScaleDequantize())
    for node in _all_nodes(model):
        mx_pattern = next((p for p in mx_patterns if p.match(node)), None)
        if mx_pattern is not None and not _is_nvfp4_dq(node) and mx_pattern.check(node) is None:
            for record in mx_pattern.records(node):
                for c in record.consumers:
                    if c.node.op_type in LINEAR_CONSUMERS and c.node.domain == "":
                        add(c.node, c.activation_input, record)
        elif _is_nvfp4_dq(node):
            for c in trace_consumers(node.outputs[0]):
                if c.node.op_type in LINEAR_CONSUMERS and c.node.domain == "":
                    add(c.node, c.activation_input, node.inputs[0])
        elif (node.domain == MS_DOMAIN and node.op_type == "QMoE"
              and node_attr(node, "quant_type", "int") in ("fp4", "nvfp4")):
            add(node, 0, node.inputs[2])
    return result
