"""Exact lowering of FP4 graph patterns into ops onnxruntime 1.31 runs on CPU and CUDA.

onnxruntime has no DequantizeLinear kernel for FLOAT4E2M1 and runs QMoE's FP4 modes on CUDA only (docs/formats.md).
``lower_for_ort`` returns a copy of the model where every such pattern computes the same numbers with ops it
does run. Each lowering is an ``onnx_ir`` in-place pass (:class:`NodeLowering`) that visits every node of the
main graph, of every subgraph (If / Loop / Scan bodies, recursively) and of every local function body
(:mod:`fp4pass.onnx.passes`), and rewrites a node in the graph that holds it: new constants are
initializers of that graph, or ``Constant`` nodes in a function body (functions hold no initializers), and
an FP4 tensor a function stores in a ``Constant`` node counts as stored. :func:`lower` runs them with
``onnx_ir.passes.PassManager``, in this order:

1. :class:`LowerTRTFP4DynamicQuantize` - the TensorRT activation quantizer
   ``trt::TRT_FP4DynamicQuantize(x, g) -> (x_fp4, s_e4m3); DQ(s_e4m3, g') -> s_f; DQ(x_fp4, s_f, block 16)``
   becomes the standard-op emulation of :mod:`fp4pass.onnx.emulate`: y = e2m1(x / (s*g)) * (s*g'), with
   s = e4m3(clip(block_amax/(6g), 2^-9, 448)). ``g' = g`` in the ``dq`` form; in the ``alpha`` form the
   scales' DQ carries another scale (or none, a Cast) and the global scale sits on a Mul after the consumer,
   which stays as it is.
2. :class:`LowerQMoEFP4` - ``com.microsoft::QMoE`` with ``quant_type`` 'fp4' (E8M0 per 32) or 'nvfp4' (E4M3
   per 16) becomes the float ``com.microsoft::MoE``, its weights dequantized in the graph by
   GatherBlockQuantized: W[e] = e2m1(code) * (block_scale * fc_global_scale[e]), the product formed in FP32
   (the NVFP4Tensor convention; a scale of 2^k times 1.0 is exact, so MXFP4 is exact in any order). The
   weights may be in the schema layout [E, N, K/2] or the CUDA kernel's [E, K, N/2]
   (:mod:`fp4pass.onnx.qmoe_layout` tells which; kernel-layout codes are repacked to [E, N, K/2] here, exactly).
   With fp16/bf16 activations the dequantized weights are cast to that type (as the CUDA kernel does).
3. :class:`LowerFP4DequantizeLinear` - ``DequantizeLinear(W FLOAT4E2M1 [.., N, K], S, axis=-1, block_size=B)``
   with W an initializer becomes ``com.microsoft::GatherBlockQuantized(W, arange(dim0), S_f, gather_axis=0,
   quantize_axis=-1, block_size=B)``: out = e2m1(code) * S_f, one FP32 multiply, as DQ defines. E8M0 scales
   initializers become FP32 initializers 2^(code-127) (exact); NVFP4's ``DQ(S E4M3, G)`` stays and feeds S_f
   at run time (onnxruntime runs E4M3 DQ). Covers MXFP4 (block 32), NVFP4 two-DQ (block 16, scalar or
   per-expert [E] G) and the alpha form (any FP32 scale input).

4. ``onnx_ir.passes.common.RemoveUnusedOpsetsPass`` - opset imports no node uses any more (the ``trt``
   domain once its quantizers are lowered) go, from the model and from each function.
5. :class:`SetOrtVersions` - IR is capped at 13 (onnxruntime 1.31) and kept >= 11 when FP4 tensors remain;
   the ``com.microsoft`` opset is imported by the model, and by each function whose body uses it (an MS op
   inside an If branch needs the model's import); the default opset is raised to 21 where an emulation
   was inserted (the model, and each function that got one).

QMoE inside a function body is declined (its weights would be ``Constant`` nodes there; inline the
function). Every lowering has ``check(node) -> reason | None`` (None = it applies); the reasons of the
declines are logged and returned in :class:`LoweringReport`. A pass's ``PassResult.modified`` is True when it
rewrote at least one node (or changed a version).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from fp4pass.errors import ModelError
from fp4pass.formats import decode_e4m3, decode_e8m0
from fp4pass.formats.constants import FP4_MIN_IR_VERSION, MS_DOMAIN, ORT_MAX_IR_VERSION, TRT_DOMAIN
from fp4pass.onnx import emulate, qmoe_layout
from fp4pass.onnx.patterns import node_label
from fp4pass.onnx.passes import (ModelNames, all_nodes, constant_tensor, function_graphs, function_label, function_of,
                                 run_passes)

__all__ = [
    "lower_for_ort",
    "lower",
    "LoweringReport",
    "LoweringResult",
    "LowerFP4DequantizeLinear",
    "LowerQMoEFP4",
    "LowerTRTFP4DynamicQuantize",
    "NodeLowering",
    "SetOrtVersions",
    "ORT_MAX_IR_VERSION",
]

logger = logging.getLogger(__name__)

_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclass
class LoweringResult(ir.passes.PassResult):
    """What one :class:`NodeLowering` did: ``lowered`` nodes rewritten, ``declined`` the reason for each node
    it left, ``functions`` the function bodies it rewrote a node in."""

    name: str = "lowering"
    lowered: int = 0
    declined: list = field(default_factory=list)
    functions: list = field(default_factory=list)


@dataclass
class LoweringReport:
    """What :func:`lower` changed: counts per pass, and the reason for every matching node it left."""

    lowered: dict[str, int] = field(default_factory=dict)
    declined: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, results: list[LoweringResult]) -> "LoweringReport":
        """The lowerings' results, in the order they ran, as one report."""
        return cls({r.name: r.lowered for r in results if r.lowered}, [d for r in results for d in r.declined])

    def summary(self) -> str:
        done = ", ".join(f"{n} x {name}" for name, n in self.lowered.items()) or "nothing to lower"
        return done + (f"; {len(self.declined)} left as is" if self.declined else "")


