"""Rewrite an MXFP4 dequantize (pattern 1) or FP4 gather (pattern 3) into NVFP4, ModelOpt/TensorRT form.

``dq`` form (:class:`DequantizeToNVFP4`), every scale a multiplier applied on dequantize::

    s_f   = DequantizeLinear(S16 FLOAT8E4M3FN [.., K/16], G FP32 [] or [E], axis=0)    # e4m3(S16) * G
    x_hat = DequantizeLinear(W FLOAT4E2M1 [.., K], s_f, axis=-1, block_size=16)       # e2m1(W) * s_f

The product e4m3(S16) * G is formed in FP32 at run time; it is never stored in E4M3 (that
product, cast back to E4M3, loses up to ~25% of a block's scale: docs/formats.md).

``alpha`` form (:class:`AlphaNVFP4`): the chain dequantizes with the E4M3 block scales only
(``DQ(S16, 1.0)``), and the global scale multiplies the consumer's output, which is exact because the
consumer is linear in the weight: MatMul(x, W * G) = MatMul(x, W) * G. Per-expert G [E] is reshaped to
broadcast over the consumer output's expert axis. A Gemm with a bias takes a scalar G in its own ``alpha``
attribute (alpha * A @ B + beta * C). Where none of this applies, the weight falls back to the ``dq`` form
and the report says why.

``GatherBlockQuantized`` (pattern 3, :class:`GatherToNVFP4`): ``GBQ(W16, idx, DQ(S16, G), block_size=16)``.

The FP4 codes initializer keeps its name (its nibbles change only where a block is requantized); the block
scales become ``{W}_scale_e4m3``, the global scale ``{W}_global_scale``, the multiplier ``{W}_alpha`` (a
suffix ``_1``, ``_2`` ... where the name is taken). A weight read by several dequantize nodes
(:class:`fp4pass.onnx.sharing.SharedFP4Weight`) is converted once; each reader gets its own ``DQ(S16, G)`` over
the same new initializers. The old E8M0 scale initializer is removed only when nothing reads it any more.

Graph dtypes. The weight dequantize keeps its ``output_dtype`` (FLOAT, FLOAT16 or BFLOAT16) and the scale
chain stays FP32 (``DQ(S16, G)`` is FP32 whatever the graph computes in), so the weight is formed as
e2m1 * (e4m3 * G) in FP32 and rounded once to the graph dtype (onnx.reference and the onnxruntime lowering
both compute DequantizeLinear that way). In the ``alpha`` form the dequantized weight e2m1 * e4m3 is exact
in FLOAT16 and BFLOAT16 (at most 5 significant bits, magnitudes 2^-10 .. 2688). The alpha multiplier stays an
FP32 initializer: on a FLOAT16/BFLOAT16 consumer it is applied as
``Cast(Mul(Cast(y, FLOAT), alpha), graph dtype)``, one rounding of the exact product, since G (times an
activation scale) is in general not representable in 16 bits (FLOAT16: G < 2^-24 is zero, 11 bits of
mantissa; BFLOAT16: 8 bits). FLOAT16 consumers carry a risk the dq form does not have: their output before
the multiply is the true output / G and overflows FLOAT16 above |y| = 65504 * G; the report says the bound.
Outputs below 2^-14 (FLOAT16 subnormals) are rounded twice there and can be 2^-24 off the ``dq`` form's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.dtypes import FLOAT_TYPES, dequantize_dtype, value_dtype
from fp4pass.onnx.patterns import FP4Weight, node_label
from fp4pass.onnx.rewrite_common import UniqueNames, WeightConversion
from fp4pass.onnx.sharing import reader_nodes

__all__ = ["DequantizeToNVFP4", "AlphaNVFP4", "GatherToNVFP4", "alpha_note"]

FLOAT16_MAX = 65504.0


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, const_value=tensor, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    graph.register_initializer(value)
    return value


def _drop_if_unread(value: ir.Value, names: UniqueNames) -> None:
    """Remove an initializer nothing reads any more (it may still be read by an unconverted weight)."""
    graph = value.graph
    if (graph is not None and not value.uses() and not value.is_graph_output() and not value.is_graph_input()
            and graph.initializers.get(value.name) is value):
        graph.initializers.pop(value.name)
        names.release(graph, value.name)


def _scale_chain(record: FP4Weight, conv: WeightConversion, names: UniqueNames, with_global: bool) -> list[ir.Value]:
    """Add the E4M3 block scales and one DQ per reader; returns the FP32 full-scale values s_f [.., K/16]."""
    w = record.name
    graph = record.codes.graph or record.node.graph
    old_scales = record.scales
    name = names.take(graph, f"{w}_scale_e4m3")
    scales = _initializer(graph, name, conv.scales_tensor(name))
    if with_global:
        name = names.take(graph, f"{w}_global_scale")
        g = _initializer(graph, name, conv.global_tensor(name))
    else:
        name = names.take(graph, f"{w}_scale_one")
        g = _initializer(graph, name, ir.tensor(np.float32(1.0), name=name))
    outs = []
    scale_input = 2 if record.pattern == "gbq" else 1
    for reader in reader_nodes(record):
        if record.pattern != "gbq" and "output_dtype" not in reader.attributes:
            # the output type followed the old (possibly FLOAT16/BFLOAT16) scale's; the new scale is FP32: keep the graph's type explicit
            dtype = dequantize_dtype(reader)
            if dtype != ir.DataType.FLOAT:
                reader.attributes["output_dtype"] = ir.AttrInt64("output_dtype", dtype)
        attrs = {"axis": ir.AttrInt64("axis", 0)} if with_global and conv.group_dims else {}
        out = ir.Value(shape=ir.Shape(list(scales.shape)), type=ir.TensorType(ir.DataType.FLOAT))
        dq = ir.Node("", "DequantizeLinear", [scales, g], attrs, outputs=[out], name=f"{reader.name or w}_scale")
        reader.prepend(dq)
        reader.replace_input_with(scale_input, out)
        reader.attributes["block_size"] = ir.AttrInt64("block_size", 16)
        outs.append(out)
    _drop_if_unread(old_scales, names)  # first, so that its name can go to the new value
    for out, reader in zip(outs, reader_nodes(record)):
        out.name = names.take(reader.graph, f"{w}_scale")
    record.codes.const_value = conv.codes_tensor(w)
    return outs


class DequantizeToNVFP4:
    """Pattern 1 -> ``DQ(S16 E4M3, G) -> DQ(W FP4, block_size=16)`` (TensorRT / ModelOpt ``dq`` form)."""

    form = "dq"

    def __init__(self, names: UniqueNames | None = None) -> None:
        self.names = names or UniqueNames()

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        _scale_chain(record, conv, self.names, with_global=True)
        return {"form": "dq"}


class GatherToNVFP4:
    """Pattern 3 -> ``GatherBlockQuantized(W FP4, idx, DQ(S16 E4M3, G), block_size=16)``."""

    form = "gbq"

    def __init__(self, names: UniqueNames | None = None) -> None:
        self.names = names or UniqueNames()

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        _scale_chain(record, conv, self.names, with_global=True)
        return {"form": "gbq"}


def _expert_axis_shape(consumer, experts: int) -> tuple[list[int] | None, str | None]:
    """Shape of a per-expert alpha that broadcasts over ``consumer.node``'s output, or a reason it cannot."""
    node = consumer.node
    if any(p.op_type == "Reshape" for p in consumer.path):
        return None, "a Reshape between the weight and its consumer moves the expert axis"
    for p in consumer.path:
        if p.op_type == "Transpose":
            perm = p.attributes.get("perm")
            if perm is None or list(perm.value)[0] != 0:
                return None, "a Transpose moves the expert axis"
    if node.op_type == "MatMul":
        return [experts, 1, 1], None  # [.., E, T, N]: E at -3 for a 3-D weight
    if node.op_type == "Einsum":
        equation = node.attributes["equation"].value.replace(" ", "")
        if "->" not in equation or "..." in equation:
            return None, "Einsum equation without an explicit output or with an ellipsis"
        lhs, out = equation.split("->")
        letter = lhs.split(",")[consumer.weight_input][0]
        if letter not in out:
            return None, "Einsum sums over the expert axis"
        return [experts] + [1] * (len(out) - out.index(letter) - 1), None
    return None, f"{node.op_type} cannot take a per-expert multiplier"


