"""DeepSeek-V3 architecture (``DeepseekV3ForCausalLM``; also ``DeepseekV2ForCausalLM``): multi-head latent
attention, shared experts, ``mlp.experts.{e}.gate_proj|up_proj|down_proj``.

vLLM 0.33.0 model_executor/models/deepseek_v2.py ``DeepseekV2ForCausalLM.__init__``: ``gate_up_proj`` <-
gate_proj, up_proj; ``fused_qkv_a_proj`` <- q_a_proj, kv_a_proj_with_mqa (only when config.q_lora_rank is set;
the rule is kept for both, a fused name never matches a checkpoint that lacks its shards).
"""

from fp4pass.checkpoint.families.record import Family

_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_SOURCES = ("vLLM 0.33.0 model_executor/models/deepseek_v2.py DeepseekV2ForCausalLM.__init__",)

FAMILY = Family(name="deepseek-v3", architectures=("DeepseekV3ForCausalLM",), vllm_fused=dict(_FUSED),
                sources=_SOURCES)
V2_FAMILY = Family(name="deepseek-v2", architectures=("DeepseekV2ForCausalLM",), vllm_fused=dict(_FUSED),
                   sources=_SOURCES)
FAMILIES = (FAMILY, V2_FAMILY)
