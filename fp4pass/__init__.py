"""fp4pass: rewrite MXFP4 models into NVFP4, calibrate NVFP4 activations, and prove the result.

Public surface::

    import fp4pass
    mx = fp4pass.MXFP4Tensor.quantize(x)                 # E2M1 + E8M0 per 32
    nv = fp4pass.NVFP4Tensor.quantize(x)                 # E2M1 + E4M3 per 16 + FP32 global scale
    nv, stats = fp4pass.mxfp4_to_nvfp4(mx, method="auto")
    model, report = fp4pass.onnx.convert("model.onnx")
    result = fp4pass.onnx.diff("model.onnx", "model.nvfp4.onnx")
"""

import importlib

from fp4pass.errors import FP4PassError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor, ScaleRule

__version__ = "0.1.0"

__all__ = ["FP4PassError", "MXFP4Tensor", "NVFP4Tensor", "ScaleRule", "mxfp4_to_nvfp4", "onnx", "__version__"]

_LAZY = {"mxfp4_to_nvfp4": ("fp4pass.convert", "mxfp4_to_nvfp4")}


def __getattr__(name: str):
    # Heavy parts (onnx, onnxruntime) load only when used.
    if name == "onnx":
        return importlib.import_module("fp4pass.onnx")
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fp4pass' has no attribute {name!r}")