def _consumer_dtype(consumer) -> ir.DataType:
    """The type the consumer computes in: its weight operand's (MatMul/Gemm/Einsum inputs share one type)."""
    return value_dtype(consumer.node.inputs[consumer.weight_input]) or ir.DataType.FLOAT


class AlphaNVFP4:
    """Pattern 1 -> E2M1 * E4M3 dequantize, global scale as an FP32 multiplier on the consumer output.

    Declines (returns a reason, the caller falls back to ``dq``) unless every consumer is MatMul, Gemm or a
    two-input Einsum computing in FLOAT, FLOAT16 or BFLOAT16, no dequantized weight is a graph output, and a
    per-expert scale can broadcast.
    """

    form = "alpha"

    def __init__(self, names: UniqueNames | None = None) -> None:
        self.names = names or UniqueNames()

    def check(self, record: FP4Weight) -> str | None:
        if any(reader.outputs[0].is_graph_output() for reader in reader_nodes(record)):
            return "the dequantized weight is a graph output"
        if not record.consumers:
            return "the dequantized weight has no consumer"
        for c in record.consumers:
            label = node_label(c.node)
            if c.node.domain != "" or c.node.op_type not in ("MatMul", "Gemm", "Einsum") or c.activation_input is None:
                return f"consumer {label!r} ({c.node.op_type}) is not a linear op of the weight"
            if any(p.outputs[0].is_graph_output() for p in c.path):
                return "an intermediate of the weight is a graph output"
            if _consumer_dtype(c) not in FLOAT_TYPES:
                return f"consumer {label!r} computes in {_consumer_dtype(c).name}"
            if record.experts is not None:
                _, reason = _expert_axis_shape(c, record.experts)
                if reason:
                    return reason
        return None

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        _scale_chain(record, conv, self.names, with_global=False)
        alphas: dict[str, str] = {}
        gemm_alpha: list[str] = []
        cast: dict[str, str] = {}
        for c in record.consumers:
            node = c.node
            label = node_label(node)
            if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
                # alpha * (A @ B) + beta * C: the global scale goes into Gemm's own alpha (exact, FP32).
                g = float(conv.global_scale().reshape(()))
                old = node.attributes.get("alpha")
                node.attributes["alpha"] = ir.AttrFloat32("alpha", (1.0 if old is None else old.value) * g)
                gemm_alpha.append(label)
                continue
            shape = [] if record.experts is None else _expert_axis_shape(c, record.experts)[0]
            graph = node.graph
            name = self.names.take(graph, f"{record.name}_alpha")
            alpha = _initializer(graph, name, _reshaped_global(conv, name, shape))
            dtype = _consumer_dtype(c)
            _multiply_output(node, alpha, dtype, self.names)
            if dtype != ir.DataType.FLOAT:
                cast[label] = dtype.name
            alphas[label] = name
        return {"form": "alpha", "alphas": alphas, "gemm_alpha": gemm_alpha, "cast": cast}


