"""Rewrite ``com.microsoft::QMoE(quant_type='fp4')`` into ``QMoE(quant_type='nvfp4')`` (pattern 2).

Per expert e and weight fc in {fc1, fc2}, every scale a multiplier applied on dequantize::

    in : x_hat[e] = e2m1(W[e]) * 2^(S32[e] - 127) * g_in[e]        (E8M0 per 32; g_in = 1 when absent)
    out: x_hat[e] = e2m1(W'[e]) * e4m3(S16[e]) * (g_in[e] * G[e])  (E4M3 per 16; FP32 [E] global scale)

``G`` is the converter's per-expert global scale; the product g_in * G is formed once in FP32 (exact when
g_in is 1 or a power of two) and never folded into the E4M3 scales. The input weights may be in either byte
layout (:mod:`fp4pass.onnx.qmoe_layout`); the output weights are always written, under their names, in the
layout onnxruntime's CUDA kernel for 'nvfp4' reads: uint8 [E, K, N/2], byte [e, k, j] = c[e, 2j, k] (low
nibble) | c[e, 2j+1, k] << 4. The E4M3 scales are new initializers ``{W}_scale_e4m3`` [E, N, K/16]; the
global scale replaces ``fc*_global_scale`` (inputs 15, 16), or is added as ``{W}_global_scale`` FP32 [E].
``block_size`` becomes 16, and the node gets the metadata ``fp4pass.qmoe_weight_layout = kernel`` so that
the layout stays known when its shapes alone cannot tell it. QMoE 'nvfp4' runs on the CUDA EP only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.patterns import QMOE_WEIGHTS, FP4Weight
from fp4pass.onnx.qmoe_layout import LAYOUT_KEY, WRITTEN_LAYOUT
from fp4pass.onnx.rewrite_common import WeightConversion

__all__ = ["QMoEToNVFP4", "prior_global_scale", "WRITTEN_LAYOUT"]


def prior_global_scale(record: FP4Weight) -> np.ndarray | None:
    """The fc*_global_scale the 'fp4' QMoE already applies (None when absent or all ones)."""
    gi = QMOE_WEIGHTS[record.slot][2]
    node = record.node
    if len(node.inputs) <= gi or node.inputs[gi] is None:
        return None
    g = node.inputs[gi].const_value.numpy().astype(np.float32).reshape(-1)
    return None if np.all(g == 1.0) else g


class QMoEToNVFP4:
    """One QMoE weight slot (fc1 or fc2) from MXFP4 to NVFP4; the node's attributes change once both are done."""

    form = "qmoe-nvfp4"

    def rewrite(self, record: FP4Weight, conv: WeightConversion) -> dict:
        node, graph = record.node, record.node.graph
        wi, si, gi = QMOE_WEIGHTS[record.slot]
        w = record.name
        codes = conv.codes_tensor(w, packed_uint8=True, layout=WRITTEN_LAYOUT)
        record.codes.const_value = codes
        record.codes.shape = ir.Shape(codes.shape)
        scales_tensor = conv.scales_tensor(f"{w}_scale_e4m3")
        scales = ir.Value(name=f"{w}_scale_e4m3", const_value=scales_tensor, shape=ir.Shape(scales_tensor.shape),
                          type=ir.TensorType(ir.DataType.FLOAT8E4M3FN))
        graph.register_initializer(scales)
        old_scales = record.scales
        node.replace_input_with(si, scales)
        if not old_scales.uses():
            graph.initializers.pop(old_scales.name, None)
        experts = record.shape[0]
        if len(node.inputs) > gi and node.inputs[gi] is not None:
            g_value = node.inputs[gi]
            g_value.const_value = _named(conv.global_tensor(g_value.name), g_value.name)
        else:
            if len(node.inputs) <= gi:
                node.resize_inputs(gi + 1)
            name = f"{w}_global_scale"
            g_value = ir.Value(name=name, const_value=conv.global_tensor(name), shape=ir.Shape([experts]),
                               type=ir.TensorType(ir.DataType.FLOAT))
            graph.register_initializer(g_value)
            node.replace_input_with(gi, g_value)
        node.attributes["quant_type"] = ir.AttrString("quant_type", "nvfp4")
        node.attributes["block_size"] = ir.AttrInt64("block_size", 16)
        node.metadata_props[LAYOUT_KEY] = WRITTEN_LAYOUT
        return {"form": self.form}


def _named(tensor: ir.LazyTensor, name: str) -> ir.LazyTensor:
    tensor.name = name
    return tensor
