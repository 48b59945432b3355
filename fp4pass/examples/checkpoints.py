"""Example MXFP4 checkpoints in the three input forms fp4pass converts, any size, seeded.

``build_checkpoint(folder, form, layers, experts, hidden, intermediate, seed, ...)`` writes a Hugging Face style
folder (config.json, shards written by the ``safetensors`` package itself, an index when sharded, a tokenizer
and a generation config to be copied) whose MXFP4 tensors are:

- ``gpt-oss``: ``model.layers.{L}.mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] + ``_scales``
  uint8 [E, 2I, H/32], ``down_proj_*`` [E, H, I/32, 16] / [E, H, I/32], biases, a bf16 router;
- ``compressed-tensors`` (``mxfp4-pack-quantized``, the form Kimi-K3's experts ship in, on a DeepSeek-V3-architecture
  model): ``model.layers.{L}.mlp.experts.{e}.w1|w2|w3.weight_packed`` uint8 [out, in/2] + ``.weight_scale`` uint8 E8M0 [out, in/32], a bf16 ``mlp.gate``;
- ``deepseek`` (DeepSeek-V4 native): ``layers.{L}.ffn.experts.{e}.w1|w2|w3.weight`` int8 packed E2M1 [out, in/2]
  + ``.scale`` float8_e8m0fnu [out, in/32], a bf16 ``ffn.gate``.

``dense=True`` adds one MXFP4 dense Linear per layer in the same form (the attention output projection).
Attention, norms, embeddings and lm_head are bf16 (copied by a conversion).

The MXFP4 bytes are drawn directly (uniform random nibbles; E8M0 exponents around a per-expert base), which
makes large checkpoints cheap to build: expert e of a layer sits ``expert_step * e`` octaves (modulo 12) above
expert 0 (block exponents spread +-3 around that), so per-expert global scales differ. ``lossy_expert=(L, e)``
gives that expert (its w1, or its rows of a gpt-oss stack) a block 20 octaves below the rest (exponent spread
> 17: converted lossily). gpt-oss-20b's real shapes: ``hidden=2880,
intermediate=2880, experts=32``.

This module uses numpy, torch's dtypes and the safetensors package only, never fp4pass's conversion code.
``python -m fp4pass.examples.checkpoints OUT_DIR --form deepseek --layers 2 --experts 4`` builds one that
transformers' model of the form runs (what calibrate and diff need; ``--names-only`` for just the tensors
conversion reads);
``python -m fp4pass.examples.checkpoints models/checkpoints --bundled`` rebuilds the committed tiny examples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from fp4pass.examples.kimi_k3 import build_kimi_k3
from fp4pass.examples.tensors import (TOKENIZER_FILES, ShardedWriter, bf16_values, f32_values, mxfp4_codes,
                                     save_shard)

__all__ = ["build_checkpoint", "build_bundled", "BUNDLED", "FORMS", "main", "TOKENIZER_FILES"]

FORMS = ("gpt-oss", "compressed-tensors", "deepseek")
KIMI_K3 = "kimi-k3"  # a family, not a form: the compressed-tensors MXFP4 experts of the Kimi-K3 release
def _gpt_oss_heads(h: int) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head dim) of a runnable gpt-oss example: 4, 2, 16 below hidden 1024;
    gpt-oss-20b's 64, 8, 64 from 1024 up."""
    return (4, 2, 16) if h < 1024 else (64, 8, 64)


def _norm(rng, h: int, form: str, runnable: bool) -> torch.Tensor:
    """An RMSNorm weight: around 1 in runnable examples (float32 in DeepSeek-V4's), else around 0.02 in bf16."""
    if not runnable:
        return bf16_values(rng, h)
    weight = f32_values(rng, h, one=True)
    return weight if form == "deepseek" else weight.to(torch.bfloat16)


_HC = 2  # DeepSeek-V4 hyper-connection streams in the runnable examples

