"""``fp4pass.fx.export`` (this module: ``fp4pass.fx.exporter``): torch program with fp4pass ops -> ONNX FP4 forms.

Signature::

    model = export(model, example_inputs, path=None, target="trt", *, dynamic_shapes=None,
                   external_data="auto")          # -> onnx_ir.Model, also written to ``path`` when given

``model``: an ``ExportedProgram``, or an ``nn.Module`` / ``GraphModule`` first exported with
``torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)``. ``example_inputs``: a tuple
of positional inputs, a dict of keyword inputs, or one tensor.

Staged as export -> lower -> set opset/IR -> save:

1. ``torch.onnx.export(program, dynamo=True, custom_translation_table=...)`` writes each fp4pass op as a
   placeholder node of the private domain ``fp4pass.export`` (the exporter has no FP4/E8M0 dtypes, so the
   codes and scales come out as UINT8 initializers), every other op as the exporter does. Tensor names are
   the fx node names.
2. Lower each placeholder with ``onnx_ir``:

   1. ``dequantize_mxfp4(codes, scales)`` -> ``DequantizeLinear-24(W FLOAT4E2M1 [.., K], S FLOAT8E8M0
      [.., K/32], axis=-1, block_size=32, output_dtype=FLOAT)``: the same bytes, retyped (FLOAT4E2M1 raw data
      is the packed codes, low nibble first; FLOAT8E8M0 the E8M0 codes). x_hat = e2m1(W) * 2^(S - 127).
   2. ``dequantize_nvfp4(codes, scales, global_scale)`` -> the TensorRT / ModelOpt two-DQ form::

          s_f   = DequantizeLinear(S FLOAT8E4M3FN [.., K/16], G FP32 [] or [E] (axis=0))   # e4m3(S) * G
          x_hat = DequantizeLinear(W FLOAT4E2M1 [.., K], s_f, axis=-1, block_size=16)     # e2m1(W) * s_f

      the FP32 product e4m3(S) * G formed at run time, never stored in E4M3.
   3. ``fake_quantize_nvfp4(x, input_scale)`` -> the ``target`` form of
      :mod:`fp4pass.onnx.act_quant`: ``trt``: ``trt::TRT_FP4DynamicQuantize`` + two DQs
      (:func:`~fp4pass.onnx.act_quant.trt_quantizer`); ``reference``: the standard-op decomposition
      :func:`fp4pass.onnx.emulate.nvfp4_fake_quant`, bit-exact with ``NVFP4Tensor.quantize``. ``input_scale``
      becomes the scalar FP32 initializer ``{x}_nvfp4/input_scale``; FLOAT16/BFLOAT16 activations are cast
      to FLOAT around the quantizer.

   Each lowered dequantize's output keeps its fx name; a quantizer's output is named
   ``{x}_fake_quantize_nvfp4``, the name :func:`fp4pass.fx.calibrate` gives its node (torch.onnx's
   decompositions rename custom nodes after their op). A uint8 initializer read only by lowered nodes is replaced
   by its typed form under the same name; one also read elsewhere stays, beside a ``{name}_fp4`` /
   ``_e8m0`` / ``_e4m3`` copy. Codes reshaped from a constant (``Reshape`` to a static shape, ``Identity``)
   are read through the reshape, and their typed initializer takes the program's weight name
   (:func:`weight_names`). Codes or scales computed in the graph (not constants) raise ModelError.
   4. ``RMSNormalization(X BFLOAT16|FLOAT16, scale FLOAT)``, which torch.onnx writes for a 16-bit model whose
      norm computes in FP32 (transformers' RMSNorms, gpt-oss's among them), gets ``Cast(X, to=FLOAT)`` in
      front: the ONNX checker refuses an X type other than the scale's, and widening a 16-bit float to FP32 is
      exact, so the node computes what it did (``stash_type`` 1 already normalises in FP32).
3. Opset and IR: the lowest that hold the types (:class:`fp4pass.onnx.rewrite_cleanup.SetOpsetAndIR`): the
   exporter's default opset 20, 21 for the reference quantizer, 23 for FP4 DequantizeLinear (torch converts
   its ops up to 23), 24 where E8M0 scales remain or a TopK reads BFLOAT16 (a number change: 24 adds the E8M0
   type and bfloat16 TopK); IR 11 for FP4 /
   E4M3, 12 for E8M0.
4. Save (``path``): atomically, through :func:`fp4pass.onnx.loading.save` (``external_data`` auto | always
   | never; auto goes external past 2 GiB of weights).
"""