#: the kind each attribute read here must have (a model loaded with --allow-invalid may carry any)
_ATTR_KINDS = {"axis": int, "block_size": int, "output_dtype": int, "to": int, "scale_type": int, "quant_type": str}


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    if attr is None:
        return default
    kind = _ATTR_KINDS.get(name)
    if kind is not None and not isinstance(attr.value, kind):
        raise ModelError(f"{node_label(node)}: attribute {name!r} is {attr.type.name}, not "
                         f"{'an INT' if kind is int else 'a STRING'}")
    if name in ("output_dtype", "to") and attr.value:
        try:
            ir.DataType(attr.value)
        except ValueError:
            raise ModelError(f"{node_label(node)}: attribute {name!r} = {attr.value} is no ONNX data type") from None
    return attr.value


def _dtype(value: ir.Value | None) -> ir.DataType | None:
    """A value's type, or its stored tensor's (a function body's Constant outputs often carry no type)."""
    stored = constant_tensor(value)
    return stored.dtype if stored is not None else (value.dtype if value is not None else None)


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


class Scope:
    """Where one rewrite puts what it adds: ``graph``, the graph holding the node being lowered (the main
    graph, a subgraph or a function body). Constants are initializers of that graph, or, in a function body
    (``function`` set; it holds no initializers), ``Constant`` nodes placed before the node. Names are unique
    in the whole model."""

    def __init__(self, node: ir.Node, function: ir.Function | None, names: ModelNames) -> None:
        self.node, self.graph, self.function, self.names = node, node.graph, function, names

    def constant(self, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
        name = self.names.take(name)
        tensor = array if isinstance(array, ir.TensorProtocol) else ir.tensor(array, name=name)
        tensor.name = name
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        self.adopt(value)
        return value

    def adopt(self, value: ir.Value) -> None:
        """Make the constant ``value`` (``const_value`` set, no producer) available before the node."""
        if self.function is None:
            self.graph.register_initializer(value)
            return
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", value.const_value)], outputs=[value],
                       name=f"{value.name}/Constant")
        self.graph.insert_before(self.node, [node])

    def arange(self, n: int, hint: str) -> ir.Value:
        return self.constant(f"{hint}/arange{n}", np.arange(n, dtype=np.int64))


