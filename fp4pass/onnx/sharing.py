"""Weights read by several dequantize nodes: converted once, every reader rewritten.

onnxruntime's QDQ tools give each consumer its own DequantizeLinear over the same initializers, and tied
embeddings read one weight twice. :func:`fp4pass.onnx.matching.find_mxfp4` returns one record per reader;
:func:`group_shared` merges the records of one weight (its FP4 codes initializer W):

1. every reader of W (a DequantizeLinear reading it as data) matched, all with the same pattern, the same scale
   initializer, the same axis and block size -> one :class:`SharedFP4Weight`: one conversion, one set of new
   initializers, every reader rewritten (the consumers of all readers together);
2. otherwise (a reader was declined, or reads W with another scale or block) W cannot change for one reader
   and not for the other: every reader is declined, and the reason names the reader in the way.

Scales need no grouping. A scale initializer read by several weights, or by a weight left unconverted, is
only read by the conversions; each converted weight gets its own new scales (in effect a clone), and the old
initializer goes once nothing reads it any more (:mod:`fp4pass.onnx.rewrite_trt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import onnx_ir as ir

from fp4pass.onnx.matching import find_mxfp4
from fp4pass.onnx.patterns import Declined, FP4Weight, node_label, op_label

__all__ = ["SharedFP4Weight", "group_shared", "find_weights", "reader_nodes", "sharing_note"]


@dataclass
class SharedFP4Weight(FP4Weight):
    """An FP4 weight read by several dequantize nodes (``readers``, ``node`` being the first of them)."""

    readers: list[ir.Node] = field(default_factory=list)


def reader_nodes(record: FP4Weight) -> list[ir.Node]:
    """The nodes that read ``record``'s codes and are rewritten with it."""
    return list(record.readers) if isinstance(record, SharedFP4Weight) else [record.node]


def sharing_note(record: FP4Weight) -> str | None:
    """The report's words on a weight read by several dequantize nodes (None for one reader)."""
    readers = reader_nodes(record)
    if len(readers) < 2:
        return None
    return f"read by {len(readers)} dequantize nodes ({', '.join(node_label(n) for n in readers)}), converted once"


def _blocking(node: ir.Node, rank: int) -> tuple:
    axis = node.attributes.get("axis")
    block = node.attributes.get("block_size")
    return ((1 if axis is None else axis.value) % rank, None if block is None else block.value)


def _group_reason(group: list[FP4Weight], declined: list[Declined]) -> str | None:
    """Why the readers of one weight cannot all be rewritten together, or None."""
    first = group[0]
    readers = {id(r.node) for r in group}
    reasons = {d.node: d.reason for d in declined}
    for user, _ in first.codes.uses():
        if id(user) not in readers:
            label = node_label(user)
            why = reasons.get(label)
            return (f"weight {first.name!r} is also read by node {label!r} ({user.op_type}), which is left as it is"
                    + (f" ({why})" if why else ""))
    rank = len(first.shape)
    for other in group[1:]:
        if other.pattern != first.pattern:
            return f"weight {first.name!r} is read as {first.pattern!r} and as {other.pattern!r}"
        if other.scales is not first.scales:
            return (f"weight {first.name!r} is read with two scales, {first.scales.name!r} by node "
                    f"{node_label(first.node)!r} and {other.scales.name!r} by node {node_label(other.node)!r}")
        if _blocking(other.node, rank) != _blocking(first.node, rank):
            return (f"weight {first.name!r} is read with two axis/block sizes, by nodes {node_label(first.node)!r} "
                    f"and {node_label(other.node)!r}")
    return None


def group_shared(records: list[FP4Weight], declined: list[Declined]) -> tuple[list[FP4Weight], list[Declined]]:
    """Merge the records that share one codes initializer (module docstring); returns (records, declined)."""
    groups: dict[int, list[FP4Weight]] = {}
    for record in records:
        groups.setdefault(id(record.codes), []).append(record)
    out: list[FP4Weight] = []
    out_declined = list(declined)
    for group in groups.values():
        if group[0].pattern == "qmoe":  # fc1/fc2 of one node: their own codes, sharing declined by the pattern
            out.extend(group)
            continue
        reason = _group_reason(group, declined)
        if reason:
            out_declined.extend(Declined(r.pattern, node_label(r.node), r.name, reason, op_label(r.node)) for r in group)
            continue
        if len(group) == 1:
            out.append(group[0])
            continue
        first = group[0]
        values = {f.name: getattr(first, f.name) for f in fields(FP4Weight)}
        values["consumers"] = [c for r in group for c in r.consumers]
        out.append(SharedFP4Weight(**values, readers=[r.node for r in group]))
    return out, out_declined


def find_weights(model: ir.Model, model_dir=None) -> tuple[list[FP4Weight], list[Declined]]:
    """:func:`fp4pass.onnx.matching.find_mxfp4` (``model_dir``: where a QMoE layout hint may lie), with the
    readers of one weight merged (module docstring)."""
    return group_shared(*find_mxfp4(model, model_dir))
