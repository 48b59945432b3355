"""The torch.fx side of fp4pass: custom dequant ops, MXFP4 modules, the MXFP4 -> NVFP4 fx pass, the fx diff.

    model = fp4pass.fx.load_gpt_oss(checkpoint_dir)            # transformers GptOssForCausalLM, MXFP4 experts
    model = fp4pass.fx.quantize_linears(float_model)           # nn.Linear -> MXFP4Linear
    prog, report = fp4pass.fx.convert(torch.export.export(model, args), method="auto")
    result = fp4pass.fx.diff(gm_a, gm_b, example_inputs)
"""

import importlib

from fp4pass.fx import ops  # noqa: F401  (registers torch.ops.fp4pass.*)

__all__ = ["convert", "diff", "load_gpt_oss", "quantize_linears", "MXFP4Linear", "MXFP4Experts"]

_LAZY = {
    "convert": ("fp4pass.fx.rewrite", "convert"),
    "diff": ("fp4pass.fx.numerics", "diff"),
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
