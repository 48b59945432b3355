"""DeepSeek-V4 (deepseek-ai/DeepSeek-V4): ``DeepseekV4ForCausalLM``, native names (``layers.{L}.ffn.experts.{e}
.w1|w2|w3.weight`` + ``.scale``), config ``quant_method: fp8`` with ``expert_dtype: fp4``.

vLLM 0.33.0 models/deepseek_v4/nvidia/model.py: ``packed_modules_mapping`` (``gate_up_proj`` <- w1, w3;
``fused_wqa_wkv`` <- wq_a, wkv; ``fused_wkv_wgate`` <- wkv, wgate) and ``_make_deepseek_v4_weights_mapper``
(prefixes ``layers.`` -> ``model.layers.``, ``embed.`` -> ``model.embed.``, ``norm.`` -> ``model.norm.``,
``hc_head`` -> ``model.hc_head``, ``mtp.`` -> ``model.mtp.``; ``head`` -> ``lm_head``, ``embed`` ->
``model.embed_tokens``; ``.shared_experts.w2`` -> ``.shared_experts.down_proj``).
"""

from fp4pass.checkpoint.families.record import Family

ARCHITECTURE = "DeepseekV4ForCausalLM"
_PREFIXES = (("layers.", "model.layers."), ("embed.", "model.embed."), ("norm.", "model.norm."),
             ("hc_head", "model.hc_head"), ("mtp.", "model.mtp."))


def vllm_name(module: str) -> str:
    """The name vLLM's DeepSeek-V4 weights mapper gives ``module``."""
    if module == "head":
        return "lm_head"
    if module == "embed":
        return "model.embed_tokens"
    for old, new in _PREFIXES:
        if module.startswith(old):
            module = new + module[len(old):]
            break
    return module.replace(".shared_experts.w2", ".shared_experts.down_proj")


FAMILY = Family(
    name="deepseek-v4",
    architectures=(ARCHITECTURE,),
    vllm_fused={"gate_up_proj": ("w1", "w3"), "fused_wqa_wkv": ("wq_a", "wkv"), "fused_wkv_wgate": ("wkv", "wgate")},
    vllm_name=vllm_name,
    engines=("vllm",),
    sources=("vLLM 0.33.0 models/deepseek_v4/nvidia/model.py (packed_modules_mapping, "
             "_make_deepseek_v4_weights_mapper)", "deepseek-ai/DeepSeek-V4 config.json (quant_method fp8, "
             "expert_dtype fp4)"),
)