def _scale_codes(tensor: ir.TensorProtocol) -> torch.Tensor:
    """uint8 codes of an FP8/E8M0 tensor as a torch tensor (numpy holds them as ml_dtypes)."""
    return torch.from_numpy(np.array(tensor.numpy()).view(np.uint8))


def _drop_if_unused(value: ir.Value | None) -> None:
    """Remove an initializer or ``Constant`` node the rewrite orphaned (onnxruntime warns about unused ones)."""
    if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    graph = value.graph
    if value.is_initializer() and graph is not None and graph.initializers.get(value.name) is value:
        graph.initializers.pop(value.name)
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.graph is not None:
        producer.graph.remove(producer, safe=True)


def _dequant_gbq(scope: Scope, data: ir.Value, scales: ir.Value, block_size: int, name: str) -> ir.Node:
    """GatherBlockQuantized(data, arange(dim0), scales) = the whole tensor dequantized along its last axis."""
    shape = constant_tensor(data).shape if constant_tensor(data) is not None else data.shape
    rank = len(shape)
    return ir.node(
        "GatherBlockQuantized",
        [data, scope.arange(int(shape[0]), name), scales],
        {"gather_axis": 0, "quantize_axis": rank - 1, "block_size": block_size},
        domain=MS_DOMAIN,
        name=f"{name}/GatherBlockQuantized",
    )