from __future__ import annotations

import logging
import os
import re

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnxscript.values import Op, Opset

from fp4pass.choices import ActivationTarget, values
from fp4pass.errors import ModelError, UsageError
from fp4pass.formats import MX_BLOCK_SIZE, NV_BLOCK_SIZE, MXFP4Tensor
from fp4pass.fx import act_ops  # noqa: F401  (registers torch.ops.fp4pass.fake_quantize_nvfp4)
from fp4pass.fx import ops  # noqa: F401  (registers torch.ops.fp4pass.dequantize_*)
from fp4pass.onnx.act_quant import TRT_DOMAIN, TRT_MIN_OPSET, trt_quantizer
from fp4pass.onnx.emulate import MIN_OPSET as REFERENCE_MIN_OPSET
from fp4pass.onnx.emulate import nvfp4_fake_quant
from fp4pass.onnx.rewrite_cleanup import SetOpsetAndIR
from fp4pass.fx.noise import quiet_torch

__all__ = ["export", "TARGETS", "TRANSLATION_TABLE", "lower_placeholders"]

log = logging.getLogger(__name__)

TARGETS = values(ActivationTarget)  # the form of the exported activation fake-quants
PLACEHOLDER_DOMAIN = "fp4pass.export"
EXPORTER_DEFAULT_OPSET = 20  # torch.onnx's own default
FP4_DQ_OPSET = 23  # DequantizeLinear with FLOAT4E2M1 input
E8M0_DQ_OPSET = 24  # DequantizeLinear with FLOAT8E8M0 scales


