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

import logging
import math
import os
import re
from pathlib import Path

import torch

from fp4pass.errors import FP4PassError, ModelError, UsageError
from fp4pass.extras import require
from fp4pass.io import read_regular_file, strict_json
from fp4pass.safetensors.files import CheckpointError, SafetensorsFile
from fp4pass.fx.mxfp4 import MXFP4Experts

__all__ = ["load_gpt_oss", "read_config", "checkpoint_tensors", "checkpoint_layers", "CausalLMLogits",
           "EXPERT_FORWARDS"]

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
_OPENAI_LAYER = re.compile(r"block\.(\d+)\.")
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


#: integer GptOssConfig fields that size the model: each must be a positive int (JSON bool refused)
_POSITIVE_INTS = ("num_hidden_layers", "num_local_experts", "num_experts_per_tok", "vocab_size", "hidden_size",
                  "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads")
#: a bound far above any released model, so that a typo does not allocate for hours before failing
_MAX_DIM = 1 << 20


def _check_fields(raw: dict, path: Path) -> None:
    """ModelError naming ``path`` and the field, for a config value that cannot size a gpt-oss model."""
    for key in _POSITIVE_INTS:
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelError(f"{path}: {key} is {value!r} ({type(value).__name__}); it must be a positive integer")
        if not 0 < value <= _MAX_DIM:
            raise ModelError(f"{path}: {key} is {value}; it must be in 1..{_MAX_DIM}")
    experts, top_k = raw.get("num_local_experts"), raw.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise ModelError(f"{path}: num_experts_per_tok {top_k} is more than num_local_experts {experts}")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    for key in ("hidden_size", "intermediate_size"):
        if key in raw and raw[key] % 32:
            raise ModelError(f"{path}: {key} {raw[key]} is not a multiple of 32 (the MXFP4 block)")
    for key in ("swiglu_limit", "rope_theta", "rms_norm_eps", "rope_scaling_factor"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ModelError(f"{path}: {key} is {value!r}; it must be a finite positive number")
    for key in ("layer_types", "rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is not None and not isinstance(value, (list if key == "layer_types" else dict)):
            raise ModelError(f"{path}: {key} is {type(value).__name__}, not a "
                             f"{'list' if key == 'layer_types' else 'JSON object'}")


def read_config(checkpoint_dir: str | Path, **config_overrides):
    """``GptOssConfig`` from ``checkpoint_dir/config.json`` (either naming), with ``config_overrides`` applied.

    The quantization_config is dropped (fp4pass holds the MXFP4 weights itself). Overriding
    ``num_hidden_layers`` with fewer layers keeps the first ones (``layer_types`` cut to match). A field of the
    wrong type or out of range (a count that is not a positive integer, a size not a multiple of 32, top-k over
    the experts, ...) is a ModelError naming the file and the field.
    """
    from transformers import GptOssConfig

    path = Path(checkpoint_dir) / "config.json"
    if not os.path.lexists(path):
        raise ModelError(f"{checkpoint_dir}: no config.json (not a gpt-oss checkpoint folder)")
    try:  # a regular file only: a config.json linked to /dev/zero or a FIFO would be read forever
        raw = strict_json(read_regular_file(path, CONFIG_MAX_BYTES, ModelError))
    except (ValueError, RecursionError) as exc:  # the one strict reader: no key twice, no NaN, bounded depth
        raise ModelError(f"{path}: cannot read ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: holds a JSON {type(raw).__name__}; expected a JSON object")
    quant = raw.pop("quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        raise ModelError(f"{path}: quantization_config is {type(quant).__name__}, not a JSON object")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise ModelError(f"{path}: quant_method is {quant.get('quant_method')!r}; load_gpt_oss reads mxfp4")
    if raw.get("model_type", "gpt_oss") != "gpt_oss":
        raise ModelError(f"{path}: model_type is {raw.get('model_type')!r}, not gpt_oss")
    _check_fields(raw, path)
    if "num_experts" in raw and "num_local_experts" not in raw:
        try:
            raw = _openai_config(raw)
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{path}: gpt-oss package config: {exc}") from None
        _check_fields(raw, path)
    layers = config_overrides.get("num_hidden_layers")
    if layers is not None and "layer_types" not in config_overrides and raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:layers]
    raw.update(config_overrides)
    _check_fields(raw, path)
    try:
        return GptOssConfig.from_dict(raw)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors, of many types
        raise ModelError(f"{path}: config does not make a GptOssConfig ({type(exc).__name__}: {exc})") from None


def _hf_names(name: str, tensor: torch.Tensor, config) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor -> [(transformers name, tensor)]; OpenAI names translated, qkv split in three."""
    match = _OPENAI_QKV.fullmatch(name)
    if match:
        layer, kind = match.groups()
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        if tensor.dim() == 0 or tensor.shape[0] != q + 2 * kv:
            raise ModelError(f"{name}: shape {list(tensor.shape)}, expected q {q} + k {kv} + v {kv} rows")
        parts = torch.split(tensor, [q, kv, kv], dim=0)
        return [(f"model.layers.{layer}.self_attn.{p}_proj.{kind}", t.contiguous())
                for p, t in zip("qkv", parts)]
    for pattern, replacement in _OPENAI_NAMES:
        if re.fullmatch(pattern, name):
            return [(re.sub(pattern, replacement, name), tensor)]
    return [(name, tensor)]


def _safetensors_files(checkpoint_dir: str | Path) -> list[Path]:
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{checkpoint_dir}: no .safetensors files")
    return files


def _open(file: Path, device):
    """``safe_open`` of one file whose header the shared safetensors reader has checked first
    (:class:`fp4pass.safetensors.files.SafetensorsFile`: the length, the JSON, every entry's dtype, shape and
    offsets, the file's size), so that a header that lies is one ModelError naming the file and the tensor, in
    the words the checkpoint door uses."""
    from safetensors import safe_open

    try:
        SafetensorsFile(file)
    except CheckpointError as exc:
        problem = str(exc).removeprefix(f"{file.name}: ")
        raise ModelError(f"{file}: not a readable safetensors file: {problem}") from None
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...: the file is bad, whatever the kind
        raise ModelError(f"{file}: not a readable safetensors file: {type(exc).__name__}: {exc}") from None


def checkpoint_layers(checkpoint_dir: str | Path) -> int:
    """How many decoder layers the checkpoint's tensors hold (highest layer index + 1), from the file headers
    alone (no tensor is read). Both namings."""
    top = -1
    for file in _safetensors_files(checkpoint_dir):
        with _open(file, "cpu") as f:
            for key in f.keys():
                match = _LAYER.match(key) or _OPENAI_LAYER.match(key)
                if match:
                    top = max(top, int(match.group(1)))
    return top + 1


def checkpoint_tensors(checkpoint_dir: str | Path, config, *, device="cpu", dtype=torch.float32):
    """Yield (transformers name, tensor) for every tensor of the folder's ``*.safetensors`` files.

    MXFP4 ``*_blocks`` / ``*_scales`` come as stored (uint8); float tensors are cast to ``dtype``. Tensors of
    layers at or past ``config.num_hidden_layers`` are skipped (a model cut short by an override). A file or a
    tensor that cannot be read is a ModelError naming both.
    """
    for _file, _key, name, tensor in _read_tensors(checkpoint_dir, config, device, dtype):
        yield name, tensor


def _read_tensors(checkpoint_dir, config, device, dtype):
    """(file, stored key, transformers name, tensor) for :func:`checkpoint_tensors` and its error messages."""
    for file in _safetensors_files(checkpoint_dir):
        with _open(file, device) as f:
            for key in f.keys():
                try:
                    stored = f.get_tensor(key)
                except Exception as exc:  # noqa: BLE001 - truncated data, bad dtype, ...
                    raise ModelError(f"{file}: tensor {key}: cannot be read ({type(exc).__name__}: {exc})") from None
                for name, tensor in _hf_names(key, stored, config):
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
                    elif name.endswith(("weight", "bias", "sinks")):
                        raise ModelError(f"{file.name}: tensor {key} is {tensor.dtype}; a float is expected")
                    yield file, key, name, tensor


class CausalLMLogits(torch.nn.Module):
    """``input_ids -> logits`` around a causal LM (no cache): the plain signature ``torch.export`` wants.

    The wrapped model is the attribute ``m``, so exported names read ``m.model.layers.0...``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False).logits


EXPERT_FORWARDS = ("routed", "dense")


def load_gpt_oss(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, experts: str = "routed", **config_overrides):
    """transformers' ``GptOssForCausalLM`` (eval mode, eager attention) with :class:`MXFP4Experts` experts.

    ``checkpoint_dir``: a folder with ``config.json`` and MXFP4 ``*.safetensors`` in Hugging Face or OpenAI
    naming (module docstring). ``device``: where the tensors are read to. ``dtype``: the float weights'
    dtype (the experts' dequantized weights are cast to the activations' dtype). On the CPU, safetensors maps
    each tensor from its file: the MXFP4 experts, and the float weights whenever ``dtype`` is their stored
    dtype (``torch.bfloat16`` for gpt-oss), are never copied, and their pages are file pages the kernel can
    drop and read again. That is how a 24-layer gpt-oss-20b-shaped model (13 GB) runs in a few GB of memory
    in use; a ``dtype`` that casts copies those weights. The files must stay unchanged while the model lives. ``experts``: the eager
    forward of the experts, ``routed`` (each picked expert dequantized alone, top-k work) or ``dense`` (every
    expert on every token); ``torch.export`` traces the dense forward either way (:class:`MXFP4Experts`).
    ``config_overrides``: ``GptOssConfig`` fields, e.g. ``num_hidden_layers=2`` to load the first two layers
    only. The config asks for no more layers than the checkpoint holds, checked before anything is built.
    """
    transformers = require("transformers", "gpt-oss", "load_gpt_oss")
    GptOssForCausalLM = getattr(transformers, "GptOssForCausalLM", None)
    if GptOssForCausalLM is None:
        raise UsageError("load_gpt_oss needs transformers >= 5: pip install 'fp4pass[gpt-oss]'")
    if experts not in EXPERT_FORWARDS:
        raise UsageError(f"load_gpt_oss: experts must be one of {', '.join(EXPERT_FORWARDS)}, not {experts!r}")

    attn_implementation = config_overrides.pop("attn_implementation", "eager")
    config = read_config(checkpoint_dir, **config_overrides)
    config._attn_implementation = attn_implementation
    stored_layers = checkpoint_layers(checkpoint_dir)
    if config.num_hidden_layers > stored_layers:
        raise ModelError(f"{Path(checkpoint_dir) / 'config.json'}: num_hidden_layers is {config.num_hidden_layers}, "
                         f"but the checkpoint's tensors hold {stored_layers} layers")
    try:
        with torch.device("meta"):
            model = GptOssForCausalLM(config)
            for layer in model.model.layers:
                layer.mlp.experts = MXFP4Experts.from_config(config, dtype=dtype, routed=experts == "routed")
    except FP4PassError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' modeling code on a config it does not support
        raise ModelError(f"{Path(checkpoint_dir) / 'config.json'}: the config does not build a GptOssForCausalLM "
                         f"({type(exc).__name__}: {exc})") from None

    state, source = {}, {}
    for file, key, name, tensor in _read_tensors(checkpoint_dir, config, device, dtype):
        if name in state:
            raise ModelError(f"{file}: tensor {key}: {name} appears twice (also in {source[name]})")
        state[name], source[name] = tensor, f"{file}: tensor {key}"
    if config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        what = [f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "",
                f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}" if unexpected else ""]
        raise ModelError(f"{checkpoint_dir}: tensors do not fit GptOssForCausalLM: {'; '.join(w for w in what if w)}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelError(f"{source[name]} ({name}) has shape {list(tensor.shape)}, the config expects "
                             f"{list(expected[name].shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    del state

    # non-persistent buffers (RoPE inverse frequencies) are computed, not stored: build them for real
    try:
        with torch.device(device):
            model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    except Exception as exc:  # noqa: BLE001 - a RoPE config transformers cannot compute
        raise ModelError(f"{Path(checkpoint_dir) / 'config.json'}: RoPE parameters do not compute "
                         f"({type(exc).__name__}: {exc})") from None
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelError(f"{checkpoint_dir}: nothing loaded for {', '.join(left[:4])}")
    model.eval()
    log.info("load_gpt_oss: %d layers, %d experts from %s", config.num_hidden_layers, config.num_local_experts,
             checkpoint_dir)
    return model
