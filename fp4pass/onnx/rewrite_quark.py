"""AMD Quark's MX fake-quant ``com.amd.quark::MXQuantizeDequantize(element_dtype='fp4_e2m1')`` -> plain ONNX.

Quark (``quark.onnx`` 0.13, ``MXFP4E2M1`` config) puts one such node on every float weight, bias and
activation. Its rule, read from Quark's kernel (``mx_kernel.cc``, ``funcs.cuh``), for a block of 32 values
along ``axis`` (the tensor is zero-padded to a multiple of the block, which leaves amax unchanged)::

    k     = E(amax) - 2                  E(v): the unbiased float32 exponent field of v, i.e. floor(log2 v)
    y[i]  = 2^k * rne_e2m1(x[i] / 2^k)   round to nearest, ties to even, saturating at ±6

That is OCP's scale rule, :attr:`fp4pass.formats.ScaleRule.FLOOR`, with E2M1 round-half-even, which is what
``MXFP4Tensor.quantize(x, 32, ScaleRule.FLOOR)`` computes. Two corners differ and are outside any real
weight: Quark reads a float32 subnormal amax as exponent -127 and lets k go below -127 (blocks with
amax < 2^-125); fp4pass clamps k to E8M0's -127. Inputs in FLOAT16/BFLOAT16 are computed in float32, as Quark's
kernel casts them.

1. weights (pattern 5, :class:`fp4pass.onnx.patterns_float.QuarkMXFakeQuant`): :func:`quantize_weight` gives the
   MXFP4 codes and E8M0 scales (block axis moved last), :func:`materialize_weight` replaces the fake-quant by
   ``DequantizeLinear(codes, scales, axis=-1, block_size=32)`` (+ a Transpose back when Quark blocked another
   axis), which the NVFP4 rewrite of pattern 1 then converts. The float weight initializer is removed.
2. other constants (biases): :func:`fold_constants` replaces the fake-quant and its input by one initializer
   holding the exact fake-quantized values (named after the node's output).
3. activations: :func:`remove_activation_fake_quants` drops them when calibrated NVFP4 activation quantizers
   take over (``convert --calib``); without it they stay, and running the model then needs Quark's custom-op
   library (:func:`activation_fake_quants` lists them for the report).
"""

from __future__ import annotations

import onnx_ir as ir

from fp4pass.formats import MX_BLOCK_SIZE
from fp4pass.onnx.quark_mx import QUARK_SCALE_RULE, float32_constant, quantize_weight, quark_fake_quant, quark_mxfp4  # noqa: F401
from fp4pass.formats.constants import QUARK_DOMAIN
from fp4pass.onnx.patterns import Declined, node_label, op_label, trace_consumers
from fp4pass.onnx.patterns_float import QuarkWeight, quark_fp4, quark_constant

__all__ = [
    "QUARK_SCALE_RULE",
    "quark_mxfp4",
    "quark_fake_quant",
    "quantize_weight",
    "materialize_weight",
    "fold_constants",
    "fold_reason",
    "activation_fake_quants",
    "activation_declines",
    "remove_activation_fake_quants",
    "drop_unused_quark_opset",
]

def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _replace_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Every reader of ``old`` (graph outputs included) reads ``new``, which then takes ``old``'s name."""
    for user, index in list(old.uses()):
        user.replace_input_with(index, new)
    for i, out in enumerate(graph.outputs):
        if out is old:
            graph.outputs[i] = new
    name = old.name
    old.name = f"{name}__fp4pass_replaced"
    new.name = name


def materialize_weight(record: QuarkWeight) -> None:
    """Case 1: the fake-quant node becomes ``DQ(codes, scales, axis=-1, block_size=32)`` [-> Transpose].

    ``record.node`` and ``record.consumers`` then describe that DequantizeLinear, as for pattern 1.
    """
    node = record.node
    graph = node.graph
    source = record.source
    out_dtype = source.const_value.dtype
    graph.initializers.pop(source.name, None)
    graph.register_initializer(record.codes)
    graph.register_initializer(record.scales)
    attrs = {"axis": -1, "block_size": MX_BLOCK_SIZE}
    if out_dtype != ir.DataType.FLOAT:
        attrs["output_dtype"] = out_dtype
    dq = ir.node("DequantizeLinear", [record.codes, record.scales], attributes=attrs, name=f"{node_label(node)}/dq")
    dq.outputs[0].type = ir.TensorType(out_dtype)
    dq.outputs[0].shape = ir.Shape(list(record.shape))
    new_nodes = [dq]
    final = dq.outputs[0]
    if record.perm is not None:
        transpose = ir.node("Transpose", [final], attributes={"perm": record.perm}, name=f"{node_label(node)}/transpose")
        final = transpose.outputs[0]
        final.type = ir.TensorType(out_dtype)
        final.shape = ir.Shape(list(source.const_value.shape.numpy()))
        new_nodes.append(transpose)
    dq.outputs[0].name = f"{record.name}_dequantized"
    graph.insert_before(node, new_nodes)
    _replace_output(graph, node.outputs[0], final)
    graph.remove(node, safe=True)
    record.node = dq
    record.consumers = trace_consumers(dq.outputs[0])


