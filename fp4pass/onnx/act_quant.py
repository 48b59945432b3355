"""Insert calibrated NVFP4 activation quantizers in front of the consumers of FP4 weights.

For each calibrated activation x (a mapping name -> :class:`QuantizerScale`) with ``input_scale = g_amax / (6*448)``
(a multiplier applied on dequantize, ModelOpt/TensorRT convention), one quantizer is inserted, however many
consumers read x, and only the FP4 consumers' activation inputs are rewired to it (other readers of x keep
the float x). Names of everything already in the graph stay as they were; new names start with ``{x}_nvfp4``.

1. ``target="trt"`` (TensorRT's importer form, as ModelOpt exports it)::

       x_fp4, s_e4m3 = trt::TRT_FP4DynamicQuantize(x, g; axis=-1, block_size=16, scale_type=17)
       s_f           = DequantizeLinear(s_e4m3, g_dq)                       E4M3 block scales * g_dq
       x_hat         = DequantizeLinear(x_fp4, s_f; axis=-1, block_size=16)

   ``g`` is a scalar FP32 initializer = input_scale (TensorRT requires block 16, the FP8 E4M3 scale type 17
   and a scalar initializer global scale).
2. ``target="reference"``: :func:`fp4pass.onnx.emulate.nvfp4_fake_quant`, standard ops, bit-exact with
   ``NVFP4Tensor.quantize(x, global_scale=input_scale).dequantize()``; runs under onnxruntime and onnx.reference.
3. ``scale_form="alpha"``: the dequantize carries no activation global scale (g_dq = 1, the consumer sees
   E2M1 x E4M3 only) and each consumer's alpha initializer (``alphas``: consumer node name -> initializer
   name, scalar or per-expert [E]) is multiplied by input_scale, once per initializer. An activation with a
   consumer missing from ``alphas`` (it fell back to dq) keeps its scale in the DQ, and the report says so.

Where: one quantizer per graph that holds FP4 consumers of x (a consumer inside an If / Loop / Scan body gets
its quantizer in that body, before it); a consumer inside a local function's body is declined with the reason.

Declined, with the reason in the report: an activation no FP4 consumer reads, an activation not blocked along
its last axis (:func:`fp4pass.onnx.activations.activation_axis_reason`), a last dim that is not a multiple of 16.

Graph dtypes: x and x_hat keep the activation's type (FLOAT, FLOAT16 or BFLOAT16); the scales stay FLOAT.
``trt``: the quantizer reads x as it is (TensorRT's dynamic quantize takes FLOAT, FLOAT16 and BFLOAT16 data
with an FP32 scalar global scale, as ModelOpt exports it) and the data DQ writes ``output_dtype`` = x's type:
e2m1 * s_f formed in FP32 and rounded once. ``reference``: the emulation casts x to FLOAT inside and its
result back (:func:`fp4pass.onnx.emulate.nvfp4_fake_quant`), bit-exact with ``NVFP4Tensor`` on FLOAT(x).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fp4pass.choices import ActivationTarget, ScaleForm, values
from fp4pass.errors import ModelError, UsageError
from fp4pass.formats import NV_BLOCK_SIZE
from fp4pass.formats.constants import FP4_MIN_IR_VERSION, TRT_DOMAIN
from fp4pass.onnx.activations import activation_axis_reason
from fp4pass.onnx.dtypes import FLOAT_TYPES, value_dtype
from fp4pass.onnx.emulate import MIN_OPSET, nvfp4_fake_quant
from fp4pass.onnx.passes import function_graphs, function_label, function_of
from fp4pass.onnx.patterns import node_label

__all__ = ["insert_activation_quantizers", "InsertActivationQuantizers", "InsertResult", "QuantizerScale",
           "trt_quantizer", "TRT_DOMAIN", "TRT_QUANTIZE_OP", "TARGETS", "SCALE_FORMS"]

log = logging.getLogger(__name__)

TRT_QUANTIZE_OP = "TRT_FP4DynamicQuantize"
TARGETS = values(ActivationTarget)
SCALE_FORMS = values(ScaleForm)
TRT_MIN_OPSET = 23  # DequantizeLinear with FLOAT4E2M1 input


@dataclass(frozen=True)
class QuantizerScale:
    """The calibrated scale of one activation as this pass needs it: ``input_scale`` (= g_amax / (6*448), the
    FP32 multiplier applied on dequantize) and, for the report, ``g_amax`` (None when not known)."""

    input_scale: float
    g_amax: float | None = None


def quantizer_scales(scales) -> dict[str, QuantizerScale]:
    """``scales`` as {activation: QuantizerScale}: a mapping whose values are numbers (input_scale) or objects
    with ``input_scale`` (and optionally ``g_amax``) attributes, or an object holding such a mapping in
    ``.tensors`` (a calibration's result)."""
    tensors = getattr(scales, "tensors", scales)
    out = {}
    for name, value in tensors.items():
        if isinstance(value, (int, float)):
            out[name] = QuantizerScale(float(value))
        else:
            out[name] = QuantizerScale(float(value.input_scale), getattr(value, "g_amax", None))
    return out


def _scalar(name: str, value: float) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(np.asarray(value, dtype=np.float32), name=name),
                    type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))


