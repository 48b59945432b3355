"""The torch custom op that stands for a calibrated NVFP4 activation quantizer in a traced graph.

``torch.ops.fp4pass.fake_quantize_nvfp4(x [..., K], global_scale: float) -> Tensor [..., K]`` (dtype of x)::

    y = NVFP4Tensor.quantize(x.float(), global_scale=global_scale).dequantize()   # then cast back to x.dtype

so it is bit-exact with :meth:`fp4pass.formats.NVFP4Tensor.quantize` by construction: 16-blocks along the last
axis, block scale ``e4m3(clamp(block_amax / (6 * g), 2^-9, 448))``, E2M1 round-to-nearest-even, and
``global_scale = g = input_scale = g_amax / (6 * 448)``, the FP32 activation scale (a multiplier applied on
dequantize, ModelOpt / TensorRT convention). The scale is a float argument, not a tensor, so that inserting
the op into an ``ExportedProgram`` adds no buffer to its signature; it is an FP32 value held in a Python
float (exact).

Like :mod:`fp4pass.fx.ops`, it is a ``torch.library.custom_op`` with a fake (meta) implementation, so it
survives ``torch.export`` as one node, and :func:`fp4pass.fx.export` writes it as the target's ONNX form.
A NaN/Inf activation raises :class:`~fp4pass.errors.NonFiniteError` (``NVFP4Tensor.quantize`` does).
"""

from __future__ import annotations

import torch

from fp4pass.formats import NVFP4Tensor

__all__ = ["fake_quantize_nvfp4", "FAKE_QUANTIZE_TARGETS"]


@torch.library.custom_op("fp4pass::fake_quantize_nvfp4", mutates_args=())
def fake_quantize_nvfp4(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """NVFP4 quantize -> dequantize of ``x`` along its last axis at FP32 ``global_scale`` (module docstring)."""
    y = NVFP4Tensor.quantize(x, global_scale=global_scale, name="fake_quantize_nvfp4 input").dequantize()
    return y.to(x.dtype)


@fake_quantize_nvfp4.register_fake
def _(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    return torch.empty_like(x)


# symbolic_trace records the op packet, torch.export its default overload
FAKE_QUANTIZE_TARGETS = (torch.ops.fp4pass.fake_quantize_nvfp4, torch.ops.fp4pass.fake_quantize_nvfp4.default)
