"""Finding FP4 weights in an ONNX graph: the MXFP4 patterns fp4pass accepts, and the NVFP4 forms fp4pass writes.

MXFP4 in (one class per pattern; ``check`` returns the reason a node is declined, None when it matches):

1. :class:`MXFP4Dequantize` - ``DequantizeLinear(W FLOAT4E2M1 [.., K], S FLOAT8E8M0 [.., K/32], axis=last,
   block_size=32)``, W and S initializers, rank 2 [N, K] or 3 [E, N, K]. x_hat = e2m1(W) * 2^(S - 127).
2. :class:`QMoEFp4` - ``com.microsoft::QMoE(quant_type='fp4')``: fc1/fc2 weights uint8 in the schema layout
   [E, N, K/2] or the CUDA kernel's [E, K, N/2] (:mod:`fp4pass.onnx.qmoe_layout`), E8M0 scales [E, N, K/32];
   x_hat = e2m1(W) * 2^(S - 127) * fc*_global_scale[e].
3. :class:`GatherBlockQuantizedFp4` - ``com.microsoft::GatherBlockQuantized(W FLOAT4E2M1, idx, S float)`` with
   block_size 32 along the last axis and every scale a power of two (an E8M0 scale stored as float).
4. ``patterns_float.FP4FloatScaleDequantize`` - ``DequantizeLinear-23/24(W FLOAT4E2M1, S FLOAT|FLOAT16|BFLOAT16,
   block_size=32)``, the torch exporter's form: MXFP4 where every scale is a power of two in E8M0's range,
   else FP4 with arbitrary scales (lossy path).
5. ``patterns_float.QuarkMXFakeQuant`` - ``com.amd.quark::MXQuantizeDequantize(W float, element_dtype='fp4_e2m1',
   block_size=32, axis)`` on a linear weight initializer (AMD Quark): W is quantized with Quark's own rule.

Declined only, so that a user learns why they stay (the report names op, reason and what would convert):
:class:`Bnb4Decline` (``MatMulBnb4``, bitsandbytes FP4/NF4) and :class:`GatherBlockQuantizedInt4Decline`
(INT4 ``GatherBlockQuantized``). fp4pass's own NVFP4 output (block-16 FP4 DQ fed by an E4M3 DQ) is skipped.

Each match becomes an :class:`FP4Weight` record (bytes are read later, lazily, from the initializers).
Patterns 4 and 5 (float scales, float weights) live in :mod:`fp4pass.onnx.patterns_float`; the registry and
the walks over a model (:func:`~fp4pass.onnx.matching.find_mxfp4`, which lists the weights and the declines,
and :func:`~fp4pass.onnx.matching.find_fp4_consumers`, the nodes that compute with an FP4 weight: what
activation calibration quantizes) in :mod:`fp4pass.onnx.matching`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fp4pass.formats.constants import E8M0_MAX_EXP, E8M0_MIN_EXP, MS_DOMAIN
from fp4pass.onnx import qmoe_layout
from fp4pass.onnx.passes import constant_tensor

__all__ = [
    "FP4Weight",
    "Declined",
    "Consumer",
    "MXFP4Dequantize",
    "QMoEFp4",
    "GatherBlockQuantizedFp4",
    "Bnb4Decline",
    "GatherBlockQuantizedInt4Decline",
    "node_label",
    "op_label",
    "declined_line",
    "FLOAT_SCALE_TYPES",
    "DeclineOnly",
    "trace_consumers",
    "node_attr",
    "value_dtype",
    "float_scaled",
    "initializer_reason",
    "shared_reason",
    "dq_layout_reason",
    "dequantized_constants_reason",
    "LINEAR_CONSUMERS",
    "PASSTHROUGH_OPS",
]

PASSTHROUGH_OPS = ("Transpose", "Reshape", "Cast")  # allowed between a dequantize and its consumer
LINEAR_CONSUMERS = {"MatMul": 1, "Gemm": 1, "Einsum": None}  # op -> the weight's input index (None: any)
QMOE_WEIGHTS = {"fc1": (2, 3, 15), "fc2": (5, 6, 16)}  # weights, scales, global scale input indices


@dataclass
class Consumer:
    """A node computing with an FP4 weight. ``path`` lists the pass-through nodes between the dequantize and it."""

    node: ir.Node
    weight_input: int
    activation_input: int | None
    path: list[ir.Node] = field(default_factory=list)


@dataclass
class FP4Weight:
    """One MXFP4 weight found in the graph.

    ``codes``/``scales`` are the initializer values (E2M1 packed / E8M0 codes, or float scales for pattern 3);
    ``shape`` the logical [..., K] shape; ``experts`` the leading expert dim for 3-D weights (else None);
    ``slot`` names the weight within its node ("fc1"/"fc2" for QMoE, else "weight"); ``layout`` is the byte
    layout of a QMoE weight as stored ("schema" [E, N, K/2] or "kernel" [E, K, N/2]; None for other patterns)
    and ``layout_reason`` how it was recognised.
    """

    pattern: str
    node: ir.Node
    codes: ir.Value
    scales: ir.Value
    shape: tuple[int, ...]
    slot: str = "weight"
    consumers: list[Consumer] = field(default_factory=list)
    layout: str | None = None
    layout_reason: str | None = None

    @property
    def name(self) -> str:
        return self.codes.name

    @property
    def experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None


@dataclass
class Declined:
    """A node that looked like an FP4 weight pattern but is left as it is, with the reason."""

    pattern: str
    node: str
    tensor: str | None
    reason: str
    op_type: str | None = None  # the node's operator, ``domain::OpType`` outside the default domain

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "node": self.node, "op_type": self.op_type, "tensor": self.tensor,
                "reason": self.reason}

    def describe(self) -> str:
        """One line for a person (:func:`declined_line`)."""
        return declined_line(self.to_json())


def declined_line(entry: dict) -> str:
    """A decline (``Declined.to_json()``) as one line: operator, node, tensor, reason, the pattern's short name last."""
    op = f"{entry['op_type']} " if entry.get("op_type") else ""
    tensor = f" (tensor {entry['tensor']!r})" if entry.get("tensor") else ""
    return f"declined {op}node {entry.get('node')!r}{tensor}: {entry.get('reason')} [pattern {entry.get('pattern')}]"