def _schema(name: str, inputs: int, float_attributes: tuple[str, ...] = ()) -> onnx.defs.OpSchema:
    """An OpSchema for a placeholder op, so that the exporter's op recorder can build the node."""
    param = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        name, PLACEHOLDER_DOMAIN, 1,
        inputs=[param(f"input_{i}", f"T{i}") for i in range(inputs)],
        outputs=[param("output", "T_out")],
        type_constraints=[(f"T{i}", ["tensor(uint8)", "tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")
                          for i in range(inputs)]
        + [("T_out", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[onnx.defs.OpSchema.Attribute(a, onnx.defs.OpSchema.AttrType.FLOAT, "") for a in float_attributes],
    )


_OPSET = Opset(PLACEHOLDER_DOMAIN, 1)
_DEQUANTIZE_MXFP4 = Op(_OPSET, "DequantizeMXFP4", _schema("DequantizeMXFP4", 2))
_DEQUANTIZE_NVFP4 = Op(_OPSET, "DequantizeNVFP4", _schema("DequantizeNVFP4", 3))
_FAKE_QUANTIZE_NVFP4 = Op(_OPSET, "FakeQuantizeNVFP4", _schema("FakeQuantizeNVFP4", 1, ("global_scale",)))


def _translate_dequantize_mxfp4(codes, scales):
    return _DEQUANTIZE_MXFP4(codes, scales)


def _translate_dequantize_nvfp4(codes, scales, global_scale):
    return _DEQUANTIZE_NVFP4(codes, scales, global_scale)


def _translate_fake_quantize_nvfp4(x, global_scale: float):
    return _FAKE_QUANTIZE_NVFP4(x, global_scale=float(global_scale))


TRANSLATION_TABLE = {
    torch.ops.fp4pass.dequantize_mxfp4.default: _translate_dequantize_mxfp4,
    torch.ops.fp4pass.dequantize_nvfp4.default: _translate_dequantize_nvfp4,
    torch.ops.fp4pass.fake_quantize_nvfp4.default: _translate_fake_quantize_nvfp4,
}


# -- step 2: lowering ----------------------------------------------------------------------------------------


class _TypedInitializers:
    """Typed copies of the exporter's uint8 initializers (FP4 codes, E8M0 / E4M3 scales), one per (value, type)."""

    _SUFFIX = {ir.DataType.FLOAT4E2M1: "fp4", ir.DataType.FLOAT8E8M0: "e8m0", ir.DataType.FLOAT8E4M3FN: "e4m3"}
    _VIEW = {ir.DataType.FLOAT8E8M0: ml_dtypes.float8_e8m0fnu, ir.DataType.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn}

    def __init__(self, graph: ir.Graph, source_names: dict[ir.Value, str] | None = None):
        self.graph = graph
        self.made: dict[tuple[int, ir.DataType], tuple[ir.Value, ir.Value]] = {}
        self.source_names = source_names if source_names is not None else {}

    @staticmethod
    def codes(value: ir.Value | None, role: str, node: ir.Node) -> np.ndarray:
        """The uint8 bytes of a constant input, or a ModelError naming the node."""
        array = _constant(value)
        if array is None:
            raise ModelError(f"fx export: node {node.name!r}: {role} {getattr(value, 'name', None)!r} is not a "
                             "constant of the program (computed in the graph or an input); FP4 ONNX needs it as "
                             "an initializer")
        if array.dtype != np.uint8:
            raise ModelError(f"fx export: node {node.name!r}: {role} {value.name!r} is {array.dtype}, not uint8 codes")
        return array

    def get(self, value: ir.Value, dtype: ir.DataType, array: np.ndarray) -> ir.Value:
        key = (id(value), dtype)
        if key not in self.made:
            name = f"{value.name}_{self._SUFFIX[dtype]}"
            if dtype == ir.DataType.FLOAT4E2M1:
                shape = ir.Shape([*array.shape[:-1], 2 * array.shape[-1]])
                tensor = ir.PackedTensor(array, dtype, shape=shape, name=name)
            else:
                tensor = ir.Tensor(array.view(self._VIEW[dtype]), dtype=dtype, name=name)
            typed = ir.Value(name=name, const_value=tensor, shape=ir.Shape(tensor.shape), type=ir.TensorType(dtype))
            self.graph.register_initializer(typed)
            self.made[key] = (value, typed)
        return self.made[key][1]

    def finish(self) -> None:
        """Drop the uint8 initializers (and Reshapes of them) nothing reads any more; their typed copies take
        their names. A copy of a reshaped or folded constant takes the program's weight name where known."""
        for old, typed in self.made.values():
            _drop_if_dead(self.graph, old)
            name = self.source_names.get(old, old.name)
            if old.uses() or old.is_graph_output() or name in self.graph.initializers:
                continue
            self.graph.initializers.pop(typed.name)
            typed.name = typed.const_value.name = name
            self.graph.register_initializer(typed)


_VIEW_OPS = ("Reshape", "Identity")


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The array of a constant, following ``Reshape`` (to a static shape) and ``Identity`` of a constant:
    the exporter's optimizer folds these only under a size limit. None when the value is computed."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.domain != "" or node.op_type not in _VIEW_OPS:
        return None
    data = _constant(node.inputs[0])
    if data is None or node.op_type == "Identity":
        return data
    if value.shape is None or not value.shape.is_static():
        return None
    return data.reshape(tuple(int(d) for d in value.shape))  # Reshape is row-major: the static shape decides


def _drop_if_dead(graph: ir.Graph, value: ir.Value) -> None:
    """Remove ``value``'s view-op producers and constant inputs once nothing reads them."""
    if value.uses() or value.is_graph_output():
        return
    node = value.producer()
    if node is None:
        if graph.initializers.get(value.name) is value and not value.is_graph_input():
            graph.initializers.pop(value.name)
        return
    if node.domain != "" or node.op_type not in _VIEW_OPS or node.graph is None:
        return
    inputs = [v for v in node.inputs if v is not None]
    node.graph.remove(node, safe=True)
    for v in inputs:
        _drop_if_dead(graph, v)


def _value(name: str, dtype: ir.DataType, shape) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)) if shape is not None else None)


