"""Which activations NVFP4 can quantize: an activation is blocked (16 values per E4M3 scale) along its last axis,
so its consumer must reduce over that axis. Used by the calibration (targets) and by the activation pass.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["activation_axis_reason", "einsum_contracts_last"]


def _einsum_contracts_last(node: ir.Node, activation_input: int) -> bool:
    attr = node.attributes.get("equation")
    if attr is None:
        return False
    return einsum_contracts_last(attr.value, activation_input)


def einsum_contracts_last(equation: str, activation_input: int) -> bool:
    """Whether the two-operand einsum ``equation`` contracts the last axis of operand ``activation_input``."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "..." in equation.split("->")[0].split(",")[activation_input][-1:]:
        return False
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or not terms[activation_input]:
        return False
    last = terms[activation_input][-1]
    return last in terms[1 - activation_input] and last not in out


def activation_axis_reason(node: ir.Node, activation_input: int) -> str | None:
    """Why this consumer's activation is not blocked along its last axis (None when it is)."""
    op = node.op_type
    if op == "Gemm":
        trans_a = node.attributes.get("transA")
        if activation_input != 0 or (trans_a is not None and trans_a.value):
            return "Gemm activation is transposed (reduction axis is not its last)"
    elif op == "MatMul" and activation_input != 0:
        return "MatMul activation is input B (reduction axis is not its last)"
    elif op == "Einsum" and not _einsum_contracts_last(node, activation_input):
        return "Einsum does not contract the activation's last axis"
    return None
