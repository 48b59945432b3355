"""Qwen3-MoE (``Qwen3MoeForCausalLM``): per-expert ``mlp.experts.{e}.gate_proj|up_proj|down_proj``.

vLLM 0.33.0 model_executor/models/qwen3_moe.py ``packed_modules_mapping``.
"""

from fp4pass.checkpoint.families.record import Family

FAMILY = Family(
    name="qwen3-moe",
    architectures=("Qwen3MoeForCausalLM",),
    vllm_fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    sources=("vLLM 0.33.0 model_executor/models/qwen3_moe.py Qwen3MoeForCausalLM.packed_modules_mapping",),
)