def _lower_mxfp4(node: ir.Node, typed: _TypedInitializers) -> tuple[list[ir.Node], ir.Value]:
    codes, scales = node.inputs[:2]
    code_bytes = typed.codes(codes, "MXFP4 codes", node)
    scale_bytes = typed.codes(scales, "MXFP4 scales", node)
    MXFP4Tensor.from_codes(torch.from_numpy(code_bytes), torch.from_numpy(scale_bytes), name=codes.name)
    w = typed.get(codes, ir.DataType.FLOAT4E2M1, code_bytes)
    s = typed.get(scales, ir.DataType.FLOAT8E8M0, scale_bytes)
    out = _value(f"{node.name}_dq", ir.DataType.FLOAT, w.shape)
    dq = ir.Node("", "DequantizeLinear", [w, s], name=node.name, outputs=[out],
                 attributes=[ir.AttrInt64("axis", -1), ir.AttrInt64("block_size", MX_BLOCK_SIZE),
                             ir.AttrInt64("output_dtype", ir.DataType.FLOAT.value)])
    return [dq], out


def _lower_nvfp4(node: ir.Node, typed: _TypedInitializers) -> tuple[list[ir.Node], ir.Value]:
    codes, scales, global_scale = node.inputs[:3]
    code_bytes = typed.codes(codes, "NVFP4 codes", node)
    scale_bytes = typed.codes(scales, "NVFP4 scales", node)
    k = code_bytes.shape[-1] * 2
    if code_bytes.shape[:-1] != scale_bytes.shape[:-1] or k != scale_bytes.shape[-1] * NV_BLOCK_SIZE:
        raise ModelError(f"fx export: node {node.name!r}: codes {list(code_bytes.shape)} and scales "
                         f"{list(scale_bytes.shape)} do not fit NVFP4 (block 16)")
    w = typed.get(codes, ir.DataType.FLOAT4E2M1, code_bytes)
    s = typed.get(scales, ir.DataType.FLOAT8E4M3FN, scale_bytes)
    rank = len(global_scale.shape) if global_scale.shape is not None else None
    attributes = []
    if rank == 1:
        attributes.append(ir.AttrInt64("axis", 0))  # one global scale per expert, along the weights' axis 0
    elif rank != 0:
        raise ModelError(f"fx export: node {node.name!r}: global scale {global_scale.name!r} has shape "
                         f"{global_scale.shape}; the two-DQ form takes [] or one per expert [E]")
    s_f = _value(f"{node.name}_scale", ir.DataType.FLOAT, s.shape)
    dq_scale = ir.Node("", "DequantizeLinear", [s, global_scale], attributes, outputs=[s_f], name=f"{node.name}_scale")
    out = _value(f"{node.name}_dq", ir.DataType.FLOAT, w.shape)
    dq = ir.Node("", "DequantizeLinear", [w, s_f], name=node.name, outputs=[out],
                 attributes=[ir.AttrInt64("axis", -1), ir.AttrInt64("block_size", NV_BLOCK_SIZE)])
    return [dq_scale, dq], out


