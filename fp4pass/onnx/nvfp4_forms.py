"""fp4pass's own NVFP4 output in an ONNX graph: the weights and activation quantizers it holds, and their scales
checked by the rules of the checkpoint validator where the same rules apply.

Weights (every scale a multiplier applied on dequantize, ``x_hat = e2m1(W) * e4m3(S16) * G``):

1. ``dq``: ``DQ(W FLOAT4E2M1, DQ(S16 FLOAT8E4M3FN, G), axis=-1, block_size=16)``; ``G`` a scalar or a per-expert
   ``[E]`` FP32 initializer (the global scale).
2. ``alpha``: the same two DQs with ``G`` = 1, and the global scale on the consumer's output: a ``Mul`` of the
   MatMul's output by a constant (``alpha`` = G, times the activation's input_scale when the activation is
   quantized), or a Gemm's ``alpha`` attribute.
3. ``qmoe-nvfp4``: ``com.microsoft::QMoE(quant_type='nvfp4')``, E4M3 scales in inputs 3/6, FP32 ``[E]`` global
   scales in inputs 15/16.
4. ``gbq``: ``GatherBlockQuantized(W FLOAT4E2M1, idx, DQ(S16 E4M3, G), block_size=16)``.

Activation quantizers (``x_hat = e2m1(q) * e4m3(s) * input_scale``):

1. ``trt``: ``trt::TRT_FP4DynamicQuantize(x, input_scale; block_size=16)``;
2. ``reference``: the standard-op emulation (:func:`fp4pass.onnx.emulate.nvfp4_fake_quant`), found by its
   ``Div(block_amax, Mul(input_scale, 6))`` before the cast of the block scales to FLOAT8E4M3FN.

Checks (the checkpoint validator's kinds, the rules of :mod:`fp4pass.formats.scale_checks`): a global scale,
alpha or input_scale that is 0 (``zero_scale``: the weights or activations dequantize to 0), negative
(``negative_scale``) or NaN/Inf (``nonfinite_scale``); an E4M3 block scale whose code is NaN (0x7F/0xFF) or
carries the sign bit on a non-zero magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fp4pass.formats import NV_BLOCK_SIZE
from fp4pass.formats.constants import E2M1_MAX, MS_DOMAIN, TRT_DOMAIN
from fp4pass.formats.scale_checks import block_scale_problems, scale_value_problems
from fp4pass.onnx.passes import all_nodes
from fp4pass.onnx.patterns import QMOE_WEIGHTS, node_label, trace_consumers

__all__ = ["NVFP4Weight", "ActivationQuantizer", "find_nvfp4", "nvfp4_problems", "scheme"]

@dataclass
class NVFP4Weight:
    """One NVFP4 weight: ``global_scale`` as the graph applies it (``alpha`` in the alpha form), per expert."""

    name: str
    node: str
    form: str
    shape: list
    experts: int | None
    global_scale: np.ndarray | None
    block_scales: np.ndarray | None = field(repr=False, default=None)  # the E4M3 codes, uint8

    def to_json(self) -> dict:
        g = None if self.global_scale is None else [float(v) for v in self.global_scale.reshape(-1)]
        return {"name": self.name, "node": self.node, "form": self.form, "shape": self.shape, "experts": self.experts,
                "global_scale": g, "global_scale_is": "alpha" if self.form == "alpha" else "multiplier"}


@dataclass
class ActivationQuantizer:
    """One NVFP4 activation quantizer: the activation it reads and its ``input_scale`` (a multiplier)."""

    activation: str
    node: str
    form: str
    input_scale: np.ndarray | None

    def to_json(self) -> dict:
        scale = None if self.input_scale is None else [float(v) for v in self.input_scale.reshape(-1)]
        return {"activation": self.activation, "node": self.node, "form": self.form,
                "input_scale": scale[0] if scale is not None and len(scale) == 1 else scale}


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def _numbers(value: ir.Value | None) -> np.ndarray | None:
    """A constant's values as float64 (None when not a constant of numbers: a malformed model's scale)."""
    array = _const(value)
    return array.astype(np.float64) if array is not None and array.dtype.kind in "biuf" else None


def _dtype(value: ir.Value | None):
    return None if value is None or value.type is None else value.dtype


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _e4m3_codes(value: ir.Value | None) -> np.ndarray | None:
    array = _const(value)
    return None if array is None or array.dtype.itemsize != 1 else array.view(np.uint8)


def _scale_dq(value: ir.Value | None) -> ir.Node | None:
    """The ``DQ(S16 FLOAT8E4M3FN, G)`` producing ``value``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "" or node.op_type != "DequantizeLinear":
        return None
    return node if _dtype(node.inputs[0]) == ir.DataType.FLOAT8E4M3FN else None


