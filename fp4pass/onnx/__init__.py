"""The ONNX side of fp4pass: match MXFP4 patterns, rewrite them to NVFP4, insert activation quantizers,
lower FP4 for onnxruntime, and diff two graphs. One module per pass, all on ``onnx_ir``.

Public names::

    model, report = fp4pass.onnx.convert(model_or_path, method="auto", scale_form="dq", target="trt", calib=None)
    result = fp4pass.onnx.diff(original, rewritten, inputs=None, provider="auto")
"""

import importlib

__all__ = ["convert", "diff", "inspect"]

# name -> (module, attribute). Module names differ from the function names so that importing a submodule
# never shadows the function on this package.
_LAZY = {
    # the orchestration (passes + calibration + check) lives above this package: the name points up, lazily
    "convert": ("fp4pass.pipeline", "convert"),
    "inspect": ("fp4pass.onnx.inspection", "inspect"),
    "diff": ("fp4pass.onnx.numerics", "diff"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fp4pass.onnx' has no attribute {name!r}")
