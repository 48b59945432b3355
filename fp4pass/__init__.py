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
import os

from fp4pass.errors import FP4PassError

# onnxruntime (1.31 on Linux) writes ~/.cache/Microsoft/DeveloperTools/.onnxruntime/ (a device id and an event
# database) and $TMPDIR/.ses when it is imported, unless ORT_DISABLE_TELEMETRY is set then: fp4pass keeps it
# from writing them (a user who sets the variable, to 0 or anything else, decides instead).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

__all__ = ["FP4PassError", "MXFP4Tensor", "NVFP4Tensor", "ScaleRule", "mxfp4_to_nvfp4", "onnx", "checkpoint",
           "__version__"]

_LAZY = {
    "MXFP4Tensor": ("fp4pass.formats", "MXFP4Tensor"),
    "NVFP4Tensor": ("fp4pass.formats", "NVFP4Tensor"),
    "ScaleRule": ("fp4pass.formats", "ScaleRule"),
    "mxfp4_to_nvfp4": ("fp4pass.convert", "mxfp4_to_nvfp4"),
}
_SUBPACKAGES = ("onnx", "fx", "checkpoint")


def __getattr__(name: str):
    # Everything heavy (torch, onnx, onnxruntime) loads on first use: ``import fp4pass`` (and the CLI's first
    # moments, where Ctrl-C must already be handled) imports nothing but the standard library.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"fp4pass.{name}")
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fp4pass' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