def _alpha(dq: ir.Node) -> np.ndarray | None:
    """The global scale an alpha-form weight's consumer applies to its output (module docstring, form 2)."""
    for consumer in trace_consumers(dq.outputs[0]):
        node = consumer.node
        if node.op_type == "Gemm":
            return np.asarray([_attr(node, "alpha", 1.0)], dtype=np.float32)
        for user, _ in node.outputs[0].uses():
            if user.op_type == "Mul" and user.domain == "":
                other = [v for v in user.inputs if v is not node.outputs[0]]
                found = _numbers(other[0]) if other else None
                if found is not None:
                    return found
    return None


def _shape(value: ir.Value) -> list:
    """The dims of ``value`` for the report (a symbolic dim by its name)."""
    return [d if isinstance(d, int) else str(d) for d in (value.shape or [])]


def _producer(node: ir.Node | None, index: int) -> ir.Node | None:
    value = node.inputs[index] if node is not None and len(node.inputs) > index else None
    return value.producer() if value is not None else None


def _experts(shape: list, global_scale: np.ndarray | None) -> int | None:
    size = None if global_scale is None else global_scale.size
    return size if size and size > 1 and len(shape) == 3 and shape[0] == size else None


def _dq_weight(node: ir.Node) -> NVFP4Weight | None:
    if node.domain != "" or node.op_type != "DequantizeLinear" or _dtype(node.inputs[0]) != ir.DataType.FLOAT4E2M1:
        return None
    scale = _scale_dq(node.inputs[1] if len(node.inputs) > 1 else None)
    if _attr(node, "block_size", 0) != NV_BLOCK_SIZE or scale is None or node.inputs[0].const_value is None:
        return None
    g = _numbers(scale.inputs[1] if len(scale.inputs) > 1 else None)
    form = "dq"
    if g is not None and g.size == 1 and float(g.reshape(-1)[0]) == 1.0:
        alpha = _alpha(node)
        if alpha is not None:
            form, g = "alpha", alpha
    shape = _shape(node.inputs[0])
    return NVFP4Weight(node.inputs[0].name, node_label(node), form, shape, _experts(shape, g), g,
                       _e4m3_codes(scale.inputs[0]))


def _gbq_weight(node: ir.Node) -> NVFP4Weight | None:
    if node.domain != MS_DOMAIN or node.op_type != "GatherBlockQuantized" or len(node.inputs) < 3:
        return None
    scale = _scale_dq(node.inputs[2])
    if _dtype(node.inputs[0]) != ir.DataType.FLOAT4E2M1 or scale is None:
        return None
    g = _numbers(scale.inputs[1] if len(scale.inputs) > 1 else None)
    shape = _shape(node.inputs[0])
    return NVFP4Weight(node.inputs[0].name, node_label(node), "gbq", shape, None, g, _e4m3_codes(scale.inputs[0]))


def _qmoe_weights(node: ir.Node) -> list[NVFP4Weight]:
    if node.domain != MS_DOMAIN or node.op_type != "QMoE" or _attr(node, "quant_type", "int") != "nvfp4":
        return []
    found = []
    for wi, si, gi in QMOE_WEIGHTS.values():
        if len(node.inputs) <= si or node.inputs[wi] is None:
            continue
        g = _numbers(node.inputs[gi]) if len(node.inputs) > gi else None
        shape = _shape(node.inputs[wi])
        experts = shape[0] if shape and isinstance(shape[0], int) else None
        found.append(NVFP4Weight(node.inputs[wi].name, node_label(node), "qmoe-nvfp4", shape, experts, g,
                                 _e4m3_codes(node.inputs[si])))
    return found


def _trt_quantizer(node: ir.Node) -> ActivationQuantizer | None:
    if node.domain != TRT_DOMAIN or node.op_type != "TRT_FP4DynamicQuantize":
        return None
    x = node.inputs[0]
    return ActivationQuantizer(x.name if x is not None else "?", node_label(node), "trt",
                               _numbers(node.inputs[1] if len(node.inputs) > 1 else None))


def _source_activation(value: ir.Value) -> str:
    """The activation an emulated quantizer reads: back through its ReduceMax/Abs/Reshape/Cast."""
    node = value.producer()
    while node is not None and node.op_type in ("ReduceMax", "Abs", "Reshape", "Cast") and node.inputs \
            and node.inputs[0] is not None:
        value = node.inputs[0]
        node = value.producer()
    return value.name


