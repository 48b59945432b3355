"""The torch.fx side of fp4pass: custom ops, MXFP4 modules, the MXFP4 -> NVFP4 fx pass, calibration, diff, export.

    model = fp4pass.fx.load_gpt_oss(checkpoint_dir)            # transformers GptOssForCausalLM, MXFP4 experts
    model = fp4pass.fx.quantize_linears(float_model)           # nn.Linear -> MXFP4Linear
    prog, report = fp4pass.fx.convert(torch.export.export(model, args), method="auto")
    prog, scales = fp4pass.fx.calibrate(prog, batches, calibrator="max")   # NVFP4 activation fake-quant
    result = fp4pass.fx.diff(gm_a, gm_b, example_inputs)
    fp4pass.fx.export(prog, example_inputs, "model.onnx")              # ONNX FP4 forms
"""

import importlib

from fp4pass.fx import ops  # noqa: F401  (registers torch.ops.fp4pass.*)
from fp4pass.fx import act_ops  # noqa: F401  (registers torch.ops.fp4pass.fake_quantize_nvfp4, for torch.export.load)

__all__ = ["convert", "calibrate", "diff", "export", "load_gpt_oss", "quantize_linears", "MXFP4Linear",
           "MXFP4Experts"]

# module names differ from the function names, so that importing a submodule never shadows the function
_LAZY = {
    "convert": ("fp4pass.fx.rewrite", "convert"),
    "calibrate": ("fp4pass.fx.calibration", "calibrate"),
    "diff": ("fp4pass.fx.numerics", "diff"),
    "export": ("fp4pass.fx.exporter", "export"),
    "load_gpt_oss": ("fp4pass.fx.gpt_oss", "load_gpt_oss"),
    "quantize_linears": ("fp4pass.fx.mxfp4", "quantize_linears"),
    "MXFP4Linear": ("fp4pass.fx.mxfp4", "MXFP4Linear"),
    "MXFP4Experts": ("fp4pass.fx.mxfp4", "MXFP4Experts"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fp4pass.fx' has no attribute {name!r}")