def fold_reason(node: ir.Node) -> str | None:
    """Why a Quark FP4 fake-quant on a constant cannot be folded (its attributes make no MX block), or None."""
    x = node.inputs[0]
    rank = x.const_value.shape.rank()
    axis = _attr(node, "axis", 1)
    block = _attr(node, "block_size", MX_BLOCK_SIZE)
    if rank and (not isinstance(axis, int) or not -rank <= axis < rank):  # a scalar is one block whatever axis
        return f"Quark MX fake-quant on {x.name!r}: axis {axis!r} is out of range for rank {rank}; left as it is"
    if not isinstance(block, int) or block <= 0:
        return f"Quark MX fake-quant on {x.name!r}: block_size {block!r} is not a positive integer; left as it is"
    if x.const_value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return f"Quark MX fake-quant on {x.name!r}: {x.const_value.dtype} is not a float type; left as it is"
    return None


def fold_constants(model: ir.Model, declined: list[Declined] | None = None) -> list[dict]:
    """Case 2: every Quark FP4 fake-quant left on a constant is folded into its exact values (report entries).

    One whose attributes make no MX block (:func:`fold_reason`) stays, and is appended to ``declined`` unless
    that node is declined there already (as a weight)."""
    entries = []
    for graph in model.graphs():
        for node in list(graph):
            if not quark_constant(node):
                continue
            x = node.inputs[0]
            reason = fold_reason(node)
            if reason is not None:
                label = node_label(node)
                if declined is not None and not any(d.node == label for d in declined):
                    declined.append(Declined("quark", label, x.name, reason, op_label(node)))
                continue
            axis = _attr(node, "axis", 1)
            block = _attr(node, "block_size", MX_BLOCK_SIZE)
            values = quark_fake_quant(float32_constant(x), axis, block, name=x.name)
            dtype = x.const_value.dtype
            out = node.outputs[0]
            name = out.name
            out.name = f"{name}__fp4pass_replaced"
            tensor = ir.Tensor(values.astype(ir.DataType(dtype).numpy()), name=name)
            folded = ir.Value(name=name, const_value=tensor, shape=ir.Shape(list(values.shape)),
                              type=ir.TensorType(dtype))
            graph.register_initializer(folded)
            for user, index in list(out.uses()):
                user.replace_input_with(index, folded)
            for i, value in enumerate(graph.outputs):
                if value is out:
                    graph.outputs[i] = folded
            graph.remove(node, safe=True)
            if not x.uses() and not x.is_graph_output():
                graph.initializers.pop(x.name, None)
            entries.append({"node": node_label(node), "tensor": x.name, "kind": "constant",
                            "action": f"folded into {folded.name!r}: Quark's MXFP4 values (axis {axis}, block {block})"})
    return entries


def activation_fake_quants(model: ir.Model) -> list[ir.Node]:
    """Case 3: the Quark FP4 fake-quants on values computed at run time (or graph inputs)."""
    return [node for graph in model.graphs() for node in graph if quark_fp4(node) and not quark_constant(node)]


ACTIVATION_REASON = ("Quark MX fake-quant on an activation, left as it is: running the output needs Quark's "
                     "custom-op library (com.amd.quark); convert with --calib to replace it by calibrated NVFP4 "
                     "activation quantizers")


def activation_declines(model: ir.Model) -> list[Declined]:
    """Case 3 without calibration: one decline per activation fake-quant (pattern ``quark``)."""
    return [Declined("quark", node_label(node), node.inputs[0].name if node.inputs and node.inputs[0] else None,
                     ACTIVATION_REASON, op_label(node)) for node in activation_fake_quants(model)]


def remove_activation_fake_quants(model: ir.Model) -> list[dict]:
    """Case 3 with calibration: every activation fake-quant is removed (its readers read its input).

    Where its output is a graph output, an Identity keeps the output's name.
    """
    entries = []
    for node in activation_fake_quants(model):
        graph = node.graph
        x, out = node.inputs[0], node.outputs[0]
        label = node_label(node)
        if out.is_graph_output():
            identity = ir.node("Identity", [x], name=f"{label}/identity")
            graph.insert_before(node, [identity])
            _replace_output(graph, out, identity.outputs[0])
            identity.outputs[0].type, identity.outputs[0].shape = out.type, out.shape
        else:
            for user, index in list(out.uses()):
                user.replace_input_with(index, x)
        graph.remove(node, safe=True)
        entries.append({"node": label, "tensor": x.name, "kind": "activation",
                        "action": "removed"})
    return entries


def drop_unused_quark_opset(model: ir.Model) -> bool:
    """Remove the com.amd.quark opset import once no node of that domain is left; True when it went.

    Only that domain: ``onnx_ir.passes.common.RemoveUnusedOpsetsPass`` would also drop every other import
    the input has and does not use (Quark's exports import eight such domains), which is not fp4pass's to
    change."""
    if any(node.domain == QUARK_DOMAIN for graph in model.graphs() for node in graph):
        return False
    had = QUARK_DOMAIN in model.opset_imports
    model.opset_imports.pop(QUARK_DOMAIN, None)
    model.graph.opset_imports.pop(QUARK_DOMAIN, None)
    return had
