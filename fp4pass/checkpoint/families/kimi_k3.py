"""Kimi-K3 (moonshotai/Kimi-K3): ``KimiK3ForConditionalGeneration``, a vision tower and ``mm_projector`` around a
Kimi-Linear text model under ``language_model.``; config.json nests the text model's config (and its MXFP4
``quantization_config``) in ``text_config``.

What each engine does with the names (read in their code):

- vLLM 0.33.0 models/kimi_k3/nvidia/model.py ``KimiK3ForConditionalGeneration``: the language model is built
  under the prefix ``language_model`` (``language_model.model.layers.{L}...``); ``hf_to_vllm_mapper`` renames
  the prefixes ``language_model.layers.`` -> ``language_model.model.layers.``, ``mm_projector.proj.0`` ->
  ``mm_projector.linear_1``, ``mm_projector.proj.2`` -> ``mm_projector.linear_2``; the vision tower and the
  projector get the quantization config unless it is compressed-tensors (``_maybe_ignore_quant_config``), so a
  ModelOpt checkpoint must exclude them. The text model's fused modules are Kimi-Linear's
  (``KimiLinearModel.packed_modules_mapping``). vllm/transformers_utils/configs/kimi_k3.py ``KimiK3Config``
  copies ``text_config.quantization_config`` up to the top.
- SGLang (python/sglang/srt/models/kimi_k3.py ``KimiK3ForConditionalGeneration``) builds the language model with
  ``prefix=""``, so its modules are named ``model.layers.{L}...`` and ``lm_head``, and its ``hf_to_sglang_mapper``
  renames ``block_sparse_moe`` to ``mlp``: its exclusion lookups never see the checkpoint's names. NVIDIA's
  converter (Model-Optimizer examples/kimi/kimi_k3/quantize_to_nvfp4.py ``_module_name_aliases``) writes every
  spelling for that reason; :func:`sglang_name` gives SGLang's.
- TensorRT-LLM: no Kimi-K3 model was read; its verdict says "not claimed".
"""

from fp4pass.checkpoint.families.record import Family

ARCHITECTURE = "KimiK3ForConditionalGeneration"
#: KimiLinearModel.packed_modules_mapping, as vLLM declares it
VLLM_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"),
              "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"),
              "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
              "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
              "fused_qkv_a_g_proj": ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")}
TEXT_PREFIX = "language_model."
_VLLM_PREFIXES = (("language_model.layers.", "language_model.model.layers."),
                  ("mm_projector.proj.0", "mm_projector.linear_1"), ("mm_projector.proj.2", "mm_projector.linear_2"))


def vllm_name(module: str) -> str:
    """The name vLLM's ``hf_to_vllm_mapper`` gives ``module`` (prefix renames only)."""
    for old, new in _VLLM_PREFIXES:
        if module.startswith(old):
            return new + module[len(old):]
    return module


def sglang_name(module: str) -> str:
    """SGLang's run-time name of a text-model module (``language_model.model.layers.3.block_sparse_moe.gate`` ->
    ``model.layers.3.mlp.gate``, ``language_model.lm_head`` -> ``lm_head``); the vision side keeps its names.
    Also a pattern's (``language_model.model.layers.0*`` -> ``model.layers.0*``)."""
    if not module.startswith(TEXT_PREFIX):
        return module
    return module[len(TEXT_PREFIX):].replace("block_sparse_moe", "mlp")


FAMILY = Family(
    name="kimi-k3",
    architectures=(ARCHITECTURE,),
    vllm_fused=dict(VLLM_FUSED),
    vllm_name=vllm_name,
    sglang_name=sglang_name,
    engines=("vllm", "sglang"),
    text_config="text_config",
    transformers=False,
    sources=("vLLM 0.33.0 models/kimi_k3/nvidia/model.py (KimiK3ForConditionalGeneration, KimiLinearModel, "
             "KimiMoE, load_weights)", "vLLM 0.33.0 transformers_utils/configs/kimi_k3.py KimiK3Config",
             "SGLang python/sglang/srt/models/kimi_k3.py (prefix \"\", block_sparse_moe -> mlp)",
             "Model-Optimizer examples/kimi/kimi_k3/quantize_to_nvfp4.py"),
)
