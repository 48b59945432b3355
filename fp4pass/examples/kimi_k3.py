"""A tiny Kimi-K3 checkpoint with the structure of the real release (moonshotai/Kimi-K3), seeded.

``build_kimi_k3(folder, layers=4, experts=12, ...)`` writes:

- config.json: ``architectures: ["KimiK3ForConditionalGeneration"]``, ``model_type: kimi_k3``, a nested
  ``text_config`` (``model_type: kimi_linear``) that holds the MXFP4 ``quantization_config``
  (compressed-tensors ``mxfp4-pack-quantized``, group 32, uint8 scales, no input activations) and a
  ``vision_config`` (``kimi_k3_vision``);
- the text model under ``language_model.``: layer 0 a dense MLP (``mlp.gate_proj|up_proj|down_proj``), the
  others MoE layers; KDA linear-attention layers (``q_proj``, ``k_proj``, ``v_proj``, full-rank ``g_proj``,
  ``b_proj``, ``f_a_proj``, ``f_b_proj``, ``q_conv1d``/``k_conv1d``/``v_conv1d``, ``A_log``, ``dt_bias``,
  ``o_norm``, ``o_proj``) and MLA layers (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, output gate ``g_proj``, ``o_proj``) as ``linear_attn_config`` says
  (1-based ``kda_layers`` / ``full_attn_layers``); the attention residuals (``self_attention_res_norm|proj``,
  ``mlp_res_norm|proj``, ``output_attn_res_norm|proj``);
- each MoE layer's ``block_sparse_moe``: the router ``gate`` (bf16) with ``e_score_correction_bias`` (float32),
  the shared experts (bf16), the latent projections ``routed_expert_down_proj`` [latent, H] and
  ``routed_expert_up_proj`` [H, latent] and ``routed_expert_norm`` (bf16), and the routed experts in the latent
  width: ``experts.{e}.w1|w3.weight_packed`` U8 [I, latent/2] + ``.weight_scale`` U8 E8M0 [I, latent/32],
  ``w2`` [latent, I/2] + [latent, I/32];
- the vision tower (``vision_tower.patch_embed.proj|pos_emb``, ``vision_tower.encoder.blocks.{b}.norm0|norm1|wqkv|wo|mlp.fc0|
  mlp.fc1``, ``final_layernorm``) and ``mm_projector`` (``proj.0``, ``proj.2``, ``post_norm``: ``patchmergerv2``), all bf16.

The names are the ones vLLM 0.33.0's Kimi-K3 loader reads (models/kimi_k3/nvidia/model.py ``load_weights``,
kda.py, mla.py; model_executor/models/kimi_k25_vit.py for the vision tower) and NVIDIA's converter matches
(Model-Optimizer examples/kimi/kimi_k3/quantize_to_nvfp4.py); the config fields are vLLM's ``KimiK3Config``,
``KimiLinearConfig`` and ``KimiK3VisionConfig``. Values are random (the model is not meant to be run): expert
e's E8M0 exponents sit ``2 * e`` octaves (modulo 12) above expert 0's, and ``lossy_expert=(L, e)`` puts one
block of that expert's w1 20 octaves below the rest (converted lossily). No modeling code is shipped, so the
config has no ``auto_map``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fp4pass.examples.tensors import TOKENIZER_FILES, ShardedWriter, bf16_values, f32_values, mxfp4_codes

__all__ = ["build_kimi_k3", "ARCHITECTURE"]

ARCHITECTURE = "KimiK3ForConditionalGeneration"
_HEADS, _HEAD_DIM, _CONV = 2, 16, 4  # KDA and MLA heads, their width, the short convolution's kernel
_LORA = 32  # MLA q_lora_rank and kv_lora_rank
_VT_HIDDEN, _VT_INTER, _PATCH, _POS = 32, 64, 14, 4  # vision tower (its position embedding: 4 x 4)


def _mxfp4_quantization_config() -> dict:
    """The text model's MXFP4 description as the release writes it (compressed-tensors mxfp4-pack-quantized)."""
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                                          "weights": weights, "input_activations": None,
                                          "format": "mxfp4-pack-quantized"}},
            "ignore": [], "quantization_status": "compressed"}


def _kda_layers(layers: int) -> list[int]:
    """1-based KDA layers: three of every four (the release has 69 KDA and 24 MLA layers of 93)."""
    return [i + 1 for i in range(layers) if i % 4 != 3]