def _lower_fake_quant(node: ir.Node, graph: ir.Graph, target: str,
                      prefixes: set[str]) -> tuple[list[ir.Node], ir.Value]:
    x = node.inputs[0]
    attr = node.attributes.get("global_scale")
    if attr is None:
        raise ModelError(f"fx export: node {node.name!r}: fake quantizer without a global scale")
    prefix = f"{x.name}_nvfp4"
    while prefix in prefixes:
        prefix += "_"
    prefixes.add(prefix)
    g = ir.Value(name=f"{prefix}/input_scale", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]),
                 const_value=ir.tensor(np.asarray(attr.value, dtype=np.float32), name=f"{prefix}/input_scale"))
    graph.register_initializer(g)
    nodes: list[ir.Node] = []
    x_in = x
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        cast = ir.node("Cast", [x], attributes={"to": ir.DataType.FLOAT}, name=f"{prefix}/to_float")
        x_in = cast.outputs[0]
        x_in.name, x_in.type, x_in.shape = f"{prefix}/x_float", ir.TensorType(ir.DataType.FLOAT), x.shape
        nodes.append(cast)
    if target == "trt":
        quantizer, x_hat = trt_quantizer(x_in, g, g, prefix)
    else:
        tape = ir.tape.Tape()
        x_hat = nvfp4_fake_quant(tape, x_in, g, name=prefix[: -len("_nvfp4")])
        quantizer = list(tape.nodes)
        for init in tape.initializers:
            graph.register_initializer(init)
    nodes += quantizer
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        back = ir.node("Cast", [x_hat], attributes={"to": x.dtype}, name=f"{prefix}/to_{x.dtype.name.lower()}")
        x_hat = back.outputs[0]
        x_hat.name, x_hat.type, x_hat.shape = f"{prefix}/x_hat", ir.TensorType(x.dtype), x.shape
        nodes.append(back)
    return nodes, x_hat