def _reference_quantizer(node: ir.Node) -> ActivationQuantizer | None:
    """The emulation's ``Cast(Clip(Div(block_amax, Mul(input_scale, 6))), to=FLOAT8E4M3FN)`` (module docstring)."""
    if node.op_type != "Cast" or _attr(node, "to", None) != ir.DataType.FLOAT8E4M3FN:
        return None
    clip = _producer(node, 0)
    div = _producer(clip, 0) if clip is not None and clip.op_type == "Clip" else None
    six_g = _producer(div, 1) if div is not None and div.op_type == "Div" else None
    if six_g is None or six_g.op_type != "Mul" or div.inputs[0] is None:
        return None
    consts = [_numbers(v) for v in six_g.inputs]
    if len(consts) != 2 or any(c is None for c in consts):
        return None
    six = [i for i, c in enumerate(consts) if c.size == 1 and float(c.reshape(-1)[0]) == E2M1_MAX]
    if not six:
        return None
    return ActivationQuantizer(_source_activation(div.inputs[0]), node_label(node), "reference",
                               consts[1 - six[-1]])


def find_nvfp4(model: ir.Model) -> tuple[list[NVFP4Weight], list[ActivationQuantizer]]:
    """Every NVFP4 weight and activation quantizer of fp4pass's forms in ``model`` (subgraphs included)."""
    weights: list[NVFP4Weight] = []
    quantizers: list[ActivationQuantizer] = []
    for node in all_nodes(model):
        weight = _dq_weight(node) or _gbq_weight(node)
        weights.extend([weight] if weight is not None else _qmoe_weights(node))
        quantizer = _trt_quantizer(node) or _reference_quantizer(node)
        if quantizer is not None:
            quantizers.append(quantizer)
    return weights, quantizers


def scheme(quantizers: list) -> str:
    """W4A4 with activation quantizers, W4A16 (weights only) without."""
    return "W4A4" if quantizers else "W4A16"


def _where(values: np.ndarray, per_expert: bool) -> str:
    index = int(np.flatnonzero(values)[0])
    return f"expert {index}" if per_expert else f"element {index}"


_CONSEQUENCES = {"nonfinite_scale": "NaN or infinite: every value it scales is NaN",
                 "zero_scale": "0: every value it scales dequantizes to 0",
                 "negative_scale": "negative: every value it scales flips its sign"}
_BLOCK_WORDS = {"nonfinite_scale": "NaN (code 0x7F/0xFF)", "negative_scale": "negative (sign bit set)"}


def _scale_problems(what: str, values: np.ndarray | None, per_expert: bool, fix: str) -> list[dict]:
    if values is None:
        return []
    flat = values.reshape(-1)
    problems = []
    for kind, bad in scale_value_problems(flat):
        if bad.any():
            consequence = _CONSEQUENCES[kind]
            first = int(np.flatnonzero(bad)[0])
            where = f" ({int(bad.sum())} of {flat.size}, first {_where(bad, per_expert)})" if flat.size > 1 else ""
            problems.append({"kind": kind, "tensor": what, "message": f"{what}: {float(flat[first])!r} is "
                             f"{consequence}{where}; fix: {fix}"})
    return problems


def _block_problems(weight: NVFP4Weight, fix: str) -> list[dict]:
    codes = weight.block_scales
    if codes is None:
        return []
    problems = []
    for kind, bad in block_scale_problems(codes):
        what = _BLOCK_WORDS[kind]
        count = int(np.count_nonzero(bad))
        if count:
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            problems.append({"kind": kind, "tensor": weight.name, "message": f"{weight.name}: {count} E4M3 block "
                             f"scale(s) are {what}, first at index {list(first)}; fix: {fix}"})
    return problems


def nvfp4_problems(weights: list[NVFP4Weight], quantizers: list[ActivationQuantizer]) -> list[dict]:
    """``[{"kind", "tensor", "message"}]``: the scales that break the validator's value rules (module docstring)."""
    fix = "convert the MXFP4 source again (fp4pass convert)"
    problems = []
    for w in weights:
        label = f"{w.name} {'alpha (global scale on the output)' if w.form == 'alpha' else 'global scale'}"
        problems += _scale_problems(label, w.global_scale, w.experts is not None, fix)
        problems += _block_problems(w, fix)
    for q in quantizers:
        problems += _scale_problems(f"activation {q.activation} input_scale", q.input_scale, False,
                                    "calibrate again (fp4pass calibrate) and convert with --scales")
    return problems
