"""Where an NVFP4 global scale can leave the weight and multiply the consumer's output (the ``alpha`` form).

For a consumer linear in the weight, ``x @ (W * G)^T = (x @ W^T) * G``: the dequantize then needs the
E2M1 x E4M3 product only, and G (FP32, one per expert) scales the matmul's output, where a Blackwell
kernel applies it as its alpha. :func:`alpha_plan` follows each use of the dequantized weight through
layout-only ops (transpose, t, permute, expand, contiguous, clone, alias) to a consumer:

1. ``linear(x, W, b)``: W 2-D, G scalar: ``linear(x, W) * G + b`` (the bias stays out of the scaling);
2. ``mm``: both 2-D, G scalar;
3. ``bmm`` / ``matmul``: the weight's expert axis must be a batch axis of the product; G [E] is reshaped to
   [E, 1, ..., 1] so that it broadcasts over that axis of the output.

It declines, with the reason, when a node on the way has another reader, a consumer is anything else, the
consumer's output is not float32 (G would be rounded to a narrower type), or the weight has more than one
group axis. The caller then writes the ``dq`` form.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

__all__ = ["AlphaUse", "alpha_plan"]

aten = torch.ops.aten

_TRANSPOSE = {aten.transpose.int, torch.transpose, "transpose", "swapaxes", torch.swapaxes}
_T = {aten.t.default, torch.t, "t"}
_PERMUTE = {aten.permute.default, torch.permute, "permute"}
_EXPAND = {aten.expand.default, "expand"}
_SAME = {aten.contiguous.default, aten.clone.default, aten.alias.default, "contiguous", "clone", torch.clone}
_LINEAR = {aten.linear.default, torch.nn.functional.linear, torch._C._nn.linear}
_MM = {aten.mm.default, torch.mm, "mm"}
_BMM = {aten.bmm.default, torch.bmm, "bmm"}
_MATMUL = {aten.matmul.default, torch.matmul, operator.matmul, "matmul"}


@dataclass
class AlphaUse:
    """One consumer of the weight: multiply its output by G reshaped to ``shape``; ``bias`` moves after it."""

    consumer: torch.fx.Node
    shape: list[int]
    bias: torch.fx.Node | None = None


def _key(node: torch.fx.Node):
    if node.op == "call_method":
        return node.target
    return node.target if node.op == "call_function" else None


def _is(node: torch.fx.Node, kinds: set) -> bool:
    key = _key(node)
    try:
        return key in kinds
    except TypeError:  # unhashable target
        return False


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _step(node: torch.fx.Node, rank: int, axis: int | None) -> tuple[int, int | None] | str:
    """(rank, expert axis) after a layout op, or the reason it is not one."""
    args = node.args
    if _is(node, _SAME):
        return rank, axis
    if _is(node, _T):
        return rank, (None if axis is None else 1 - axis) if rank == 2 else axis
    if _is(node, _TRANSPOSE):
        d0, d1 = (_dim(int(d), rank) for d in args[1:3])
        if axis is None:
            return rank, None
        return rank, d1 if axis == d0 else d0 if axis == d1 else axis
    if _is(node, _PERMUTE):
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        dims = [_dim(int(d), rank) for d in dims]
        return rank, None if axis is None else dims.index(axis)
    if _is(node, _EXPAND):
        sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        new_rank = len(sizes)
        return new_rank, None if axis is None else axis + new_rank - rank
    name = getattr(node.target, "__name__", str(node.target))
    return f"{name} ({node.name}) between the weight and its consumer is not a layout op"


def _consumer(node: torch.fx.Node, operand: torch.fx.Node, rank: int, axis: int | None,
              experts: int | None) -> AlphaUse | str:
    """The multiplier's shape for consumer ``node`` reading the weight as ``operand``, or a reason."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != torch.float32:
        return f"consumer {node.name} computes in {val.dtype}; the alpha form needs float32"
    args = list(node.args)
    positions = [i for i, a in enumerate(args[:2]) if a is operand]
    if len(positions) != 1:
        return f"consumer {node.name} reads the weight in a position that is not a matmul operand"
    if _is(node, _LINEAR):
        if positions != [1] or rank != 2:
            return f"consumer {node.name} (linear) does not read the weight as its 2-D weight"
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        return AlphaUse(node, [], bias if isinstance(bias, torch.fx.Node) else None)
    if axis is None:
        if _is(node, _MM) or _is(node, _BMM) or _is(node, _MATMUL):
            return AlphaUse(node, [])
    elif _is(node, _BMM) or _is(node, _MATMUL):
        if rank < 3 or axis > rank - 3:
            return f"consumer {node.name}: the expert axis is a matrix axis of the product, not a batch axis"
        return AlphaUse(node, [experts] + [1] * (rank - axis - 1))
    name = getattr(node.target, "__name__", str(node.target))
    return f"consumer {node.name} ({name}) is not a linear op of the weight"


def alpha_plan(dequant: torch.fx.Node, rank: int, group_dims: int, experts: int | None) -> list[AlphaUse] | str:
    """Every consumer of ``dequant``'s output with the shape of its multiplier, or why the alpha form fails.

    ``rank``: the weight's rank; ``group_dims``: leading axes with their own global scale (0 or 1).
    """
    if group_dims > 1:
        return "more than one group axis: no single output axis carries the global scale"
    if not dequant.users:
        return "the dequantized weight has no reader"
    uses = []
    for user in dequant.users:
        node, operand, r, axis = user, dequant, rank, (0 if group_dims == 1 else None)
        while True:
            if node.op == "output":
                return "the dequantized weight (or a view of it) is a graph output"
            step = _step(node, r, axis) if not (_is(node, _LINEAR) or _is(node, _MM) or _is(node, _BMM)
                                               or _is(node, _MATMUL)) else None
            if step is None:
                use = _consumer(node, operand, r, axis, experts)
                if isinstance(use, str):
                    return use
                uses.append(use)
                break
            if isinstance(step, str):
                return step
            if len(node.users) != 1:
                return f"{node.name}, a view of the weight, has {len(node.users)} readers"
            r, axis = step
            operand, node = node, next(iter(node.users))
    return uses
