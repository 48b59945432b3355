"""Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B): ``KimiLinearForCausalLM``, KDA linear attention and MLA layers,
``block_sparse_moe.experts.{e}.w1|w2|w3``.

vLLM 0.33.0 models/kimi_k3/nvidia/model.py ``KimiLinearModel.packed_modules_mapping`` (the class serves
standalone Kimi-Linear and Kimi-K3's text model): ``gate_up_proj`` <- gate_proj, up_proj; ``in_proj_qkvgfab``
<- q_proj, k_proj, v_proj, b_proj, f_a_proj; ``fused_qkv_a_proj`` <- q_a_proj, kv_a_proj_with_mqa. (Its
``conv1d`` and ``fused_qkv_a_g_proj`` shards, ``q_conv1d`` and ``g_proj``, are Kimi-K3's names: transformers'
Kimi-Linear has one ``conv1d`` and no MLA output gate.)
"""

from fp4pass.checkpoint.families.record import Family

FAMILY = Family(
    name="kimi-linear",
    architectures=("KimiLinearForCausalLM",),
    vllm_fused={"gate_up_proj": ("gate_proj", "up_proj"),
                "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"),
                "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
    sources=("vLLM 0.33.0 models/kimi_k3/nvidia/model.py KimiLinearModel.packed_modules_mapping",),
)
