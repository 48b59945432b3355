"""NVFP4 activation fake-quant in standard ONNX ops (opset >= 21), bit-exact with ``NVFP4Tensor``.

Signature::

    y = nvfp4_fake_quant(tape, x, global_scale, *, name="x", dequant_scale=SAME, input_dtype=None,
                         output_dtype=None)

- ``tape``: an ``onnx_ir.tape.Tape``; the nodes and the small constant initializers are recorded on it. The
  caller inserts ``tape.nodes`` into its graph and registers ``tape.initializers`` (names start with
  ``name`` so they stay unique), e.g.::

      tape = ir.tape.Tape()
      y = nvfp4_fake_quant(tape, x, g, name="act0")
      graph.insert_before(consumer, tape.nodes)
      for init in tape.initializers:
          graph.register_initializer(init)

- ``x``: a FLOAT, FLOAT16 or BFLOAT16 ``ir.Value`` of any rank whose last dim is a multiple of 16 (blocks run
  along the last axis). ``input_dtype`` gives its type where it cannot be told from the graph (default FLOAT). A 16-bit
  x is cast to FLOAT first (exact): the quantizer always computes in FLOAT.
- ``global_scale``: a FLOAT scalar ``ir.Value``, the activation ``input_scale = g_amax / (6*448)``
  (ModelOpt/TensorRT convention: a multiplier applied on dequantize).
- ``dequant_scale``: the FP32 scale the dequantize multiplies into the E4M3 block scales; by default the same
  ``global_scale`` (TensorRT's ``DQ(s_e4m3, g)``), ``None`` for the alpha form where the scales' DQ carries
  no global scale (the product then goes onto the consumer's output).
- ``output_dtype``: the type of ``y`` (default: x's); y is the FLOAT result cast to it at the end (one
  rounding; an E2M1 x E4M3 product, the alpha form's ``dequant_scale=None``, is exact in FLOAT16 and BFLOAT16).
- returns ``y``: same shape as ``x``.

The math, in exactly the float32 operations of :meth:`fp4pass.NVFP4Tensor.quantize` then ``dequantize``::

    xb          = Reshape(x, [-1, 16])
    block_scale = e4m3(Clip(ReduceMax(|xb|) / (6 * g), 2^-9, 448))      Cast to FLOAT8E4M3FN (RNE) and back
    s           = block_scale * g
    a           = xb / s
    q           = Round(2|a|)/2        where |a| < 2        (step 0.5: 0, 0.5, 1, 1.5, 2)
                  Round(|a|)           where 2 <= |a| < 4   (step 1: 2, 3, 4)
                  Min(2 Round(|a|/2), 6)  elsewhere         (step 2: 4, 6, saturating)
    m           = q * (block_scale * g_dq)
    y           = Reshape(m * Sign(a), Shape(x))

ONNX ``Round`` is half-to-even, so each branch is E2M1 round-to-nearest-even on its binade (the branch edges
2 and 4 are grid points that both neighbours agree on). The sign goes back by a multiply with Sign(a) (exact,
±1), which gives -0.0 for tiny negatives as the E2M1 codec does, under every runtime: onnxruntime's Round and
Where both drop the sign of a negative zero. An input that is exactly ±0 comes out +0.0. A zero block gets
the scale 2^-9 and stays zero.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.onnx.dtypes import value_dtype
from fp4pass.formats import E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, NV_BLOCK_SIZE

__all__ = ["nvfp4_fake_quant", "SAME", "MIN_OPSET"]

MIN_OPSET = 21  # ReduceMax with axes input (18), Cast to FLOAT8E4M3FN (19), Round/Clip/Where long before

SAME = object()  # sentinel: dequantize with the global scale used to quantize


def _const(tape: ir.tape.Tape, name: str, value, dtype) -> ir.Value:
    return tape.initializer(ir.tensor(np.asarray(value, dtype=dtype), name=name))


def nvfp4_fake_quant(
    tape: ir.tape.Tape,
    x: ir.Value,
    global_scale: ir.Value,
    *,
    name: str = "x",
    dequant_scale: ir.Value | None | object = SAME,
    input_dtype: ir.DataType | None = None,
    output_dtype: ir.DataType | None = None,
) -> ir.Value:
    """Record NVFP4 quantize->dequantize of ``x`` on ``tape``; return its output (see module docstring)."""
    if dequant_scale is SAME:
        dequant_scale = global_scale
    input_dtype = input_dtype or value_dtype(x) or ir.DataType.FLOAT
    output_dtype = output_dtype or input_dtype
    p = f"{name}_nvfp4"
    f32 = np.float32

    def op(op_type: str, inputs, attributes=None, suffix: str = "") -> ir.Value:
        out = tape.op(op_type, inputs, attributes, name=f"{p}/{suffix or op_type}")
        out.name = f"{p}/{suffix or op_type}"
        return out

    block_shape = _const(tape, f"{p}/block_shape", [-1, NV_BLOCK_SIZE], np.int64)
    last_axis = _const(tape, f"{p}/last_axis", [-1], np.int64)
    six = _const(tape, f"{p}/e2m1_max", E2M1_MAX, f32)
    scale_lo = _const(tape, f"{p}/e4m3_min_subnormal", E4M3_MIN_SUBNORMAL, f32)
    scale_hi = _const(tape, f"{p}/e4m3_max", E4M3_MAX, f32)
    half = _const(tape, f"{p}/half", 0.5, f32)
    two = _const(tape, f"{p}/two", 2.0, f32)
    four = _const(tape, f"{p}/four", 4.0, f32)

    x_shape = op("Shape", [x], suffix="x_shape")
    if input_dtype != ir.DataType.FLOAT:
        x_float = op("Cast", [x], {"to": ir.DataType.FLOAT}, suffix="x_float")
        x_float.dtype, x_float.shape = ir.DataType.FLOAT, x.shape
        x = x_float
    xb = op("Reshape", [x, block_shape], suffix="blocks")
    block_amax = op("ReduceMax", [op("Abs", [xb], suffix="abs"), last_axis], {"keepdims": 1}, suffix="block_amax")
    six_g = op("Mul", [global_scale, six], suffix="six_g")
    raw_scale = op("Div", [block_amax, six_g], suffix="raw_block_scale")
    clipped = op("Clip", [raw_scale, scale_lo, scale_hi], suffix="clipped_block_scale")
    scale_e4m3 = op("Cast", [clipped], {"to": ir.DataType.FLOAT8E4M3FN}, suffix="block_scale_e4m3")
    block_scale = op("Cast", [scale_e4m3], {"to": ir.DataType.FLOAT}, suffix="block_scale")
    quant_scale = op("Mul", [block_scale, global_scale], suffix="quant_scale")
    a = op("Div", [xb, quant_scale], suffix="scaled")
    a_abs = op("Abs", [a], suffix="scaled_abs")
    q_fine = op("Mul", [op("Round", [op("Mul", [a_abs, two], suffix="twice")], suffix="round_fine"), half],
                suffix="q_fine")
    q_mid = op("Round", [a_abs], suffix="q_mid")
    q_coarse = op(
        "Min",
        [op("Mul", [op("Round", [op("Mul", [a_abs, half], suffix="halved")], suffix="round_coarse"), two],
            suffix="coarse"), six],
        suffix="q_coarse",
    )
    q_upper = op("Where", [op("Less", [a_abs, four], suffix="below_four"), q_mid, q_coarse], suffix="q_upper")
    q = op("Where", [op("Less", [a_abs, two], suffix="below_two"), q_fine, q_upper], suffix="q_abs")
    if dequant_scale is None:
        out_scale = block_scale
    elif dequant_scale is global_scale:
        out_scale = quant_scale
    else:
        out_scale = op("Mul", [block_scale, dequant_scale], suffix="dequant_scale")
    magnitude = op("Mul", [q, out_scale], suffix="magnitude")
    signed = op("Mul", [magnitude, op("Sign", [a], suffix="sign")], suffix="dequantized")
    if output_dtype == ir.DataType.FLOAT:
        y = op("Reshape", [signed, x_shape], suffix="fake_quant")
    else:
        y_float = op("Reshape", [signed, x_shape], suffix="fake_quant_float")
        y_float.dtype, y_float.shape = ir.DataType.FLOAT, x.shape
        y = op("Cast", [y_float], {"to": output_dtype}, suffix="fake_quant")
    y.dtype = output_dtype
    y.shape = x.shape
    return y
