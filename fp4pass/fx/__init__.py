"""The torch.fx side of fp4pass: custom dequant ops, the MXFP4 -> NVFP4 fx pass, and the fx diff.

    gm, report = fp4pass.fx.convert(graph_module, method="auto")
    result = fp4pass.fx.diff(gm_a, gm_b, example_inputs)
"""

import importlib

from fp4pass.fx import ops  # noqa: F401  (registers torch.ops.fp4pass.*)
from fp4pass.fx import act_ops  # noqa: F401  (registers torch.ops.fp4pass.fake_quantize_nvfp4, for torch.export.load)

__all__ = ["convert", "calibrate", "diff", "export"]

# module names differ from the function names, so that importing a submodule never shadows the function
_LAZY = {"convert": ("fp4pass.fx.rewrite", "convert"), "diff": ("fp4pass.fx.numerics", "diff"),
         "calibrate": ("fp4pass.fx.calibration", "calibrate"), "export": ("fp4pass.fx.exporter", "export")}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fp4pass.fx' has no attribute {name!r}")
