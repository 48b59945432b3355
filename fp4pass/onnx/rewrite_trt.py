"""Rewrite an MXFP4 dequantize (pattern 1) or FP4 gather (pattern 3) into NVFP4, ModelOpt/TensorRT form.

``dq`` form (:class:`DequantizeToNVFP4`), every scale a multiplier applied on dequantize::

    s_f   = DequantizeLinear(S16 FLOAT8E4M3FN [.., K/16], G FP32 [] or [E], axis=0)    # e4m3(S16) * G
    x_hat = DequantizeLinear(W FLOAT4E2M1 [.., K], s_f, axis=-1, block_size=16)       # e2m1(W) * s_f

The product e4m3(S16) * G is formed in FP32 at run time; it is never stored in E4M3 (seed 002).

``alpha`` form (:class:`AlphaNVFP4`): the chain dequantizes with the E4M3 block scales only
(``DQ(S16, 1.0)``), and the global scale multiplies the consumer's output, which is exact because the
consumer is linear in the weight: MatMul(x, W * G) = MatMul(x, W) * G. Per-expert G [E] is reshaped to
broadcast over the consumer output's expert axis. A Gemm with a bias takes a scalar G in its own ``alpha``
attribute (alpha * A @ B + beta * C). Where none of this applies, the weight falls back to the ``dq`` form
and the report says why.

``GatherBlockQuantized`` (pattern 3, :class:`GatherToNVFP4`): ``GBQ(W16, idx, DQ(S16, G), block_size=16)``.

The FP4 codes initializer keeps its name (its nibbles change only where a block is requantized); the block
scales become ``{W}_scale_e4m3``, the global scale ``{W}_global_scale``, the multiplier ``{W}_alpha``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.patterns import FP4Weight
from fp4pass.onnx.rewrite_common import WeightConversion

__all__ = ["DequantizeToNVFP4", "AlphaNVFP4", "GatherToNVFP4", "keep_output_dtype"]


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, const_value=tensor, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype))
    graph.register_initializer(value)
    return value


def _scale_chain(record: FP4Weight, conv: WeightConversion, graph: ir.Graph, with_global: bool) -> ir.Value:
    """Add the E4M3 block scales and their DQ; returns the FP32 full-scale value s_f [.., K/16]."""
    w = record.name
    old_scales = record.scales
    scales = _initializer(graph, f"{w}_scale_e4m3", conv.scales_tensor(f"{w}_scale_e4m3"))
    attrs = {}
    if with_global:
        g = _initializer(graph, f"{w}_global_scale", conv.global_tensor(f"{w}_global_scale"))
        if conv.group_dims:
            attrs["axis"] = ir.AttrInt64("axis", 0)
    else:
        g = _initializer(graph, f"{w}_scale_one", ir.tensor(np.float32(1.0), name=f"{w}_scale_one"))
    out = ir.Value(name=f"{w}_scale", shape=ir.Shape(list(scales.shape)), type=ir.TensorType(ir.DataType.FLOAT))
    node_name = f"{record.node.name or w}_scale"
    dq = ir.Node("", "DequantizeLinear", [scales, g], attrs, outputs=[out], name=node_name)
    record.node.prepend(dq)
    record.node.replace_input_with(2 if record.pattern == "gbq" else 1, out)
    if not old_scales.uses():
        graph.initializers.pop(old_scales.name, None)
    record.codes.const_value = conv.codes_tensor(w)
    record.node.attributes["block_size"] = ir.AttrInt64("block_size", 16)
    return out


def keep_output_dtype(record: FP4Weight) -> None:
    """Pattern 4 with FLOAT16/BFLOAT16 scales: the DQ's output type came from its scale; once the scale is
    the FP32 ``DQ(S16, G)`` it would turn FP32, so ``output_dtype`` pins the graph's own type."""
    node = record.node
    scale_type = record.scales.const_value.dtype if record.scales.const_value is not None else record.scales.dtype
    if "output_dtype" not in node.attributes and scale_type not in (None, ir.DataType.FLOAT):
        node.attributes["output_dtype"] = ir.AttrInt64("output_dtype", scale_type.value)


