"""``load_gpt_oss``: transformers' own ``GptOssForCausalLM`` with MXFP4 experts read straight from a checkpoint.

The model is transformers' modeling code (attention with sinks, YaRN RoPE, top-k router, any config); only
each layer's ``mlp.experts`` is an :class:`fp4pass.fx.mxfp4.MXFP4Experts`, whose buffers receive the
checkpoint's MXFP4 bytes unchanged (uint8 blocks [E, N, K/32, 16] and E8M0 scales [E, N, K/32]). Nothing goes
through bf16 or float: the experts' weights exist only packed, and each forward dequantizes one layer's
weights with ``torch.ops.fp4pass.dequantize_mxfp4`` (bit-exact with gpt-oss's reference dequant: lut[low
nibble] at even index, lut[high nibble] at odd, ldexp by scale - 127).

The model is built on the meta device and the checkpoint's tensors are assigned in place, so memory holds
each tensor once, as stored (float weights cast to ``dtype``).

Checkpoint naming, both read:

- Hugging Face (``config.json`` with ``model_type`` gpt_oss, ``quantization_config.quant_method`` mxfp4):
  ``model.layers.{i}.mlp.experts.gate_up_proj_blocks`` / ``_scales`` / ``_bias``, ``down_proj_*``, and the
  transformers names for everything else.
- OpenAI (``gpt-oss`` package, the checkpoints' ``original/`` folder): ``block.{n}.mlp.mlp1_weight.blocks`` /
  ``.scales``, ``mlp1_bias``, ``mlp2_*``, ``block.{n}.attn.qkv`` (q, k, v rows stacked), ``attn.out``,
  ``attn.sinks``, ``attn.norm.scale``, ``mlp.norm.scale``, ``mlp.gate``, ``embedding``, ``norm.scale``,
  ``unembedding``; its ``config.json`` uses the package's field names (num_experts, experts_per_token,
  rope_scaling_factor, rope_ntk_alpha/beta, initial_context_length).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from fp4pass.errors import ModelError, UsageError
from fp4pass.extras import require
from fp4pass.io import read_regular_file
from fp4pass.fx.mxfp4 import MXFP4Experts

__all__ = ["load_gpt_oss", "read_config", "checkpoint_tensors", "CausalLMLogits"]

log = logging.getLogger(__name__)

CONFIG_MAX_BYTES = 16 << 20  # a config.json is a few KB
_OPENAI_CONFIG_KEYS = {
    "num_experts": "num_local_experts",
    "experts_per_token": "num_experts_per_tok",
}
_OPENAI_ROPE_KEYS = ("rope_theta", "rope_scaling_factor", "rope_ntk_alpha", "rope_ntk_beta",
                     "initial_context_length")

# OpenAI name -> transformers name (qkv is split separately)
_OPENAI_NAMES = [
    (r"embedding\.weight", "model.embed_tokens.weight"),
    (r"unembedding\.weight", "lm_head.weight"),
    (r"norm\.scale", "model.norm.weight"),
    (r"block\.(\d+)\.attn\.norm\.scale", r"model.layers.\1.input_layernorm.weight"),
    (r"block\.(\d+)\.attn\.out\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"block\.(\d+)\.attn\.sinks", r"model.layers.\1.self_attn.sinks"),
    (r"block\.(\d+)\.mlp\.norm\.scale", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"block\.(\d+)\.mlp\.gate\.(weight|bias)", r"model.layers.\1.mlp.router.\2"),
    (r"block\.(\d+)\.mlp\.mlp1_weight\.(blocks|scales)", r"model.layers.\1.mlp.experts.gate_up_proj_\2"),
    (r"block\.(\d+)\.mlp\.mlp1_bias", r"model.layers.\1.mlp.experts.gate_up_proj_bias"),
    (r"block\.(\d+)\.mlp\.mlp2_weight\.(blocks|scales)", r"model.layers.\1.mlp.experts.down_proj_\2"),
    (r"block\.(\d+)\.mlp\.mlp2_bias", r"model.layers.\1.mlp.experts.down_proj_bias"),
]
_OPENAI_QKV = re.compile(r"block\.(\d+)\.attn\.qkv\.(weight|bias)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_PACKED = ("_blocks", "_scales")


def _openai_config(raw: dict) -> dict:
    """The gpt-oss package's config.json -> GptOssConfig keyword arguments (YaRN as transformers spells it)."""
    out = {_OPENAI_CONFIG_KEYS.get(k, k): v for k, v in raw.items() if k not in _OPENAI_ROPE_KEYS}
    factor = float(raw.get("rope_scaling_factor", 1.0))
    rope = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 150000.0))}
    if factor > 1.0:
        rope.update(rope_type="yarn", factor=factor, beta_fast=float(raw.get("rope_ntk_beta", 32.0)),
                    beta_slow=float(raw.get("rope_ntk_alpha", 1.0)), truncate=False,
                    original_max_position_embeddings=int(raw.get("initial_context_length", 4096)))
    out["rope_parameters"] = rope
    out.setdefault("tie_word_embeddings", False)
    return out