def _config(layers: int, experts: int, h: int, latent: int, inter: int, moe_inter: int, vocab: int) -> dict:
    kda = _kda_layers(layers)
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "head_dim": _HEAD_DIM,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "num_experts": experts, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": moe_inter, "routed_expert_hidden_size": latent, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
        "q_lora_rank": _LORA, "kv_lora_rank": _LORA, "qk_nope_head_dim": _HEAD_DIM, "qk_rope_head_dim": 0,
        "v_head_dim": _HEAD_DIM, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [i + 1 for i in range(layers)
                                                                       if i + 1 not in kda],
                               "head_dim": _HEAD_DIM, "num_heads": _HEADS, "short_conv_kernel_size": _CONV,
                               "use_full_rank_gate": True},
        "attn_res_block_size": 2, "num_nextn_predict_layers": 0,
        "quantization_config": _mxfp4_quantization_config(),
    }
    vision = {"model_type": "kimi_k3_vision", "patch_size": _PATCH, "vt_hidden_size": _VT_HIDDEN,
              "vt_num_hidden_layers": 1, "vt_num_attention_heads": _HEADS, "vt_intermediate_size": _VT_INTER,
              "qkv_hidden_size": _VT_HIDDEN, "init_pos_emb_height": _POS, "init_pos_emb_width": _POS,
              "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2", "text_hidden_size": h}
    return {"architectures": [ARCHITECTURE], "model_type": "kimi_k3", "text_config": text,
            "vision_config": vision, "media_placeholder_token_id": vocab - 1, "torch_dtype": "bfloat16"}


def _kda(out: ShardedWriter, rng, attn: str, h: int) -> None:
    width = _HEADS * _HEAD_DIM
    for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
        out.add(f"{attn}.{proj}.weight", bf16_values(rng, width, h))
    out.add(f"{attn}.b_proj.weight", bf16_values(rng, _HEADS, h))
    out.add(f"{attn}.f_a_proj.weight", bf16_values(rng, _HEAD_DIM, h))
    out.add(f"{attn}.f_b_proj.weight", bf16_values(rng, width, _HEAD_DIM))
    for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
        out.add(f"{attn}.{conv}.weight", f32_values(rng, width, 1, _CONV))
    out.add(f"{attn}.A_log", f32_values(rng, 1, 1, _HEADS, 1))
    out.add(f"{attn}.dt_bias", f32_values(rng, width))
    out.add(f"{attn}.o_norm.weight", bf16_values(rng, _HEAD_DIM) + 1)
    out.add(f"{attn}.o_proj.weight", bf16_values(rng, h, width))


def _mla(out: ShardedWriter, rng, attn: str, h: int) -> None:
    out.add(f"{attn}.q_a_proj.weight", bf16_values(rng, _LORA, h))
    out.add(f"{attn}.q_a_layernorm.weight", bf16_values(rng, _LORA) + 1)
    out.add(f"{attn}.q_b_proj.weight", bf16_values(rng, _HEADS * _HEAD_DIM, _LORA))
    out.add(f"{attn}.kv_a_proj_with_mqa.weight", bf16_values(rng, _LORA, h))
    out.add(f"{attn}.kv_a_layernorm.weight", bf16_values(rng, _LORA) + 1)
    out.add(f"{attn}.kv_b_proj.weight", bf16_values(rng, _HEADS * 2 * _HEAD_DIM, _LORA))
    out.add(f"{attn}.g_proj.weight", bf16_values(rng, _HEADS * _HEAD_DIM, h))
    out.add(f"{attn}.o_proj.weight", bf16_values(rng, h, _HEADS * _HEAD_DIM))


def _moe(out: ShardedWriter, rng, moe: str, layer: int, experts: int, h: int, latent: int, moe_inter: int,
         lossy_expert) -> None:
    out.add(f"{moe}.gate.weight", bf16_values(rng, experts, h))
    out.add(f"{moe}.gate.e_score_correction_bias", f32_values(rng, experts))
    for proj, rows, k in (("gate_proj", moe_inter, h), ("up_proj", moe_inter, h), ("down_proj", h, moe_inter)):
        out.add(f"{moe}.shared_experts.{proj}.weight", bf16_values(rng, rows, k))
    out.add(f"{moe}.routed_expert_down_proj.weight", bf16_values(rng, latent, h))
    out.add(f"{moe}.routed_expert_norm.weight", bf16_values(rng, latent) + 1)
    out.add(f"{moe}.routed_expert_up_proj.weight", bf16_values(rng, h, latent))
    for e in range(experts):
        for proj, rows, k in (("w1", moe_inter, latent), ("w2", latent, moe_inter), ("w3", moe_inter, latent)):
            lossy = lossy_expert == (layer, e) and proj == "w1"
            base = -8 + (2 * e) % 12 + (1 if proj == "w3" else 0)
            codes, scales = mxfp4_codes(rng, (rows,), k, base, lossy)
            out.add(f"{moe}.experts.{e}.{proj}.weight_packed", codes)
            out.add(f"{moe}.experts.{e}.{proj}.weight_scale", scales)