class DequantizeToNVFP4:
    """Pattern 1 -> ``DQ(S16 E4M3, G) -> DQ(W FP4, block_size=16)`` (TensorRT / ModelOpt ``dq`` form)."""

    form = "dq"

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        _scale_chain(record, conv, record.node.graph, with_global=True)
        return {"form": "dq"}


class GatherToNVFP4:
    """Pattern 3 -> ``GatherBlockQuantized(W FP4, idx, DQ(S16 E4M3, G), block_size=16)``."""

    form = "gbq"

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        _scale_chain(record, conv, record.node.graph, with_global=True)
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


class AlphaNVFP4:
    """Pattern 1 -> E2M1 * E4M3 dequantize, global scale as an FP32 multiplier on the consumer output.

    Declines (returns a reason, the caller falls back to ``dq``) unless every consumer is MatMul, Gemm or a
    two-input Einsum, the dequantized weight is not a graph output, and a per-expert scale can broadcast.
    """

    form = "alpha"

    def check(self, record: FP4Weight) -> str | None:
        if record.node.outputs[0].is_graph_output():
            return "the dequantized weight is a graph output"
        if not record.consumers:
            return "the dequantized weight has no consumer"
        for c in record.consumers:
            if c.node.domain != "" or c.node.op_type not in ("MatMul", "Gemm", "Einsum") or c.activation_input is None:
                return f"consumer {c.node.name!r} ({c.node.op_type}) is not a linear op of the weight"
            if any(p.outputs[0].is_graph_output() for p in c.path):
                return "an intermediate of the weight is a graph output"
            if record.experts is not None:
                _, reason = _expert_axis_shape(c, record.experts)
                if reason:
                    return reason
        return None

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        graph = record.node.graph
        _scale_chain(record, conv, graph, with_global=False)
        alphas: dict[str, str] = {}
        gemm_alpha: list[str] = []
        for i, c in enumerate(record.consumers):
            node = c.node
            if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
                # alpha * (A @ B) + beta * C: the global scale goes into Gemm's own alpha (exact, FP32).
                g = float(conv.global_scale().reshape(()))
                old = node.attributes.get("alpha")
                node.attributes["alpha"] = ir.AttrFloat32("alpha", (1.0 if old is None else old.value) * g)
                gemm_alpha.append(node.name)
                continue
            shape = [] if record.experts is None else _expert_axis_shape(c, record.experts)[0]
            name = f"{record.name}_alpha" if i == 0 else f"{record.name}_alpha_{i}"
            alpha = _initializer(graph, name, _reshaped_global(conv, name, shape))
            _multiply_output(graph, node, alpha)
            alphas[node.name] = name
        return {"form": "alpha", "alphas": alphas, "gemm_alpha": gemm_alpha}


def _reshaped_global(conv: WeightConversion, name: str, shape: list[int]) -> ir.LazyTensor:
    def make():
        return ir.Tensor(conv.global_scale().reshape(shape), name=name)

    return ir.LazyTensor(make, ir.DataType.FLOAT, ir.Shape(shape), name=name)


def _multiply_output(graph: ir.Graph, node: ir.Node, alpha: ir.Value) -> None:
    """y = node(...)  ->  y = Mul(node(...), alpha), keeping the name y on the final value."""
    y = node.outputs[0]
    scaled = ir.Value(name=f"{y.name}__fp4pass_scaled", shape=y.shape, type=y.type)
    mul = ir.Node("", "Mul", [y, alpha], outputs=[scaled], name=f"{node.name}_alpha")
    for user, index in list(y.uses()):
        if user is not mul:
            user.replace_input_with(index, scaled)
    for g in {id(graph): graph}.values():
        for i, out in enumerate(g.outputs):
            if out is y:
                g.outputs[i] = scaled
    original = y.name
    y.name = f"{original}_unscaled"
    scaled.name = original
    node.append(mul)