def _fx_name(node: ir.Node) -> str:
    """The fx node an exported node came from: the last name scope torch.onnx records, else its own name."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    last = scopes.rsplit(",", 1)[-1].strip(" []'\"") if scopes else ""
    return last or node.name.removeprefix("node_")


_SCALE_NAME = re.compile(r"(.*)_nvfp4_(global_scale|scale_one|alpha(?:_\d+)?)$")
_CODES_SUFFIX = "_nvfp4_codes"
_TOWARD_WEIGHT = ("Transpose", "Reshape", "Expand", "Identity", "Unsqueeze", "Squeeze", "Cast", "MatMul", "Gemm")


def _weight_of(value: ir.Value | None, depth: int = 6) -> str | None:
    """The weight W whose NVFP4 dequantize (codes initializer ``W_nvfp4_codes``) ``value`` is computed from,
    through layout ops and one matmul: the weight a consumer-side scale belongs to."""
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return None
    if node.domain == PLACEHOLDER_DOMAIN and node.op_type == "DequantizeNVFP4":
        codes = node.inputs[0]
        name = codes.name if codes is not None else ""
        return name[: -len(_CODES_SUFFIX)] if name.endswith(_CODES_SUFFIX) else None
    if node.domain not in ("", "ai.onnx") or node.op_type not in _TOWARD_WEIGHT:
        return None
    found = {w for v in node.inputs if v is not None and v.const_value is None
             for w in [_weight_of(v, depth - 1)] if w is not None}
    return found.pop() if len(found) == 1 else None


def _unshare_scales(graph: ir.Graph, tensors: dict[str, torch.Tensor]) -> int:
    """Give each reader of a per-weight NVFP4 scale its own initializer, named as in the program, with its values.

    torch.onnx's optimizer merges initializers of equal value, so two weights with equal global scales (and
    every weight's ``scale_one``, always 1.0; equal ``alpha`` multipliers) would read one tensor under the first
    weight's name: a tool that edits one weight's scale would edit the other's. Run on the exported graph
    before lowering: a ``DequantizeNVFP4`` placeholder's weight W is named by its codes (``W_nvfp4_codes``);
    an ``alpha`` multiplier's weight is the one its other operand is computed from. A scale input named after
    another weight is replaced by an initializer of its own, ``W_nvfp4_{kind}`` with the program's values; a
    merged initializer nobody reads any more is dropped. Returns how many inputs were rewired.
    """
    shared: list[ir.Value] = []
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        for i, value in enumerate(node.inputs):
            if value is None or value.const_value is None or graph.initializers.get(value.name) is not value:
                continue
            match = _SCALE_NAME.fullmatch(value.name)
            if match is None:
                continue
            owner, kind = match.group(1), match.group(2)
            if node.domain == PLACEHOLDER_DOMAIN:
                codes = node.inputs[0].name if node.inputs[0] is not None else ""
                weight = codes[: -len(_CODES_SUFFIX)] if codes.endswith(_CODES_SUFFIX) else None
            else:
                others = [v for j, v in enumerate(node.inputs) if j != i and v is not None]
                found = {w for v in others for w in [_weight_of(v)] if w is not None}
                weight = found.pop() if len(found) == 1 else None
            if weight is None or weight == owner:
                continue
            name = f"{weight}_nvfp4_{kind}"
            if name not in tensors:
                candidates = [n for n in tensors if _SCALE_NAME.fullmatch(n) and n.startswith(f"{weight}_nvfp4_")
                              and _SCALE_NAME.fullmatch(n).group(2).split("_")[0] == kind.split("_")[0]]
                if len(candidates) != 1:
                    continue  # the program does not say which of its scales this is: leave it
                name = candidates[0]
            own = graph.initializers.get(name)
            if own is None:
                own = _own_initializer(graph, name, tensors[name].detach().cpu().numpy(), value, node, "scale")
            node.replace_input_with(i, own)
            shared.append(value)
    _drop_unread(graph, shared)
    return len(shared)


def _own_initializer(graph: ir.Graph, name: str, array: np.ndarray, merged: ir.Value, node: ir.Node,
                     what: str) -> ir.Value:
    """A float32 initializer ``name`` holding ``array``, typed like the ``merged`` one it replaces in ``node``."""
    if tuple(array.shape) != tuple(merged.const_value.shape):
        raise ModelError(f"fx export: {what} {name!r} of node {node.name!r} has shape {list(array.shape)} in the "
                         f"program, {list(merged.const_value.shape)} in ONNX")
    own = ir.Value(name=name, type=merged.type, shape=ir.Shape(array.shape),
                   const_value=ir.tensor(np.array(array, dtype=np.float32, order="C"), name=name))
    graph.register_initializer(own)
    return own


def _drop_unread(graph: ir.Graph, merged: list[ir.Value]) -> None:
    """Remove the merged initializers that nothing reads any more."""
    for value in merged:
        if not value.uses() and not value.is_graph_output() and graph.initializers.get(value.name) is value:
            graph.initializers.pop(value.name)


def _unshare_global_scales(graph: ir.Graph, names: dict[str, tuple[str | None, ...]],
                           tensors: dict[str, torch.Tensor]) -> None:
    """Give each NVFP4 placeholder its own global-scale initializer, named as in the program, with its values.

    torch.onnx's optimizer merges initializers of equal value, so two weights with equal global scales would
    read one tensor under the first weight's name: a tool that edits one weight's scale would edit the other's.
    Each reader whose initializer carries another weight's name gets an initializer of its own (the program's
    tensor under the program's name; a copy of the merged one when the program does not hold it); a merged
    initializer nobody reads any more is dropped.
    """
    shared: list[ir.Value] = []
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if node.domain != PLACEHOLDER_DOMAIN or node.op_type != "DequantizeNVFP4" or len(node.inputs) < 3:
            continue
        wanted = (names.get(_fx_name(node)) or (None, None, None))[2:3]
        value = node.inputs[2]
        if not wanted or not wanted[0] or value is None or value.const_value is None or value.name == wanted[0]:
            continue
        name = wanted[0]
        own = graph.initializers.get(name)
        if own is None:
            source = tensors.get(name)
            array = source.detach().cpu().numpy() if source is not None else value.const_value.numpy().copy()
            own = _own_initializer(graph, name, array, value, node, "global scale")
        node.replace_input_with(2, own)
        shared.append(value)
    _drop_unread(graph, shared)


def lower_placeholders(model: ir.Model, target: str = "trt",
                       weight_names: dict[str, tuple[str | None, ...]] | None = None,
                       tensors: dict[str, torch.Tensor] | None = None) -> dict:
    """Step 2 of the module docstring, in place. Returns ``{"mxfp4", "nvfp4", "fake_quantize"}`` node counts.

    ``weight_names``: fx dequant node name -> the program's names of its (codes, scales[, global scale])
    constants (:func:`weight_names`); typed initializers of reshaped or folded constants take these names, and
    each NVFP4 dequantize reads a global-scale initializer of its own under its name (``tensors``: the
    program's state dict and constants, for the values)."""
    graph = model.graph
    source_names: dict[ir.Value, str] = {}
    for node in graph:
        if node.domain == PLACEHOLDER_DOMAIN and weight_names:
            for value, name in zip(node.inputs, weight_names.get(_fx_name(node), ())):
                if value is not None and name:
                    source_names.setdefault(value, name)
    typed = _TypedInitializers(graph, source_names)
    if weight_names:
        _unshare_global_scales(graph, weight_names, tensors or {})
    prefixes: set[str] = set()
    counts = {"mxfp4": 0, "nvfp4": 0, "fake_quantize": 0}
    names: set[str] = set()
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if node.domain != PLACEHOLDER_DOMAIN:
            continue
        if node.op_type == "DequantizeMXFP4":
            new_nodes, out = _lower_mxfp4(node, typed)
            counts["mxfp4"] += 1
        elif node.op_type == "DequantizeNVFP4":
            new_nodes, out = _lower_nvfp4(node, typed)
            counts["nvfp4"] += 1
        elif node.op_type == "FakeQuantizeNVFP4":
            new_nodes, out = _lower_fake_quant(node, graph, target, prefixes)
            counts["fake_quantize"] += 1
        else:
            raise ModelError(f"fx export: node {node.name!r}: unknown placeholder op {node.op_type}")
        owner = node.graph
        owner.insert_before(node, new_nodes)
        old = node.outputs[0]
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        name = old.name
        if node.op_type == "FakeQuantizeNVFP4" and not out.is_graph_output():
            # torch.onnx's decompositions rename custom nodes after their op; fx.calibrate's name is {x}_...
            name = f"{node.inputs[0].name}_fake_quantize_nvfp4"
            while name in names:
                name += "_"
        names.add(name)
        owner.remove(node, safe=True)
        out.name = name
    typed.finish()
    model.opset_imports.pop(PLACEHOLDER_DOMAIN, None)
    return counts


_FX_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "alias", "contiguous", "clone", "view_copy"}