def trt_quantizer(x: ir.Value, g: ir.Value, g_dq: ir.Value, prefix: str,
                  dtype: ir.DataType = ir.DataType.FLOAT) -> tuple[list[ir.Node], ir.Value]:
    """Form 1 of the module docstring on ``x`` of type ``dtype``: (the three nodes, x_hat); names start with
    ``prefix``."""
    quantize = ir.node(TRT_QUANTIZE_OP, [x, g], domain=TRT_DOMAIN, num_outputs=2, name=f"{prefix}/quantize",
                       attributes={"axis": -1, "block_size": NV_BLOCK_SIZE, "scale_type": ir.DataType.FLOAT8E4M3FN.value})
    x_fp4, s_e4m3 = quantize.outputs
    x_fp4.name, s_e4m3.name = f"{prefix}/x_fp4", f"{prefix}/scale_e4m3"
    x_fp4.type = ir.TensorType(ir.DataType.FLOAT4E2M1)
    s_e4m3.type = ir.TensorType(ir.DataType.FLOAT8E4M3FN)
    if x.shape is not None:
        x_fp4.shape = x.shape
        dims = list(x.shape.dims)
        if dims and isinstance(dims[-1], int):
            s_e4m3.shape = ir.Shape([*dims[:-1], dims[-1] // NV_BLOCK_SIZE])
    dq_scale = ir.node("DequantizeLinear", [s_e4m3, g_dq], name=f"{prefix}/dequantize_scale")
    s_f = dq_scale.outputs[0]
    s_f.name, s_f.type, s_f.shape = f"{prefix}/scale", ir.TensorType(ir.DataType.FLOAT), s_e4m3.shape
    attributes = {"axis": -1, "block_size": NV_BLOCK_SIZE}
    if dtype != ir.DataType.FLOAT:
        attributes["output_dtype"] = dtype
    dq_x = ir.node("DequantizeLinear", [x_fp4, s_f], name=f"{prefix}/dequantize", attributes=attributes)
    x_hat = dq_x.outputs[0]
    x_hat.name, x_hat.type, x_hat.shape = f"{prefix}/fake_quant", ir.TensorType(dtype), x.shape
    return [quantize, dq_scale, dq_x], x_hat


def _activation_dtype(node: ir.Node, index: int) -> ir.DataType:
    """The activation's type: its own when known, else the weight operand's (the consumer's inputs share one)."""
    dtype = value_dtype(node.inputs[index])
    if dtype is None and node.op_type in ("MatMul", "Gemm", "Einsum") and len(node.inputs) == 2:
        dtype = value_dtype(node.inputs[1 - index])
    return dtype or ir.DataType.FLOAT


def _consumers_by_activation(model: ir.Model) -> dict[str, list[tuple[ir.Node, int]]]:
    from fp4pass.onnx.matching import find_fp4_consumers

    groups: dict[str, list[tuple[ir.Node, int]]] = {}
    for node, index, _weight in find_fp4_consumers(model):
        value = node.inputs[index] if index is not None and index < len(node.inputs) else None
        if value is not None:
            groups.setdefault(value.name, []).append((node, index))
    return groups


def _ensure_opset(model: ir.Model, target: str) -> None:
    need = TRT_MIN_OPSET if target == "trt" else MIN_OPSET
    if model.opset_imports.get("", 1) < need:
        log.info("activation quantizers: default opset raised from %s to %d", model.opset_imports.get(""), need)
        model.opset_imports[""] = need
    if target == "trt":
        model.opset_imports.setdefault(TRT_DOMAIN, 1)
        if (model.ir_version or 0) < FP4_MIN_IR_VERSION:
            model.ir_version = FP4_MIN_IR_VERSION


def insert_activation_quantizers(model: ir.Model, scales, target: str = "trt",
                                 scale_form: str = "dq", alphas: dict[str, str] | None = None) -> list[dict]:
    """Insert one NVFP4 quantizer per calibrated activation, in place (module docstring); return the report.

    ``scales``: {activation name: input_scale or :class:`QuantizerScale`}, or anything
    :func:`quantizer_scales` reads (a calibration's result). :class:`InsertActivationQuantizers` run once.

    Report entries: ``{"activation", "consumers", "input_scale", "g_amax", "target", "scale_form",
    "inserted": bool, "reason", "alphas"}``.
    """
    return InsertActivationQuantizers(scales, target=target, scale_form=scale_form, alphas=alphas)(model).entries


def _function_reason(function: ir.Function) -> str:
    return (f"it sits inside function {function_label(function)}, whose values calibration does not observe and "
            "whose body is shared by every call; inline the function to quantize it")


@dataclass
class InsertResult(ir.passes.PassResult):
    """What :class:`InsertActivationQuantizers` did: ``entries``, one report entry per activation."""

    entries: list = field(default_factory=list)


class InsertActivationQuantizers(ir.passes.InPlacePass):
    """Stage 6 as an onnx_ir pass (module docstring): returns an :class:`InsertResult` (its ``entries`` the
    report); ``modified`` is True when a quantizer was inserted.

    Consumers are found everywhere (:func:`fp4pass.onnx.matching.find_fp4_consumers`). One quantizer serves
    the consumers of one graph: a consumer inside an If / Loop / Scan body gets a quantizer in that body,
    placed before it (its name gets ``_{n}`` after ``_nvfp4``), reading the outer activation and the one
    global scale initializer of the main graph. A consumer inside a local function's body is declined with
    the reason in the entry.
    """

    def __init__(self, scales, target: str = "trt", scale_form: str = "dq", alphas: dict[str, str] | None = None):
        super().__init__()
        if target not in TARGETS:
            raise UsageError(f"activation quantizers: target must be one of {', '.join(TARGETS)}, got {target!r}")
        if scale_form not in SCALE_FORMS:
            raise UsageError(f"activation quantizers: scale_form must be dq or alpha, got {scale_form!r}")
        if scale_form == "alpha" and alphas is None:
            raise UsageError("activation quantizers: scale_form 'alpha' needs the consumers' alpha initializers")
        self.scales, self.target, self.scale_form, self.alphas = scales, target, scale_form, alphas

    def call(self, model: ir.Model) -> InsertResult:
        groups, owners = _consumers_by_activation(model), function_graphs(model)
        scaled_alphas: dict[str, float] = {}  # alpha initializer -> the input scale it was multiplied by
        scales = quantizer_scales(self.scales)
        entries = [self._insert(model, name, scale, groups, owners, scaled_alphas) for name, scale in scales.items()]
        entries += self._unscaled(groups, owners, scales)
        inserted = any(e["inserted"] for e in entries)
        if inserted:
            _ensure_opset(model, self.target)
        return InsertResult(model, inserted, entries)

    def _unscaled(self, groups, owners, scales) -> list[dict]:
        """Entries for the activations an FP4 consumer could quantize but ``scales`` has no scale for: they
        stay in full precision, which the report says (and a warning), rather than nothing at all."""
        entries = []
        for name, uses in groups.items():
            if name in scales:
                continue
            consumers = [node_label(node) for node, index in uses
                         if function_of(node, owners) is None and activation_axis_reason(node, index) is None]
            if not consumers:
                continue
            log.warning("activation %r (read by %s) has no scale: left in full precision", name, ", ".join(consumers))
            entries.append({"activation": name, "consumers": consumers, "input_scale": None, "g_amax": None,
                            "target": self.target, "scale_form": self.scale_form, "inserted": False,
                            "reason": "no scale for it in the calibration: left in full precision", "alphas": []})
        return entries

    def _insert(self, model: ir.Model, name: str, scale: QuantizerScale, groups, owners, scaled_alphas) -> dict:
        target, scale_form, alphas = self.target, self.scale_form, self.alphas
        main = model.graph
        entry = {"activation": name, "consumers": [], "input_scale": scale.input_scale, "g_amax": scale.g_amax,
                 "target": target, "scale_form": scale_form, "inserted": False, "reason": None, "alphas": []}
        uses = groups.get(name, [])
        left: list[tuple[str, str]] = []  # (consumer, reason) of the consumers not quantized
        usable = []
        for node, index in uses:
            function = function_of(node, owners)
            reason = _function_reason(function) if function is not None else activation_axis_reason(node, index)
            if reason is None:
                usable.append((node, index))
            else:
                left.append((node_label(node), reason))
        if not usable:
            entry["reason"] = (left[0][1] if left else "no FP4 consumer (MatMul/Gemm/Einsum/QMoE) reads it")
            return entry
        x = usable[0][0].inputs[usable[0][1]]
        dims = list(x.shape.dims) if x.shape is not None else []
        if dims and isinstance(dims[-1], int) and dims[-1] % NV_BLOCK_SIZE:
            entry["reason"] = f"last dim {dims[-1]} is not a multiple of 16"
            return entry
        prefix = f"{name}_nvfp4"
        dtype = _activation_dtype(usable[0][0], usable[0][1])
        if dtype not in FLOAT_TYPES:
            entry["reason"] = f"activation is {dtype.name}, not a float type"
            return entry
        g = _scalar(f"{prefix}/input_scale", scale.input_scale)
        main.register_initializer(g)
        form = scale_form
        if form == "alpha" and any(node_label(n) not in alphas for n, _ in usable):
            form = "dq"  # a consumer without an alpha initializer (fell back to dq): one quantizer serves all
            entry["reason"] = "alpha form: a consumer has no alpha initializer; activation scale kept in the DQ"
        entry["scale_form"] = form
        if form == "alpha":
            g_dq = _scalar(f"{prefix}/dequant_scale_one", 1.0) if target == "trt" else None
            if g_dq is not None:
                main.register_initializer(g_dq)
        else:
            g_dq = g
        sites: dict[int, tuple[ir.Graph, list]] = {}  # one quantizer per graph holding consumers, main graph first
        for node, index in usable:
            sites.setdefault(id(node.graph), (node.graph, []))[1].append((node, index))
        for site, (graph, consumers) in enumerate(sorted(sites.values(), key=lambda s: s[0] is not main)):
            stem = name if site == 0 else f"{prefix}_{site}"
            if target == "trt":
                nodes, x_hat = trt_quantizer(x, g, g_dq, prefix if site == 0 else f"{prefix}_{site}", dtype)
            else:
                tape = ir.tape.Tape()
                x_hat = nvfp4_fake_quant(tape, x, g, name=stem, input_dtype=dtype,
                                         **({"dequant_scale": None} if form == "alpha" else {}))
                nodes = list(tape.nodes)
                for init in tape.initializers:
                    main.register_initializer(init)
            order = {id(node): i for i, node in enumerate(graph)}
            first = min((node for node, _ in consumers), key=lambda n: order[id(n)])
            graph.insert_before(first, nodes)
            for node, index in consumers:
                node.replace_input_with(index, x_hat)
                entry["consumers"].append(node_label(node))
                if form == "alpha":
                    entry["alphas"].append(_scale_alpha(main, node, alphas, scale.input_scale, scaled_alphas))
        entry["inserted"] = True
        if left:
            entry["reason"] = "; ".join(f"not quantized for {label}: {reason}" for label, reason in left)
        return entry


def _scale_alpha(graph: ir.Graph, node: ir.Node, alphas: dict[str, str], input_scale: float,
                 done: dict[str, float]) -> str:
    """Multiply the consumer's alpha initializer by ``input_scale`` (once per initializer)."""
    label = node_label(node)
    alpha_name = alphas.get(label)
    if alpha_name is None:
        raise ModelError(f"node {label}: scale_form 'alpha' but no alpha initializer is named for it")
    if alpha_name in done:
        if done[alpha_name] != input_scale:
            raise ModelError(f"alpha initializer {alpha_name!r} is shared by consumers of activations with "
                             f"different input scales ({done[alpha_name]} vs {input_scale})")
        return alpha_name
    alpha = node.graph.initializers.get(alpha_name) or graph.initializers.get(alpha_name)  # a branch's, or the model's
    if alpha is None or alpha.const_value is None:
        raise ModelError(f"node {label}: alpha initializer {alpha_name!r} is not in the graph")
    values = alpha.const_value.numpy().astype(np.float32) * np.float32(input_scale)
    alpha.const_value = ir.tensor(values, name=alpha_name)
    done[alpha_name] = input_scale
    return alpha_name