def read_config(checkpoint_dir: str | Path, **config_overrides):
    """``GptOssConfig`` from ``checkpoint_dir/config.json`` (either naming), with ``config_overrides`` applied.

    The quantization_config is dropped (fp4pass holds the MXFP4 weights itself). Overriding
    ``num_hidden_layers`` with fewer layers keeps the first ones (``layer_types`` cut to match).
    """
    from transformers import GptOssConfig

    path = Path(checkpoint_dir) / "config.json"
    if not os.path.lexists(path):
        raise ModelError(f"{checkpoint_dir}: no config.json (not a gpt-oss checkpoint folder)")
    try:  # a regular file only: a config.json linked to /dev/zero or a FIFO would be read forever
        raw = json.loads(read_regular_file(path, CONFIG_MAX_BYTES, ModelError).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelError(f"{path}: cannot read ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    quant = raw.pop("quantization_config", None)
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise ModelError(f"{path}: quant_method is {quant.get('quant_method')!r}; load_gpt_oss reads mxfp4")
    if raw.get("model_type", "gpt_oss") != "gpt_oss":
        raise ModelError(f"{path}: model_type is {raw.get('model_type')!r}, not gpt_oss")
    if "num_experts" in raw and "num_local_experts" not in raw:
        raw = _openai_config(raw)
    layers = config_overrides.get("num_hidden_layers")
    if layers is not None and "layer_types" not in config_overrides and raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:layers]
    raw.update(config_overrides)
    try:
        return GptOssConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{path}: config does not make a GptOssConfig ({exc})") from None


def _hf_names(name: str, tensor: torch.Tensor, config) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor -> [(transformers name, tensor)]; OpenAI names translated, qkv split in three."""
    match = _OPENAI_QKV.fullmatch(name)
    if match:
        layer, kind = match.groups()
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        if tensor.shape[0] != q + 2 * kv:
            raise ModelError(f"{name}: {tensor.shape[0]} rows, expected q {q} + k {kv} + v {kv}")
        parts = torch.split(tensor, [q, kv, kv], dim=0)
        return [(f"model.layers.{layer}.self_attn.{p}_proj.{kind}", t.contiguous())
                for p, t in zip("qkv", parts)]
    for pattern, replacement in _OPENAI_NAMES:
        if re.fullmatch(pattern, name):
            return [(re.sub(pattern, replacement, name), tensor)]
    return [(name, tensor)]


def checkpoint_tensors(checkpoint_dir: str | Path, config, *, device="cpu", dtype=torch.float32):
    """Yield (transformers name, tensor) for every tensor of the folder's ``*.safetensors`` files.

    MXFP4 ``*_blocks`` / ``*_scales`` come as stored (uint8); float tensors are cast to ``dtype``. Tensors of
    layers at or past ``config.num_hidden_layers`` are skipped (a model cut short by an override).
    """
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{checkpoint_dir}: no .safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                for name, tensor in _hf_names(key, f.get_tensor(key), config):
                    layer = _LAYER.match(name)
                    if layer and int(layer.group(1)) >= config.num_hidden_layers:
                        continue
                    if name.endswith(_PACKED) and ".experts." in name:
                        if tensor.dtype != torch.uint8:
                            raise ModelError(f"{file.name}: {key} is {tensor.dtype}; MXFP4 blocks and scales "
                                             "are uint8")
                    elif name.endswith((".gate_up_proj", ".down_proj")):
                        raise ModelError(f"{file.name}: {key} is a float expert weight; load_gpt_oss reads "
                                         "MXFP4 checkpoints (quant_method mxfp4)")
                    elif tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    yield name, tensor


class CausalLMLogits(torch.nn.Module):
    """``input_ids -> logits`` around a causal LM (no cache): the plain signature ``torch.export`` wants.

    The wrapped model is the attribute ``m``, so exported names read ``m.model.layers.0...``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False).logits


def load_gpt_oss(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, **config_overrides):
    """transformers' ``GptOssForCausalLM`` (eval mode, eager attention) with :class:`MXFP4Experts` experts.

    ``checkpoint_dir``: a folder with ``config.json`` and MXFP4 ``*.safetensors`` in Hugging Face or OpenAI
    naming (module docstring). ``device``: where the tensors are read to. ``dtype``: the float weights'
    dtype (the experts' dequantized weights are cast to the activations' dtype). ``config_overrides``:
    ``GptOssConfig`` fields, e.g. ``num_hidden_layers=2`` to load the first two layers only.
    """
    transformers = require("transformers", "gpt-oss", "load_gpt_oss")
    GptOssForCausalLM = getattr(transformers, "GptOssForCausalLM", None)
    if GptOssForCausalLM is None:
        raise UsageError("load_gpt_oss needs transformers >= 5: pip install 'fp4pass[gpt-oss]'")

    attn_implementation = config_overrides.pop("attn_implementation", "eager")
    config = read_config(checkpoint_dir, **config_overrides)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
        for layer in model.model.layers:
            layer.mlp.experts = MXFP4Experts.from_config(config, dtype=dtype)

    state = {}
    for name, tensor in checkpoint_tensors(checkpoint_dir, config, device=device, dtype=dtype):
        if name in state:
            raise ModelError(f"{checkpoint_dir}: tensor {name} appears twice")
        state[name] = tensor
    if config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        what = [f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "",
                f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}" if unexpected else ""]
        raise ModelError(f"{checkpoint_dir}: tensors do not fit GptOssForCausalLM: {'; '.join(w for w in what if w)}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelError(f"{checkpoint_dir}: {name} has shape {list(tensor.shape)}, the config expects "
                             f"{list(expected[name].shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    del state

    # non-persistent buffers (RoPE inverse frequencies) are computed, not stored: build them for real
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelError(f"{checkpoint_dir}: nothing loaded for {', '.join(left[:4])}")
    model.eval()
    log.info("load_gpt_oss: %d layers, %d experts from %s", config.num_hidden_layers, config.num_local_experts,
             checkpoint_dir)
    return model
