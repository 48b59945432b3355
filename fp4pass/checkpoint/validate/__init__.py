"""Check any NVFP4 checkpoint folder (fp4pass's, ModelOpt's, llm-compressor's) against what the engines load.

Forms recognised (from the configs and the tensor names; :mod:`fp4pass.checkpoint.forms` declares their tensors):

- ModelOpt unified HF: ``hf_quant_config.json`` and/or config.json ``quantization_config`` with
  ``quant_method: modelopt``; per Linear a U8 weight, E4M3 block scales and two F32 scalars, global and input
  scale, both MULTIPLIERS (W = e2m1 x block_scale x global_scale; an activation is quantized with 1/input_scale);
- ModelOpt's gpt-oss fused expert stacks (``...mlp.experts.gate_up_proj`` or ``.down_proj``) [E, K/2, N];
- compressed-tensors ``nvfp4-pack-quantized``: the global and input scales F32 [1], both DIVISORS
  (W = e2m1 x block_scale / global_scale);
- DeepSeek-V4's ``quant_method: fp8`` with ``moe_quant_algo: NVFP4`` (ModelOpt tensor names, W4A4).

The modules of this package, in the order the validator runs them: :mod:`.reading` (the folder),
:mod:`.configs`, :mod:`.tensors` (finding the modules, reading their scales), :mod:`.scales` (shapes, values,
magnitudes, presence, w1/w3 pairs), :mod:`.exclusions`, :mod:`.verdicts`, then :mod:`.report` (the text and the
exit status). :mod:`.kinds` holds one record per problem kind; :mod:`.validation` the typed result.
"""

from fp4pass.checkpoint.validate.kinds import KINDS, OUTCOMES, PROBLEM_KINDS, WRITER_BUGS, Problem, ProblemKind
from fp4pass.checkpoint.validate.report import exit_status, format_validation, problem_line
from fp4pass.checkpoint.validate.tensors import BLOCK_SAMPLE_BYTES
from fp4pass.checkpoint.validate.validation import (Validation, is_nvfp4_folder, validate, validate_own_output,
                                                    validation)


__all__ = ["validate", "validation", "Validation", "format_validation", "exit_status", "is_nvfp4_folder", "Problem",
           "ProblemKind", "PROBLEM_KINDS", "KINDS", "OUTCOMES", "WRITER_BUGS", "BLOCK_SAMPLE_BYTES",
           "validate_own_output", "problem_line"]