#: the config fields each architecture's transformers model needs beyond the shapes (runnable examples)
_RUNNABLE = {
    "gpt-oss": lambda layers, i, h: {**dict(zip(("num_attention_heads", "num_key_value_heads", "head_dim"),
                                                 _gpt_oss_heads(h))),
                                      "num_experts_per_tok": 2 if h < 1024 else 4, "attention_bias": True,
                                      "experts_per_token": 2 if h < 1024 else 4, "sliding_window": 8 if h < 1024
                                      else 128, "rms_norm_eps": 1e-5},
    "compressed-tensors": lambda layers, i, h: {
        "architectures": ["DeepseekV3ForCausalLM"], "moe_intermediate_size": i, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "n_shared_experts": 1,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6},
    "deepseek": lambda layers, i, h: {
        "moe_intermediate_size": i, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "hc_mult": _HC,
        "sliding_window": 8, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention" if j % 2 == 0 else "compressed_sparse_attention" for j in range(layers)],
        "mlp_layer_types": ["hash_moe" if j == 0 else "moe" for j in range(layers)],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
}


def _runnable_attention(out, rng, form: str, prefix: str, attn: str, layer: int, h: int, vocab: int) -> None:
    """The attention weights of one layer that transformers' model of the architecture reads (``_RUNNABLE``)."""
    if form == "gpt-oss":  # biases; gpt-oss-20b's heads from hidden 1024 up
        heads, kv_heads, head_dim = _gpt_oss_heads(h)
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            out.add(f"{attn}.{proj}.weight", bf16_values(rng, rows, h))
            out.add(f"{attn}.{proj}.bias", bf16_values(rng, rows))
    elif form == "compressed-tensors":  # multi-head latent attention: 4 heads, kv rank 32, rope 8, nope 8, v 16
        out.add(f"{attn}.q_proj.weight", bf16_values(rng, 4 * 16, h))
        out.add(f"{attn}.kv_a_proj_with_mqa.weight", bf16_values(rng, 32 + 8, h))
        out.add(f"{attn}.kv_a_layernorm.weight", bf16_values(rng, 32) + 1)
        out.add(f"{attn}.kv_b_proj.weight", bf16_values(rng, 4 * (8 + 16), 32))
    else:  # DeepSeek-V4 native names: q rank 32, 4 heads of 32, one kv head, 2 output groups of rank 32
        out.add(f"{attn}.attn_sink", f32_values(rng, 4))
        out.add(f"{attn}.wq_a.weight", bf16_values(rng, 32, h))
        out.add(f"{attn}.q_norm.weight", f32_values(rng, 32, one=True))
        out.add(f"{attn}.wq_b.weight", bf16_values(rng, 4 * 32, 32))
        out.add(f"{attn}.wkv.weight", bf16_values(rng, 32, h))
        out.add(f"{attn}.kv_norm.weight", f32_values(rng, 32, one=True))
        out.add(f"{attn}.wo_a.weight", bf16_values(rng, 2 * 32, 4 * 32 // 2))
        if layer % 2 == 1:  # compressed sparse attention (rate 4): a compressor and its indexer
            out.add(f"{attn}.compressor.ape", f32_values(rng, 4, 64))
            out.add(f"{attn}.compressor.wkv.weight", bf16_values(rng, 64, h))
            out.add(f"{attn}.compressor.wgate.weight", bf16_values(rng, 64, h))
            out.add(f"{attn}.compressor.norm.weight", f32_values(rng, 32, one=True))
            out.add(f"{attn}.indexer.compressor.ape", f32_values(rng, 4, 32))
            out.add(f"{attn}.indexer.compressor.wkv.weight", bf16_values(rng, 32, h))
            out.add(f"{attn}.indexer.compressor.wgate.weight", bf16_values(rng, 32, h))
            out.add(f"{attn}.indexer.compressor.norm.weight", f32_values(rng, 16, one=True))
            out.add(f"{attn}.indexer.wq_b.weight", bf16_values(rng, 2 * 16, 32))
            out.add(f"{attn}.indexer.weights_proj.weight", bf16_values(rng, 2, h))


def build_checkpoint(folder, form: str = "gpt-oss", *, layers: int = 2, experts: int = 4, hidden: int = 64,
                     intermediate: int = 64, seed: int = 0, dense: bool = False, shard_bytes: int | None = None,
                     lossy_expert: tuple[int, int] | None = None, expert_step: int = 2, vocab: int = 32,
                     tokenizer: bool = True, runnable: bool = False) -> Path:
    """Write an example checkpoint into the new folder ``folder`` (module docstring); returns the folder.

    ``runnable``: every weight the architecture's transformers model needs (``_RUNNABLE``), so that transformers'
    own modeling code runs it (what calibration needs): gpt-oss attention with biases; DeepSeek-V3 multi-head
    latent attention, router correction bias and shared experts (compressed-tensors form); DeepSeek-V4 native
    attention (a sliding-window layer, then a compressed sparse one), hyper-connections, a hash-routed first
    layer that never routes a token to the last expert, and (``dense``) ``attn.wo_b`` as the MXFP4 Linear."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: choose one of {', '.join(FORMS)}")
    if hidden % 32 or intermediate % 32:
        raise ValueError("hidden and intermediate must be multiples of 32")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(seed)
    out = ShardedWriter(folder, shard_bytes)
    h, i = hidden, intermediate
    top = "model." if form != "deepseek" else ""
    out.add(f"{top}embed_tokens.weight" if form != "deepseek" else "embed.weight", bf16_values(rng, vocab, h))
    for layer in range(layers):
        prefix = f"model.layers.{layer}" if form != "deepseek" else f"layers.{layer}"
        attn = f"{prefix}.self_attn" if form != "deepseek" else f"{prefix}.attn"
        norm_names = (("input_layernorm", "post_attention_layernorm") if form != "deepseek"
                      else ("attn_norm", "ffn_norm"))
        out.add(f"{prefix}.{norm_names[0]}.weight", _norm(rng, h, form, runnable))
        if runnable:
            _runnable_attention(out, rng, form, prefix, attn, layer, h, vocab)
        else:
            for proj in ("q_proj", "k_proj", "v_proj") if form != "deepseek" else ("wq", "wkv"):
                out.add(f"{attn}.{proj}.weight", bf16_values(rng, h, h))
        o_name = f"{attn}.o_proj" if form != "deepseek" else f"{attn}.wo" + ("_b" if runnable else "")
        if dense:
            codes, scales = mxfp4_codes(rng, (h,), h, -6, False)
            if form == "gpt-oss":
                out.add(f"{o_name}.weight_blocks", codes.reshape(h, h // 32, 16))
                out.add(f"{o_name}.weight_scales", scales)
            elif form == "compressed-tensors":
                out.add(f"{o_name}.weight_packed", codes)
                out.add(f"{o_name}.weight_scale", scales)
            else:
                out.add(f"{o_name}.weight", codes.view(torch.int8))
                out.add(f"{o_name}.scale", scales.view(torch.float8_e8m0fnu))
        else:
            heads, _, head_dim = _gpt_oss_heads(h) if runnable and form == "gpt-oss" else (1, 0, h)
            out.add(f"{o_name}.weight", bf16_values(rng, h, heads * head_dim))
        if runnable and form == "gpt-oss":
            out.add(f"{o_name}.bias", bf16_values(rng, h))
        out.add(f"{prefix}.{norm_names[1]}.weight", _norm(rng, h, form, runnable))
        if form == "gpt-oss":
            out.add(f"{attn}.sinks", bf16_values(rng, _gpt_oss_heads(h)[0] if runnable else 4))
            mlp = f"{prefix}.mlp"
            out.add(f"{mlp}.router.weight", bf16_values(rng, experts, h))
            out.add(f"{mlp}.router.bias", bf16_values(rng, experts))
            for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                codes = torch.empty((experts, rows, k // 2), dtype=torch.uint8)
                scales = torch.empty((experts, rows, k // 32), dtype=torch.uint8)
                for e in range(experts):
                    lossy = lossy_expert == (layer, e)
                    codes[e], scales[e] = mxfp4_codes(rng, (rows,), k, -8 + (expert_step * e) % 12, lossy)
                out.add(f"{mlp}.experts.{proj}_blocks", codes.reshape(experts, rows, k // 32, 16))
                out.add(f"{mlp}.experts.{proj}_scales", scales)
                out.add(f"{mlp}.experts.{proj}_bias", bf16_values(rng, experts, rows))
            continue
        mlp = f"{prefix}.mlp" if form != "deepseek" else f"{prefix}.ffn"
        out.add(f"{mlp}.gate.weight", bf16_values(rng, experts, h))
        if runnable and form == "compressed-tensors":
            out.add(f"{mlp}.gate.e_score_correction_bias", f32_values(rng, experts))
        elif runnable and layer == 0:  # hash routing: token t -> experts (t % 2, 1 - t % 2); the last one unrouted
            table = np.stack([np.arange(vocab) % 2, 1 - np.arange(vocab) % 2], axis=1)
            out.add(f"{mlp}.gate.tid2eid", torch.from_numpy(table.astype(np.int64)))
        elif runnable:
            out.add(f"{mlp}.gate.bias", f32_values(rng, experts))
        for e in range(experts):
            for proj, rows, k in (("w1", i, h), ("w2", h, i), ("w3", i, h)):
                lossy = lossy_expert == (layer, e) and proj == "w1"
                base = -8 + (expert_step * e) % 12 + (1 if proj == "w3" else 0)
                codes, scales = mxfp4_codes(rng, (rows,), k, base, lossy)
                name = f"{mlp}.experts.{e}.{proj}"
                if form == "compressed-tensors":
                    out.add(f"{name}.weight_packed", codes)
                    out.add(f"{name}.weight_scale", scales)
                else:
                    out.add(f"{name}.weight", codes.view(torch.int8))
                    out.add(f"{name}.scale", scales.view(torch.float8_e8m0fnu))
        shared = (("gate_proj", "down_proj", "up_proj") if runnable and form == "compressed-tensors"
                  else ("w1", "w2", "w3"))
        for proj, rows, k in zip(shared, (i, h, i), (h, i, h)):
            out.add(f"{mlp}.shared_experts.{proj}.weight", bf16_values(rng, rows, k))
        if runnable and form == "deepseek":
            for site in ("attn", "ffn"):  # hyper-connections: (2 + hc) * hc mixing rows over hc * hidden
                out.add(f"{prefix}.hc_{site}_fn", f32_values(rng, (2 + _HC) * _HC, _HC * h))
                out.add(f"{prefix}.hc_{site}_base", f32_values(rng, (2 + _HC) * _HC))
                out.add(f"{prefix}.hc_{site}_scale", f32_values(rng, 3, one=True))
    out.add(f"{top}norm.weight" if form != "deepseek" else "norm.weight", _norm(rng, h, form, runnable))
    if runnable and form == "deepseek":
        out.add("hc_head_fn", f32_values(rng, _HC, _HC * h))
        out.add("hc_head_base", f32_values(rng, _HC))
        out.add("hc_head_scale", f32_values(rng, 1, one=True))
    out.add("lm_head.weight" if form != "deepseek" else "head.weight", bf16_values(rng, vocab, h))
    out.finish()
    config = _config(form, layers, experts, h, i, vocab)
    if runnable:
        config.update(_RUNNABLE[form](layers, i, h))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        for name, text in TOKENIZER_FILES.items():
            (folder / name).write_text(text)
    return folder


def _config(form: str, layers: int, experts: int, h: int, i: int, vocab: int) -> dict:
    base = {"num_hidden_layers": layers, "hidden_size": h, "intermediate_size": i, "vocab_size": vocab,
            "torch_dtype": "bfloat16"}
    if form == "gpt-oss":
        return {**base, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_local_experts": experts, "experts_per_token": min(4, experts),
                "quantization_config": {"quant_method": "mxfp4",
                                        "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                   "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]}}
    if form == "compressed-tensors":
        # a DeepSeek-V3-architecture model under a model type transformers does not know, as Kimi-K2 ships
        # (model_type kimi_k2, architectures DeepseekV3ForCausalLM); its experts in Kimi-K3's MXFP4 form
        return {**base, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "n_routed_experts": experts,
                "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                        "config_groups": {"group_0": {"targets": ["re:.*experts.*"], "weights": {
                                            "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                                            "format": "mxfp4-pack-quantized"}},
                                        "ignore": ["lm_head"], "quantization_status": "compressed"}}
    return {**base, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "n_routed_experts": experts,
            "expert_dtype": "fp4",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": [128, 128]}}


#: the tiny examples committed under models/checkpoints/ (folder name -> form); each has one lossy expert
#: (layer 1, expert 2) and, except gpt-oss, a dense MXFP4 Linear per layer; the DeepSeek one is sharded.
#: "kimi-k3" is the Kimi-K3 release's structure (:mod:`fp4pass.examples.kimi_k3`: compressed-tensors MXFP4
#: experts, 12 a layer, the lossy one layer 2's expert 11)
BUNDLED = {"gpt_oss": "gpt-oss", "deepseek_v3": "compressed-tensors", "deepseek": "deepseek", "kimi_k3": KIMI_K3}


def build_bundled(root) -> list[Path]:
    """Write the committed tiny examples into ``root`` (``python -m fp4pass.examples.checkpoints --bundled DIR``
    rebuilds models/checkpoints/ byte for byte)."""
    root = Path(root)
    return [build_kimi_k3(root / name) if form == KIMI_K3 else
            build_checkpoint(root / name, form, layers=2, experts=3, hidden=64, intermediate=32, seed=0,
                             dense=form != "gpt-oss", lossy_expert=(1, 2), vocab=32,
                             shard_bytes=60_000 if form == "deepseek" else None, runnable=True)
            for name, form in BUNDLED.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4pass.examples.checkpoints", description=__doc__.split("\n")[0])
    p.add_argument("folder")
    p.add_argument("--form", choices=FORMS + (KIMI_K3,), default="gpt-oss",
                   help=f"the MXFP4 input form, or {KIMI_K3} (the Kimi-K3 release's structure)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--shard-bytes", type=int)
    p.add_argument("--gpt-oss-20b-shapes", action="store_true", help="hidden = intermediate = 2880, 32 experts")
    p.add_argument("--bundled", action="store_true", help="write the tiny examples of models/checkpoints/ into folder")
    p.add_argument("--names-only", action="store_true",
                   help="only the tensors conversion reads (attention as plain bf16 squares): calibrate and diff "
                        "cannot run it; by default every weight transformers' model of the form needs is written")
    args = p.parse_args(argv)
    try:
        return _build(args)
    except FileExistsError as exc:  # folders are made new (mkdir exist_ok=False): one line, exit 2
        p.exit(2, f"fp4pass examples.checkpoints: error: {exc.filename or args.folder} exists; give a new folder\n")


def _build(args) -> int:
    if args.bundled:
        for path in build_bundled(args.folder):
            print(path)
        return 0
    hidden, inter, experts = args.hidden, args.intermediate, args.experts
    if args.gpt_oss_20b_shapes:
        hidden, inter, experts = 2880, 2880, 32
    if args.form == KIMI_K3:
        build_kimi_k3(args.folder, layers=max(args.layers, 2), experts=experts, hidden=hidden, latent=inter,
                      seed=args.seed, shard_bytes=args.shard_bytes)
    else:
        build_checkpoint(args.folder, args.form, layers=args.layers, experts=experts, hidden=hidden,
                         intermediate=inter, seed=args.seed, dense=args.dense, shard_bytes=args.shard_bytes,
                         runnable=not args.names_only)
    print(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
