"""gpt-oss (openai/gpt-oss-20b, -120b): ``GptOssForCausalLM``, MXFP4 expert stacks ``*_blocks`` / ``*_scales``.

vLLM 0.33.0 model_executor/models/gpt_oss.py ``GptOssForCausalLM.packed_modules_mapping`` fuses q/k/v into
``qkv_proj``; its ``hf_to_vllm_mapper`` renames ``.self_attn.`` to ``.attn.`` in names and patterns alike, so a
match never changes and no rename is recorded here.
"""

from fp4pass.checkpoint.families.record import Family

FAMILY = Family(
    name="gpt-oss",
    architectures=("GptOssForCausalLM",),
    vllm_fused={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
    sources=("vLLM 0.33.0 model_executor/models/gpt_oss.py GptOssForCausalLM",
             "openai/gpt-oss-20b config.json (quantization_config.quant_method mxfp4)"),
)