def _vision(out: ShardedWriter, rng, h: int) -> None:
    tower = "vision_tower"
    out.add(f"{tower}.patch_embed.proj.weight", bf16_values(rng, _VT_HIDDEN, 3, _PATCH, _PATCH))
    out.add(f"{tower}.patch_embed.pos_emb.weight", bf16_values(rng, _POS, _POS, _VT_HIDDEN))
    block = f"{tower}.encoder.blocks.0"
    for norm in ("norm0", "norm1"):
        out.add(f"{block}.{norm}.weight", bf16_values(rng, _VT_HIDDEN) + 1)
    out.add(f"{block}.wqkv.weight", bf16_values(rng, 3 * _VT_HIDDEN, _VT_HIDDEN))
    out.add(f"{block}.wo.weight", bf16_values(rng, _VT_HIDDEN, _VT_HIDDEN))
    out.add(f"{block}.mlp.fc0.weight", bf16_values(rng, _VT_INTER, _VT_HIDDEN))
    out.add(f"{block}.mlp.fc1.weight", bf16_values(rng, _VT_HIDDEN, _VT_INTER))
    out.add(f"{tower}.encoder.final_layernorm.weight", bf16_values(rng, _VT_HIDDEN) + 1)
    merged = _VT_HIDDEN * 4  # 2 x 2 patches merged; patchmergerv2: two Linears without bias, then an RMSNorm
    out.add("mm_projector.proj.0.weight", bf16_values(rng, merged, merged))
    out.add("mm_projector.proj.2.weight", bf16_values(rng, h, merged))
    out.add("mm_projector.post_norm.weight", bf16_values(rng, h) + 1)


def build_kimi_k3(folder, *, layers: int = 4, experts: int = 12, hidden: int = 64, latent: int = 32,
                  intermediate: int = 96, moe_intermediate: int = 64, vocab: int = 32, seed: int = 0,
                  lossy_expert: tuple[int, int] | None = (2, 11), shard_bytes: int | None = None,
                  tokenizer: bool = True) -> Path:
    """Write the tiny Kimi-K3 into the new folder ``folder`` (module docstring); returns the folder."""
    if layers < 2:
        raise ValueError("layers must be >= 2 (layer 0 is the dense MLP)")
    for name, value in (("hidden", hidden), ("latent", latent), ("intermediate", intermediate),
                        ("moe_intermediate", moe_intermediate)):
        if value % 32:
            raise ValueError(f"{name} must be a multiple of 32")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(seed)
    out = ShardedWriter(folder, shard_bytes)
    h, text = hidden, "language_model.model"
    kda = _kda_layers(layers)
    out.add(f"{text}.embed_tokens.weight", bf16_values(rng, vocab, h))
    for layer in range(layers):
        prefix = f"{text}.layers.{layer}"
        out.add(f"{prefix}.input_layernorm.weight", bf16_values(rng, h) + 1)
        (_kda if layer + 1 in kda else _mla)(out, rng, f"{prefix}.self_attn", h)
        out.add(f"{prefix}.post_attention_layernorm.weight", bf16_values(rng, h) + 1)
        for site in ("self_attention", "mlp"):
            out.add(f"{prefix}.{site}_res_norm.weight", bf16_values(rng, h) + 1)
            out.add(f"{prefix}.{site}_res_proj.weight", bf16_values(rng, 1, h))
        if layer == 0:
            for proj, rows, k in (("gate_proj", intermediate, h), ("up_proj", intermediate, h),
                                  ("down_proj", h, intermediate)):
                out.add(f"{prefix}.mlp.{proj}.weight", bf16_values(rng, rows, k))
        else:
            _moe(out, rng, f"{prefix}.block_sparse_moe", layer, experts, h, latent, moe_intermediate, lossy_expert)
    out.add(f"{text}.norm.weight", bf16_values(rng, h) + 1)
    out.add(f"{text}.output_attn_res_norm.weight", bf16_values(rng, h) + 1)
    out.add(f"{text}.output_attn_res_proj.weight", bf16_values(rng, 1, h))
    out.add("language_model.lm_head.weight", bf16_values(rng, vocab, h))
    _vision(out, rng, h)
    out.finish()
    config = _config(layers, experts, h, latent, intermediate, moe_intermediate, vocab)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        for name, content in TOKENIZER_FILES.items():
            (folder / name).write_text(content)
    return folder