def weight_names(program: torch.export.ExportedProgram) -> dict[str, tuple[str | None, ...]]:
    """fx dequant node name -> the state-dict names its codes, scales (and NVFP4 global scale) are read from
    (through view ops)."""
    signature = program.graph_signature
    lifted = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
              **signature.inputs_to_lifted_tensor_constants}
    dequants = {torch.ops.fp4pass.dequantize_mxfp4.default, torch.ops.fp4pass.dequantize_nvfp4.default}

    def source(arg) -> str | None:
        while isinstance(arg, torch.fx.Node):
            if arg.op == "placeholder":
                return lifted.get(arg.name)
            name = getattr(arg.target, "__name__", "").split(".")[0]
            if arg.op != "call_function" or name not in _FX_VIEWS or not arg.args:
                return None
            arg = arg.args[0]
        return None

    return {n.name: tuple(source(a) for a in n.args[:3])
            for n in program.graph.nodes if n.op == "call_function" and n.target in dequants}


def _widen_rms_norm_inputs(model: ir.Model) -> int:
    """Cast a 16-bit X of ``RMSNormalization`` to its FP32 scale's type (module docstring, 2.4); the count."""
    widened = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "RMSNormalization" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        x, scale = node.inputs[0], node.inputs[1]
        if x is None or scale is None or x.dtype is None or x.dtype == scale.dtype:
            continue
        if not (x.dtype.is_floating_point() and scale.dtype.itemsize > x.dtype.itemsize):
            continue
        cast = ir.node("Cast", [x], attributes={"to": scale.dtype}, name=f"{node.name}_widen_x")
        cast.outputs[0].name = f"{x.name}_as_{scale.dtype.name.lower()}"
        cast.outputs[0].dtype, cast.outputs[0].shape = scale.dtype, x.shape
        node.graph.insert_before(node, cast)
        node.replace_input_with(0, cast.outputs[0])
        widened += 1
    return widened


