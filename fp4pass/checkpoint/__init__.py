"""MXFP4 safetensors checkpoints -> NVFP4 checkpoints that serving engines load, converted tensor by tensor.

::

    report = fp4pass.checkpoint.convert("gpt-oss-20b", "gpt-oss-20b-nvfp4", format="modelopt")
    info = fp4pass.checkpoint.inspect("Kimi-K3")
    result = fp4pass.checkpoint.validate("Kimi-K3-NVFP4", engine="vllm")  # problems and engine verdicts
    scales = fp4pass.checkpoint.calibrate("gpt-oss-20b", "calib.npz")   # then convert(..., scales=scales)
    result = fp4pass.checkpoint.diff("gpt-oss-20b", "gpt-oss-20b-nvfp4", "calib.jsonl")  # what NVFP4 costs

The safetensors reading below it (the file format, read and written streaming; a checkpoint folder; bounded
exclusion patterns; Hub IDs) is :mod:`fp4pass.safetensors`, shared with the fx door.

Modules: ``detect`` (the three MXFP4 input forms and the w1/w3 pairs), ``input_scales`` (activation scales onto module
names), ``engine`` (one unit through ``fp4pass.convert``), ``output_forms`` (ModelOpt and compressed-tensors
names, dtypes, shapes and configs), ``run`` (convert: ``plan`` the output, then ``shards`` writes it),
``inspection`` (inspect), ``check`` (the result read back by
compressed-tensors), ``validate`` (any NVFP4 checkpoint against the engines' rules), ``calibration``
(activation scales from the model's own forward, with ``calib_data`` for the data and ``layerwise`` for the
layer-by-layer run), ``numerics`` (an NVFP4 checkpoint against its source, layer by layer, expert by expert and
at the logits, with ``nvfp4_weights`` decoding any writer's NVFP4 form). docs/checkpoint.md describes the
formats for users.
"""

from fp4pass.checkpoint.calibration import CheckpointScales, calibrate
from fp4pass.checkpoint.numerics import CheckpointDiff, diff
from fp4pass.checkpoint.inspection import format_inspection, inspect
from fp4pass.checkpoint.run import CheckFailed, convert, format_report, summary_line
from fp4pass.safetensors.files import CheckpointError
from fp4pass.checkpoint.validate import format_validation, validate

__all__ = ["convert", "inspect", "calibrate", "validate", "diff", "CheckpointDiff", "CheckFailed", "CheckpointError",
           "format_inspection", "format_report", "format_validation", "summary_line", "CheckpointScales"]