def op_label(node: ir.Node) -> str:
    """``OpType``, or ``domain::OpType`` for a node outside the default ONNX domain."""
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def value_dtype(value: ir.Value | None) -> ir.DataType | None:
    """A value's type: its stored tensor's (an initializer, or a Constant node, whose output often carries
    no type in a function body), else its declared one."""
    stored = constant_tensor(value)
    if stored is not None:
        return stored.dtype
    return value.dtype if value is not None else None


def node_label(node: ir.Node) -> str:
    """A node's name, or ``OpType -> first output`` when it has none (ONNX allows unnamed nodes)."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs and node.outputs[0] is not None else None
    return f"{node.op_type} -> {out}" if out else node.op_type


def dq_layout_reason(node: ir.Node, w: ir.Value) -> str | None:
    """Why an FP4 DequantizeLinear's stored weight is not laid out as the pass converts it (no zero point,
    rank 2 or 3, blocks along the last axis), with what would make it convertible; None when it is."""
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return (f"weight {w.name!r} has a zero point; MXFP4 has none (drop the input where it is all zeros "
                "to convert it)")
    rank = w.const_value.shape.rank()
    if rank not in (2, 3):
        return (f"weight {w.name!r} has rank {rank}; 2-D [N, K] or 3-D [E, N, K] is supported (store it reshaped "
                "to one of them, with a Reshape after the dequantize)")
    axis = node_attr(node, "axis", 1)
    if axis not in (-1, rank - 1):
        return (f"weight {w.name!r} is blocked along axis {axis}, not the last axis (store it transposed, "
                "blocks along the last axis, with a Transpose after the dequantize)")
    return None


def initializer_reason(value: ir.Value, role: str) -> str | None:
    """Why ``value`` cannot be rewritten as a stored weight, or None when it is a plain initializer."""
    if value.is_graph_input():
        return (f"{role} {value.name!r} is a graph input, not an initializer (the pass rewrites stored weights: "
                "store it in the model as an initializer to convert it)")
    if value.const_value is None:
        return (f"{role} {value.name!r} is computed at run time, not an initializer (fold the computation into a "
                "constant first, e.g. with onnxscript's optimizer, then convert)")
    return None


def shared_reason(value: ir.Value, node: ir.Node, role: str) -> str | None:
    others = [user for user, _ in value.uses() if user is not node]
    if others:
        return f"{role} {value.name!r} is also used by node {node_label(others[0])!r} ({others[0].op_type})"
    if value.is_graph_output():
        return f"{role} {value.name!r} is also a graph output"
    return None


def _constants_reason(node: ir.Node, weight: ir.Value, scale: ir.Value) -> str | None:
    """Why the weight/scale pair of ``node`` is not a rewritable constant pair, or None."""
    for value, role in ((weight, "weight"), (scale, "scale")):
        reason = initializer_reason(value, role) or shared_reason(value, node, role)
        if reason:
            return reason
    return None


def dequantized_constants_reason(node: ir.Node, weight: ir.Value, scale: ir.Value) -> str | None:
    """Like :func:`_constants_reason` for a DequantizeLinear (patterns 1 and 4 alike), where sharing is allowed:

    - the weight may be read by other DequantizeLinear nodes (data input); they are converted together
      (``fp4pass.onnx.sharing``), so any other reader, or the weight being a graph output, declines it;
    - the scale may be read by anything: converted weights get their own new scales, and the old one stays
      for its other readers.
    """
    for value, role in ((weight, "weight"), (scale, "scale")):
        reason = initializer_reason(value, role)
        if reason:
            return reason
    for user, index in weight.uses():
        if user is not node and not (user.domain == "" and user.op_type == "DequantizeLinear" and index == 0):
            return (f"weight {weight.name!r} is also read by node {node_label(user)!r} ({user.op_type}), "
                    f"which is not a dequantize of it")
    if weight.is_graph_output():
        return f"weight {weight.name!r} is also a graph output"
    return None


def node_attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def trace_consumers(value: ir.Value) -> list[Consumer]:
    """Follow ``value`` through Transpose/Reshape/Cast chains to the nodes that compute with it."""
    found: list[Consumer] = []

    def walk(v: ir.Value, path: list[ir.Node]) -> None:
        for user, index in v.uses():
            if user.op_type in PASSTHROUGH_OPS and user.domain == "" and index == 0:
                walk(user.outputs[0], [*path, user])
                continue
            activation = None
            if user.domain == "" and user.op_type in ("MatMul", "Gemm"):
                activation = 1 - index if index in (0, 1) else None
            elif user.domain == "" and user.op_type == "Einsum" and len(user.inputs) == 2:
                activation = 1 - index
            found.append(Consumer(user, index, activation, path))

    walk(value, [])
    return found


class MXFP4Dequantize:
    """Pattern 1: ``DequantizeLinear-24(W FLOAT4E2M1, S FLOAT8E8M0, axis=last, block_size=32)``.

    Math: x_hat[..., i] = e2m1(W[..., i]) * 2^(S[..., i // 32] - 127), converted to the output dtype.
    """

    name = "dq"

    def match(self, node: ir.Node) -> bool:
        return (node.domain == "" and node.op_type == "DequantizeLinear"
                and value_dtype(node.inputs[0]) == ir.DataType.FLOAT4E2M1
                and not float_scaled(node))

    def check(self, node: ir.Node) -> str | None:
        w, s = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if s is None:
            return f"DequantizeLinear of {w.name!r} has no scale"
        reason = dequantized_constants_reason(node, w, s)
        if reason:
            return reason
        if value_dtype(s) != ir.DataType.FLOAT8E8M0:
            return f"scale of {w.name!r} is {value_dtype(s)}, not FLOAT8E8M0 (not MXFP4)"
        reason = dq_layout_reason(node, w)
        if reason:
            return reason
        block = node_attr(node, "block_size", 0)
        if block != 32:
            return f"weight {w.name!r} has block size {block}; MXFP4 needs 32"
        return None

    def records(self, node: ir.Node) -> list[FP4Weight]:
        w, s = node.inputs[0], node.inputs[1]
        return [FP4Weight(self.name, node, w, s, tuple(w.const_value.shape.numpy()),
                          consumers=trace_consumers(node.outputs[0]))]


class QMoEFp4:
    """Pattern 2: ``com.microsoft::QMoE(quant_type='fp4')``, fc1 and fc2 expert weights, in either byte layout.

    Math per expert e: x_hat[e, n, i] = e2m1(c[e, n, i]) * 2^(S[e, n, i // 32] - 127) * fc*_global_scale[e],
    with c the code at (n, i) in the layout :func:`fp4pass.onnx.qmoe_layout.detect` recognises (schema
    [E, N, K/2] or kernel [E, K, N/2]); a node whose layout cannot be told is declined with the reason.
    ``hints``: the model-level evidence used only when the shapes fit both layouts.
    """

    name = "qmoe"

    def __init__(self, hints: qmoe_layout.Hints | None = None) -> None:
        self.hints = hints

    def match(self, node: ir.Node) -> bool:
        return node.domain == MS_DOMAIN and node.op_type == "QMoE" and node_attr(node, "quant_type", "int") == "fp4"

    def check(self, node: ir.Node) -> str | None:
        if len(node.inputs) > 8 and node.inputs[8] is not None:
            return "fc3 weights (unfused SwiGLU) have no global scale input in QMoE 'nvfp4'"
        block = node_attr(node, "block_size", 32)
        if block not in (0, 32):
            return f"block_size {block}; MXFP4 needs 32"
        for slot, (wi, si, gi) in QMOE_WEIGHTS.items():
            w = node.inputs[wi]
            s = node.inputs[si] if len(node.inputs) > si else None
            if s is None:
                return f"{slot} scales are missing"
            if value_dtype(w) != ir.DataType.UINT8 or value_dtype(s) not in (ir.DataType.FLOAT8E8M0, ir.DataType.UINT8):
                return f"{slot} weights/scales are {value_dtype(w)}/{value_dtype(s)}, not uint8 FP4 / E8M0"
            for value, role in ((w, f"{slot} weight"), (s, f"{slot} scale")):
                reason = initializer_reason(value, role) or shared_reason(value, node, role)
                if reason:
                    return reason
            g = node.inputs[gi] if len(node.inputs) > gi else None
            if g is not None:
                reason = initializer_reason(g, f"{slot} global scale") or shared_reason(g, node, f"{slot} global scale")
                if reason:
                    return reason
            if w.const_value.shape.rank() != 3 or s.const_value.shape.rank() != 3:
                return f"{slot} weights and scales must be 3-D ([E, N, K/2] or [E, K, N/2], scales [E, N, K/32])"
        reason = _qmoe_global_scales_reason(node)
        if reason:
            return reason
        detected = qmoe_layout.detect(node, 32, self.hints)
        return None if detected.layout else detected.reason

    def records(self, node: ir.Node) -> list[FP4Weight]:
        detected = qmoe_layout.detect(node, 32, self.hints)
        out = []
        for slot, (wi, si, _) in QMOE_WEIGHTS.items():
            w, s = node.inputs[wi], node.inputs[si]
            e = w.const_value.shape.numpy()[0]
            n, k = detected.dims[slot]
            out.append(FP4Weight(self.name, node, w, s, (e, n, k), slot=slot, consumers=[Consumer(node, wi, 0)],
                                 layout=detected.layout, layout_reason=detected.reason))
        return out


def _qmoe_global_scales_reason(node: ir.Node) -> str | None:
    """Why the ``fc*_global_scale`` inputs (15, 16) of a QMoE 'fp4' node cannot be the per-expert FP32
    multipliers that the rewrite reads (as the prior scale) and replaces (with prior * G), or None.

    Each present one must be FLOAT [E] (E the experts of both weights, at least one), finite, and a value of
    its own: not another input of the node (a weight, its scales, the other global scale).
    """
    experts = {slot: int(node.inputs[wi].const_value.shape[0]) for slot, (wi, _, _) in QMOE_WEIGHTS.items()}
    if experts["fc1"] != experts["fc2"]:
        return f"fc1 has {experts['fc1']} experts, fc2 {experts['fc2']}"
    if experts["fc1"] == 0:
        return "the weights hold zero experts"
    e = experts["fc1"]
    for slot, (_, _, gi) in QMOE_WEIGHTS.items():
        g = node.inputs[gi] if len(node.inputs) > gi else None
        if g is None:
            continue
        role = f"{slot} global scale {g.name!r} (input {gi})"
        also = [i for i, v in enumerate(node.inputs) if v is g and i != gi]
        if also:
            return f"{role} is also input {also[0]} of the node; the global scale must be a tensor of its own"
        if value_dtype(g) != ir.DataType.FLOAT:
            return f"{role} is {value_dtype(g)}, not FLOAT"
        shape = [int(d) for d in g.const_value.shape]
        if shape != [e]:
            return f"{role} has shape {shape}; one FP32 scale per expert, [{e}], is expected"
        values = np.asarray(g.const_value.numpy(), np.float32)
        if not np.isfinite(values).all():
            return f"{role} holds {values[~np.isfinite(values)][0]}; it must be finite"
    return None


def _power_of_two_reason(scale: ir.Value) -> str | None:
    """Why float block scales are not MXFP4 by value, or None when every one is 2^k with k in E8M0's range
    [-127, 127] (the E8M0 code is then k + 127, exactly)."""
    values = np.asarray(scale.const_value.numpy(), np.float32)
    mantissa, exponent = np.frexp(values)
    k = exponent.astype(np.int64) - 1
    bad = ~((mantissa == 0.5) & (k >= E8M0_MIN_EXP) & (k <= E8M0_MAX_EXP))
    if not bad.any():
        return None
    where = [int(i) for i in np.argwhere(bad)[0]]
    return (f"scale {scale.name!r} holds {float(values[tuple(where)])!r} at {where}, not a power of two in E8M0's "
            "range 2^-127..2^127, so the table is not MXFP4 (requantize it with power-of-two block scales to "
            "convert it)")


class GatherBlockQuantizedFp4:
    """Pattern 3: ``com.microsoft::GatherBlockQuantized(W FLOAT4E2M1, idx, S float32)``, block 32, last axis.

    Math: x_hat = e2m1(W) * S, with every S a power of two 2^k (k = E8M0 code - 127, k in [-127, 127]); a
    node with any other scale is declined, naming the scale, and the rest of the model converts.
    """

    name = "gbq"

    def match(self, node: ir.Node) -> bool:
        return (node.domain == MS_DOMAIN and node.op_type == "GatherBlockQuantized"
                and value_dtype(node.inputs[0]) == ir.DataType.FLOAT4E2M1)

    def check(self, node: ir.Node) -> str | None:
        w, s = node.inputs[0], node.inputs[2]
        reason = _constants_reason(node, w, s)
        if reason:
            return reason
        if value_dtype(s) != ir.DataType.FLOAT:
            return f"scale {s.name!r} is {value_dtype(s)}; float32 scales are supported"
        rank = w.const_value.shape.rank()
        if rank not in (2, 3):
            return f"weight {w.name!r} has rank {rank}"
        if node_attr(node, "quantize_axis", 1) not in (-1, rank - 1):
            return f"weight {w.name!r} is blocked along a non-last axis"
        block = node_attr(node, "block_size", 128)
        if block != 32:
            return f"weight {w.name!r} has block size {block}; MXFP4 needs 32"
        if tuple(s.const_value.shape.numpy())[:-1] != tuple(w.const_value.shape.numpy())[:-1]:
            return f"scale {s.name!r} broadcasts; one scale per block is supported"
        return _power_of_two_reason(s)

    def records(self, node: ir.Node) -> list[FP4Weight]:
        w, s = node.inputs[0], node.inputs[2]
        return [FP4Weight(self.name, node, w, s, tuple(w.const_value.shape.numpy()),
                          consumers=[Consumer(node, 0, None)])]

FLOAT_SCALE_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def float_scaled(node: ir.Node) -> bool:
    """An FP4 DequantizeLinear whose scale input is FLOAT/FLOAT16/BFLOAT16 (pattern 4, or fp4pass's NVFP4 output)."""
    return len(node.inputs) > 1 and value_dtype(node.inputs[1]) in FLOAT_SCALE_TYPES


class DeclineOnly:
    """FP4-looking ops that are not OCP FP4 (or not FP4 at all): matched only to say why they are left alone."""

    def records(self, node: ir.Node) -> list[FP4Weight]:
        return []


class Bnb4Decline(DeclineOnly):
    """``com.microsoft::MatMulBnb4``: bitsandbytes 4-bit (FP4 or NF4), onnxruntime's quantization tools."""

    name = "bnb4"

    def match(self, node: ir.Node) -> bool:
        return node.domain == MS_DOMAIN and node.op_type == "MatMulBnb4"

    def tensor(self, node: ir.Node) -> str | None:
        return node.inputs[1].name if len(node.inputs) > 1 and node.inputs[1] is not None else None

    def check(self, node: ir.Node) -> str | None:
        kind = {0: "FP4", 1: "NF4"}.get(node_attr(node, "quant_type", -1), "4-bit")
        return (f"bitsandbytes {kind} (MatMulBnb4): its own 4-bit code book with one float absmax per block, "
                "not OCP E2M1 with power-of-two scales; export the weight as MXFP4 "
                "(DequantizeLinear FLOAT4E2M1 + FLOAT8E8M0, block 32) to convert it")


class GatherBlockQuantizedInt4Decline(DeclineOnly):
    """``com.microsoft::GatherBlockQuantized`` over INT4/UINT4 (or uint8-packed 4-bit) integer data."""

    name = "gbq_int4"

    def match(self, node: ir.Node) -> bool:
        return (node.domain == MS_DOMAIN and node.op_type == "GatherBlockQuantized"
                and value_dtype(node.inputs[0]) != ir.DataType.FLOAT4E2M1)

    def check(self, node: ir.Node) -> str | None:
        return (f"{value_dtype(node.inputs[0])} data with bits={node_attr(node, 'bits', 4)}: integer 4-bit "
                "quantization, "
                "not FP4; export the table as FLOAT4E2M1 with power-of-two block-32 scales to convert it")