def alpha_note(out: dict, conv: WeightConversion) -> str | None:
    """The report's words on 16-bit consumers of an alpha-form weight (after the conversion ran)."""
    if not out.get("cast"):
        return None
    labels = ", ".join(f"{label} ({dtype})" for label, dtype in out["cast"].items())
    note = f"alpha multiply in FLOAT between Casts for {labels}"
    if "FLOAT16" in out["cast"].values():
        g = float(np.min(conv.global_scale()))
        note += (f"; a FLOAT16 output before the multiply is the true output / global scale and overflows "
                 f"past |y| = {FLOAT16_MAX * g:.4g}")
    return note


def _reshaped_global(conv: WeightConversion, name: str, shape: list[int]) -> ir.LazyTensor:
    def make():
        return ir.Tensor(conv.global_scale().reshape(shape), name=name)

    return ir.LazyTensor(make, ir.DataType.FLOAT, ir.Shape(shape), name=name)


def _multiply_output(node: ir.Node, alpha: ir.Value, dtype: ir.DataType, names: UniqueNames) -> None:
    """y = node(...)  ->  y = Mul(node(...), alpha), keeping the name y on the final value.

    ``alpha`` is FLOAT; for a FLOAT16/BFLOAT16 ``dtype`` the product is formed in FLOAT between two Casts.
    """
    graph = node.graph
    y = node.outputs[0]
    original = y.name
    label = node_label(node)
    y_type = y.type if y.type is not None else ir.TensorType(dtype)
    scaled = ir.Value(shape=y.shape, type=y_type)
    if dtype == ir.DataType.FLOAT:
        new_nodes = [ir.Node("", "Mul", [y, alpha], outputs=[scaled], name=f"{label}_alpha")]
    else:
        as_float = ir.Value(shape=y.shape, type=ir.TensorType(ir.DataType.FLOAT))
        product = ir.Value(shape=y.shape, type=ir.TensorType(ir.DataType.FLOAT))
        new_nodes = [
            ir.Node("", "Cast", [y], {"to": ir.AttrInt64("to", ir.DataType.FLOAT)}, outputs=[as_float],
                    name=f"{label}_alpha/to_float"),
            ir.Node("", "Mul", [as_float, alpha], outputs=[product], name=f"{label}_alpha"),
            ir.Node("", "Cast", [product], {"to": ir.AttrInt64("to", dtype)}, outputs=[scaled],
                    name=f"{label}_alpha/to_{dtype.name.lower()}"),
        ]
        as_float.name = names.take(graph, f"{original}_unscaled_float")
        product.name = names.take(graph, f"{original}_scaled_float")
    for user, index in list(y.uses()):
        if user is not new_nodes[0]:
            user.replace_input_with(index, scaled)
    for i, out in enumerate(graph.outputs):
        if out is y:
            graph.outputs[i] = scaled
    y.name = names.take(graph, f"{original}_unscaled")
    scaled.name = original
    graph.insert_after(node, new_nodes)