class NodeLowering(ir.passes.InPlacePass):
    """One lowering as an onnx_ir pass: every node it ``matches``, wherever it lives (main graph, subgraphs,
    function bodies), is ``check``ed, then rewritten in the graph that holds it (:class:`Scope`), or left with
    the reason in the :class:`LoweringResult` it returns."""

    name = "lowering"

    def matches(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def check(self, node: ir.Node) -> str | None:
        raise NotImplementedError

    def rewrite(self, scope: Scope, node: ir.Node) -> None:
        raise NotImplementedError

    def check_in(self, node: ir.Node, function: ir.Function | None) -> str | None:
        """:meth:`check`, for a node that sits in ``function``'s body (None: in the main graph or a subgraph)."""
        return self.check(node)

    def call(self, model: ir.Model) -> LoweringResult:
        owners = function_graphs(model)
        names = ModelNames(model)
        result = LoweringResult(model, False, self.name)
        for node in all_nodes(model):
            if node.graph is None or not self.matches(node):  # graph None: removed by an earlier rewrite
                continue
            function = function_of(node, owners)
            reason = self.check_in(node, function)
            if reason is not None:
                logger.warning("lowering for onnxruntime: left %s: %s", node.op_type, reason)
                result.declined.append(reason)
                continue
            self.rewrite(Scope(node, function, names), node)
            result.lowered += 1
            if function is not None and function not in result.functions:
                result.functions.append(function)
            result.modified = True
        return result


class LowerFP4DequantizeLinear(NodeLowering):
    """FP4 weight DequantizeLinear -> GatherBlockQuantized (module docstring, pass 3).

    Cases, numbered as in the code: (1) E8M0 scale initializer -> FP32 initializer; (2) E8M0 scale computed at
    run time -> Cast to FLOAT; (3) FP32/FP16 scale (NVFP4's DQ(S, G), alpha form) used as it is; BF16 scales
    (onnxruntime has no GatherBlockQuantized kernel for them) become FP32, exactly (every bfloat16 is a
    float32): a stored one as an FP32 initializer, a computed one through a Cast; (4) an output type (DQ's
    ``output_dtype``, else its scale's type) other than the gather's -> a Cast after the gather. With BF16
    scales that Cast rounds e2m1 * s, exact in FP32 (at most 10 significant bits), once to BF16: what DQ
    computes in BF16.
    """

    name = "FP4 DequantizeLinear -> GatherBlockQuantized"

    def matches(self, node: ir.Node) -> bool:
        return (
            node.op_type == "DequantizeLinear"
            and node.domain == ""
            and node.inputs[0] is not None
            and _dtype(node.inputs[0]) == ir.DataType.FLOAT4E2M1
        )

    def check(self, node: ir.Node) -> str | None:
        data = node.inputs[0]
        scale = node.inputs[1]
        stored = constant_tensor(data)
        if stored is None:
            return f"{data.name}: FP4 data is not an initializer (a graph input or computed)"
        rank = len(stored.shape)
        if not rank or rank < 2:
            return f"{data.name}: FP4 data of rank {rank}; only [N, K] and [E, N, K] (rank >= 2) are lowered"
        axis = _attr(node, "axis", 1)
        if axis not in (-1, rank - 1):
            return f"{node_label(node)}: axis={axis} is not the last axis"
        block_size = _attr(node, "block_size", 0)
        if block_size < 16 or block_size & (block_size - 1):
            return f"{node_label(node)}: block_size={block_size} (GatherBlockQuantized needs a power of two >= 16)"
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            zero_point = constant_tensor(node.inputs[2])
            if zero_point is None or np.any(np.asarray(zero_point.numpy(), np.float32) != 0):
                return f"{node_label(node)}: non-zero FP4 zero point"
        if scale is None:
            return f"{node_label(node)}: no scale input"
        if _dtype(scale) is not None and _dtype(scale) not in (ir.DataType.FLOAT8E8M0, *_FLOAT_TYPES):
            return f"{node_label(node)}: scale of type {_dtype(scale)} (want E8M0 or float)"
        return None

    def rewrite(self, scope: Scope, node: ir.Node) -> None:
        data, scale = node.inputs[0], node.inputs[1]
        new_nodes: list[ir.Node] = []
        stored_scale = constant_tensor(scale)
        scale_dtype = _dtype(scale)
        if scale_dtype == ir.DataType.FLOAT8E8M0 and stored_scale is not None:  # (1)
            scale_f = decode_e8m0(_scale_codes(stored_scale), what=f"{scale.name} (E8M0 scales)").numpy()
            scale = scope.constant(f"{scale.name}/f32", scale_f)
        elif scale_dtype == ir.DataType.BFLOAT16 and stored_scale is not None:  # (3), BF16 stored
            scale = scope.constant(f"{scale.name}/f32", np.asarray(stored_scale.numpy(), np.float32))
        elif scale_dtype in (ir.DataType.FLOAT8E8M0, ir.DataType.BFLOAT16):  # (2), and (3) BF16 computed
            cast = ir.node("Cast", [scale], {"to": ir.DataType.FLOAT}, name=f"{node_label(node)}/scale_f32")
            new_nodes.append(cast)
            scale = cast.outputs[0]
        gather = _dequant_gbq(scope, data, scale, _attr(node, "block_size"), node.name or data.name)  # (3)
        new_nodes.append(gather)
        out = gather.outputs[0]
        out_dtype = _attr(node, "output_dtype", 0)
        if not out_dtype and scale_dtype in _FLOAT_TYPES:
            out_dtype = scale_dtype  # DequantizeLinear's output is its scale's type unless output_dtype says
        scale_dtype = _dtype(scale) or ir.DataType.FLOAT
        if out_dtype and ir.DataType(out_dtype) != scale_dtype:  # (4)
            cast = ir.node("Cast", [out], {"to": ir.DataType(out_dtype)}, name=f"{node_label(node)}/output_dtype")
            new_nodes.append(cast)
            out = cast.outputs[0]
        old_scale = node.inputs[1]
        ir.convenience.replace_nodes_and_values(scope.graph, node, [node], new_nodes, [node.outputs[0]], [out])
        _drop_if_unused(old_scale)


# QMoE input positions (com.microsoft::QMoE, onnxruntime 1.31 schema).
_QMOE_FC = {"fc1": (2, 3, 4, 15), "fc2": (5, 6, 7, 16)}  # weights, scales, bias, global_scale
_QMOE_FC3 = 8
_QMOE_ROUTER_WEIGHTS = 14
_QMOE_ACT_SCALES = range(17, 21)
_MOE_ATTRS = ("k", "activation_type", "normalize_routing_weights", "use_sparse_mixer", "swiglu_fusion",
              "swiglu_limit", "activation_alpha", "activation_beta")
_QMOE_BLOCK = {"fp4": (32, ir.DataType.FLOAT8E8M0), "nvfp4": (16, ir.DataType.FLOAT8E4M3FN)}


class LowerQMoEFP4(NodeLowering):
    """QMoE 'fp4' / 'nvfp4' -> float MoE with GatherBlockQuantized-dequantized weights (module docstring, pass 2).

    W_fc[e, n, k] = e2m1(code(e, n, k)) * (decode(scales[e, n, k // B]) * global_scale[e]),
    B = 32 (E8M0) for 'fp4', 16 (E4M3) for 'nvfp4'; a missing global scale is 1. code(e, n, k) is nibble k of
    weights[e, n] in the schema layout, nibble n of weights[e, k] in the kernel layout.
    ``hints``: the model-level evidence for a node whose shapes fit both layouts (set by :func:`lower`).
    """

    name = "QMoE FP4 -> MoE"

    def __init__(self, hints: qmoe_layout.Hints | None = None) -> None:
        super().__init__()
        self.given_hints = self.hints = hints

    def call(self, model: ir.Model) -> LoweringResult:
        self.hints = self.given_hints if self.given_hints is not None else qmoe_layout.Hints.of(model)
        return super().call(model)

    def check_in(self, node: ir.Node, function: ir.Function | None) -> str | None:
        if function is not None:
            return (f"{node_label(node)}: QMoE inside function {function_label(function)} is not lowered (its weights would be "
                    "Constant nodes there); inline the function to lower it")
        return self.check(node)

    def matches(self, node: ir.Node) -> bool:
        return node.op_type == "QMoE" and node.domain == MS_DOMAIN and _attr(node, "quant_type", "int") in _QMOE_BLOCK

    @staticmethod
    def _input(node: ir.Node, index: int) -> ir.Value | None:
        return node.inputs[index] if index < len(node.inputs) else None

    def check(self, node: ir.Node) -> str | None:
        quant_type = _attr(node, "quant_type")
        block, scale_dtype = _QMOE_BLOCK[quant_type]
        if self._input(node, _QMOE_FC3) is not None:
            return f"{node_label(node)}: QMoE with fc3 weights (no fc3 global scale in the schema) is not lowered"
        if self._input(node, _QMOE_ROUTER_WEIGHTS) is not None:
            return f"{node_label(node)}: router_weights has no equivalent in the float MoE"
        if any(self._input(node, i) is not None for i in _QMOE_ACT_SCALES):
            return f"{node_label(node)}: activation scales (FP8 activation modes) are not lowered"
        for fc, (w_i, s_i, _, g_i) in _QMOE_FC.items():
            weights, scales, global_scale = (self._input(node, i) for i in (w_i, s_i, g_i))
            if weights is None or weights.const_value is None or scales is None or scales.const_value is None:
                return f"{node_label(node)}: {fc} weights and scales must be initializers"
            if scales.dtype != scale_dtype:
                return f"{node_label(node)}: {fc} scales are {scales.dtype}, quant_type '{quant_type}' needs {scale_dtype}"
            if global_scale is not None and global_scale.const_value is None:
                return f"{node_label(node)}: {fc}_global_scale must be an initializer"
            experts = weights.const_value.shape[0]
            if global_scale is not None and global_scale.const_value.size != experts:
                return (f"{node_label(node)}: {fc}_global_scale {global_scale.name!r} holds "
                        f"{global_scale.const_value.size} values for {experts} experts")
        detected = qmoe_layout.detect(node, block, self.hints)
        if detected.layout is None:
            return f"{node_label(node)}: {detected.reason}"
        x_dtype = node.inputs[0].dtype if node.inputs and node.inputs[0] is not None else None
        if x_dtype is not None and x_dtype not in _FLOAT_TYPES:
            return f"{node_label(node)}: input of type {x_dtype} (want float, float16 or bfloat16)"
        return None

    def rewrite(self, scope: Scope, node: ir.Node) -> None:
        quant_type = _attr(node, "quant_type")
        block, _ = _QMOE_BLOCK[quant_type]
        decode = decode_e8m0 if quant_type == "fp4" else decode_e4m3
        detected = qmoe_layout.detect(node, block, self.hints)
        x_dtype = node.inputs[0].dtype
        new_nodes: list[ir.Node] = []
        float_weights: dict[str, ir.Value] = {}
        for fc, (w_i, s_i, _, g_i) in _QMOE_FC.items():
            weights, scales, global_scale = (self._input(node, i) for i in (w_i, s_i, g_i))
            experts = int(weights.shape[0])
            rows, k = detected.dims[fc]
            codes = np.ascontiguousarray(weights.const_value.numpy()).view(np.uint8)
            if detected.layout == qmoe_layout.KERNEL:
                codes = qmoe_layout.kernel_to_schema(codes, rows, k)
            fp4 = ir.PackedTensor(codes.reshape(experts, rows, k // 2), ir.DataType.FLOAT4E2M1,
                                  shape=(experts, rows, k))
            fp4_value = scope.constant(f"{weights.name}/fp4", fp4)
            block_scale = decode(_scale_codes(scales.const_value)).numpy()
            g = (np.ones(experts, np.float32) if global_scale is None
                 else np.asarray(global_scale.const_value.numpy(), np.float32).reshape(experts))
            scale_f = scope.constant(f"{scales.name}/f32", block_scale * g[:, None, None])
            gather = _dequant_gbq(scope, fp4_value, scale_f, block, f"{node_label(node)}/{fc}")
            new_nodes.append(gather)
            float_weights[fc] = gather.outputs[0]
            if x_dtype is not None and x_dtype != ir.DataType.FLOAT:
                cast = ir.node("Cast", [gather.outputs[0]], {"to": x_dtype},
                               name=f"{node_label(node)}/{fc}/to_{x_dtype.name.lower()}")
                new_nodes.append(cast)
                float_weights[fc] = cast.outputs[0]
        fc1_bias, fc2_bias = self._input(node, 4), self._input(node, 7)
        attrs = {k: node.attributes[k] for k in _MOE_ATTRS if k in node.attributes}
        moe = ir.Node(
            MS_DOMAIN, "MoE",
            [node.inputs[0], node.inputs[1], float_weights["fc1"], fc1_bias, float_weights["fc2"], fc2_bias],
            attributes=list(attrs.values()), name=f"{node_label(node)}/MoE",
        )
        new_nodes.append(moe)
        old_inputs = [self._input(node, i) for fc in _QMOE_FC.values() for i in (fc[0], fc[1], fc[3])]
        ir.convenience.replace_nodes_and_values(scope.graph, node, [node], new_nodes, [node.outputs[0]], [moe.outputs[0]])
        for value in old_inputs:
            _drop_if_unused(value)


class LowerTRTFP4DynamicQuantize(NodeLowering):
    """TRT_FP4DynamicQuantize + its two DQs -> standard-op NVFP4 fake-quant (module docstring, pass 1).

    Each consumer ``DQ(x_fp4, s_f, axis=-1, block_size=16)`` with ``s_f = DQ(s_e4m3, g')`` (or a Cast of
    s_e4m3, then g' = 1) is replaced by ``nvfp4_fake_quant(x, g, dequant_scale=g')``; the quantizer and the
    scale DQs go once nothing uses them.
    """

    name = "TRT_FP4DynamicQuantize -> standard-op emulation"

    def matches(self, node: ir.Node) -> bool:
        return node.op_type == "TRT_FP4DynamicQuantize" and node.domain == TRT_DOMAIN

    @staticmethod
    def _scale_source(s_f: ir.Value | None, s_e4m3: ir.Value):
        """(ok, dequant_scale) for the value feeding the data DQ's scale: DQ(s_e4m3, g') -> g'; Cast -> None."""
        producer = s_f.producer() if s_f is not None else None
        if producer is None or not producer.inputs or producer.inputs[0] is not s_e4m3:
            return False, None
        if producer.op_type == "DequantizeLinear" and len(producer.inputs) >= 2:
            return True, producer.inputs[1]
        if producer.op_type == "Cast" and _attr(producer, "to") == ir.DataType.FLOAT:
            return True, None
        return False, None

    def check(self, node: ir.Node) -> str | None:
        if len(node.inputs) < 2 or node.inputs[1] is None:
            return f"{node_label(node)}: no global scale input"
        if _attr(node, "block_size", 16) != 16 or _attr(node, "scale_type", 17) != 17:
            return f"{node_label(node)}: only block_size=16 with E4M3 scales (scale_type=17) is an NVFP4 quantizer"
        x = node.inputs[0]
        rank = _rank(x)
        if _attr(node, "axis", -1) not in (-1, None if rank is None else rank - 1):
            return f"{node_label(node)}: quantized axis is not the last one"
        x_fp4, s_e4m3 = node.outputs[0], node.outputs[1]
        for use in x_fp4.uses():
            consumer = use.node
            if consumer.op_type != "DequantizeLinear" or use.idx != 0:
                return f"{node_label(node)}: FP4 output feeds {consumer.op_type} {consumer.name!r}, not a DequantizeLinear"
            if _attr(consumer, "block_size", 0) != 16 or _attr(consumer, "axis", 1) not in (-1, None if rank is None else rank - 1):
                return f"{consumer.name}: DQ of the FP4 activations is not block 16 along the last axis"
            ok, _ = self._scale_source(consumer.inputs[1], s_e4m3)
            if not ok:
                return f"{consumer.name}: its scale is not DQ/Cast of the quantizer's E4M3 scales"
        if x_fp4.is_graph_output() or s_e4m3.is_graph_output():
            return f"{node_label(node)}: FP4 outputs are graph outputs"
        return None

    def rewrite(self, scope: Scope, node: ir.Node) -> None:
        graph = scope.graph
        x, g = node.inputs[0], node.inputs[1]
        x_fp4, s_e4m3 = node.outputs[0], node.outputs[1]
        for i, use in enumerate(list(x_fp4.uses())):
            dq = use.node
            _, dequant_scale = self._scale_source(dq.inputs[1], s_e4m3)
            tape = ir.tape.Tape()
            stem = (node.name or x.name or "act") + (f"_{i}" if i else "")
            out_dtype = _attr(dq, "output_dtype", 0)  # else the scale's type: FLOAT for DQ(s_e4m3, g FP32)
            y = emulate.nvfp4_fake_quant(tape, x, g, name=stem,
                                         dequant_scale=emulate.SAME if dequant_scale is g else dequant_scale,
                                         output_dtype=ir.DataType(out_dtype) if out_dtype else
                                         (dq.inputs[1].dtype or ir.DataType.FLOAT))
            for init in tape.initializers:
                scope.adopt(init)
            ir.convenience.replace_nodes_and_values(graph, dq, [dq], tape.nodes, [dq.outputs[0]], [y])
        for use in list(s_e4m3.uses()):
            scale_node = use.node
            if not any(out.uses() or out.is_graph_output() for out in scale_node.outputs):
                graph.remove(scale_node, safe=True)
        graph.remove(node, safe=True)


def lower(model: ir.Model, *, for_reference: bool = False) -> tuple[ir.Model, LoweringReport]:
    """A lowered copy of ``model`` (input untouched; tensors shared, not copied) and what was done.

    ``for_reference``: for ``onnx.reference`` instead of onnxruntime. It runs FP4 / E8M0 DequantizeLinear
    itself, so only TensorRT's activation quantizer (a custom op) is lowered, to the same standard ops.
    """
    try:
        lowered = model.clone()
    except (RuntimeError, ValueError) as exc:  # onnx_ir refuses to copy a graph that reads undefined values
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ModelError(f"the model cannot be copied to be run, it is not a valid graph: {first[:240]}") from exc
    lowerings = ([LowerTRTFP4DynamicQuantize()] if for_reference else
                 [LowerTRTFP4DynamicQuantize(), LowerQMoEFP4(), LowerFP4DequantizeLinear()])
    results = run_passes([*lowerings, RemoveUnusedOpsetsPass()], lowered)[:len(lowerings)]
    report = LoweringReport.of(results)
    if not for_reference:  # configured with what TensorRT's quantizer lowering did (its first result)
        run_passes([SetOrtVersions(emulated=bool(results[0].lowered), emulated_functions=results[0].functions)],
                   lowered)
    logger.debug("lowering for %s: %s", "onnx.reference" if for_reference else "onnxruntime", report.summary())
    return lowered, report


def lower_for_ort(model: ir.Model) -> ir.Model:
    """A copy of ``model`` that onnxruntime 1.31 runs, computing exactly what the FP4 patterns define."""
    if not isinstance(model, ir.Model):
        raise ModelError(f"lower_for_ort takes an onnx_ir.Model, got {type(model).__name__}")
    return lower(model)[0]


def _has_fp4(model: ir.Model) -> bool:
    """Whether an FP4 tensor is stored anywhere: an initializer of any graph, or a Constant node."""
    if any(v.dtype == ir.DataType.FLOAT4E2M1 for graph in model.graphs() for v in graph.initializers.values()):
        return True
    return any(node.op_type == "Constant" and constant_tensor(node.outputs[0]) is not None
               and constant_tensor(node.outputs[0]).dtype == ir.DataType.FLOAT4E2M1 for node in all_nodes(model))


class SetOrtVersions(ir.passes.InPlacePass):
    """Pass 5 of the module docstring: the versions and imports onnxruntime needs after the lowerings."""

    def __init__(self, emulated: bool = False, emulated_functions=()) -> None:
        """``emulated``: TensorRT's activation quantizer was lowered to standard ops (which need opset
        :data:`emulate.MIN_OPSET`), in the main graph or in ``emulated_functions``' bodies."""
        super().__init__()
        self.emulated, self.emulated_functions = emulated, list(emulated_functions)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = (model.ir_version, dict(model.opset_imports), [dict(f.opset_imports) for f in model.functions.values()])
        if any(n.domain == MS_DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        for function in model.functions.values():
            if any(n.domain == MS_DOMAIN for n in ir.traversal.RecursiveGraphIterator(function)):
                function.opset_imports.setdefault(MS_DOMAIN, 1)
                model.opset_imports.setdefault(MS_DOMAIN, 1)
        if self.emulated:
            model.opset_imports[""] = max(model.opset_imports.get("", emulate.MIN_OPSET), emulate.MIN_OPSET)
            for function in self.emulated_functions:
                function.opset_imports[""] = max(function.opset_imports.get("", emulate.MIN_OPSET), emulate.MIN_OPSET)
        ir_version = min(model.ir_version or ORT_MAX_IR_VERSION, ORT_MAX_IR_VERSION)
        model.ir_version = max(ir_version, FP4_MIN_IR_VERSION) if _has_fp4(model) else ir_version
        after = (model.ir_version, dict(model.opset_imports), [dict(f.opset_imports) for f in model.functions.values()])
        return ir.passes.PassResult(model, before != after)