def _has_bfloat16_topk(model: ir.Model) -> bool:
    """Whether a ``TopK`` reads BFLOAT16 (a bf16 router): torch.onnx writes it at opset 23, whose TopK has no
    bfloat16; opset 24's has, with the same semantics."""
    return any(n.op_type == "TopK" and n.inputs[0] is not None and n.inputs[0].dtype == ir.DataType.BFLOAT16
               for n in ir.traversal.RecursiveGraphIterator(model.graph))


def _needed_opset(program: torch.export.ExportedProgram, target: str) -> int:
    found = {n.target for n in program.graph.nodes if n.op == "call_function"}
    need = EXPORTER_DEFAULT_OPSET
    if torch.ops.fp4pass.fake_quantize_nvfp4.default in found:
        need = max(need, TRT_MIN_OPSET if target == "trt" else REFERENCE_MIN_OPSET)
    if torch.ops.fp4pass.dequantize_nvfp4.default in found:
        need = max(need, FP4_DQ_OPSET)
    if torch.ops.fp4pass.dequantize_mxfp4.default in found:
        need = max(need, E8M0_DQ_OPSET)
    return need


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def export(model, example_inputs, path: str | os.PathLike | None = None, target: str = "trt", *,
           dynamic_shapes=None, external_data: str = "auto") -> ir.Model:
    """Export ``model`` to ONNX with fp4pass ops in their ONNX forms (module docstring); returns the model."""
    if target not in TARGETS:
        raise UsageError(f"fx export: target must be one of {', '.join(TARGETS)}, got {target!r}")
    args, kwargs = _split_inputs(example_inputs)
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    elif isinstance(model, torch.nn.Module):
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
    else:
        raise UsageError(f"fx export: expected an ExportedProgram or an nn.Module, got {type(model).__name__}")
    need = _needed_opset(program, target)
    with quiet_torch():  # torch's LeafSpec deprecation and torchvision notes, nothing about the model
        onnx_program = torch.onnx.export(
            program, args, kwargs=kwargs or None, dynamo=True, custom_translation_table=TRANSLATION_TABLE,
            opset_version=min(need, FP4_DQ_OPSET), optimize=True, verbose=False)
    onnx_model = onnx_program.model
    tensors = {**program.state_dict, **program.constants}
    _unshare_scales(onnx_model.graph, tensors)  # a converted program: scales named after their weight
    counts = lower_placeholders(onnx_model, target, weight_names(program), tensors)  # fx names, any naming
    _widen_rms_norm_inputs(onnx_model)
    if counts["fake_quantize"] and target == "trt":
        onnx_model.opset_imports.setdefault(TRT_DOMAIN, 1)
    has_e8m0 = any(v.dtype == ir.DataType.FLOAT8E8M0 for v in onnx_model.graph.initializers.values())
    if (has_e8m0 or _has_bfloat16_topk(onnx_model)) and onnx_model.opset_imports.get("", 1) < E8M0_DQ_OPSET:
        onnx_model.opset_imports[""] = E8M0_DQ_OPSET
    SetOpsetAndIR(wrote_fp4_dq=bool(counts["mxfp4"] or counts["nvfp4"]))(onnx_model)
    log.info("fx export: %s; opset %s, IR %s", counts, onnx_model.opset_imports.get(""), onnx_model.ir_version)
    if path is not None:
        from fp4pass.onnx.loading import save

        save(onnx_model, path, external_data=external_data)
    return onnx_model
