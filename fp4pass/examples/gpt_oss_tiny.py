"""A tiny gpt-oss-shaped model in MXFP4, written as a safetensors checkpoint like the real ones.

Architecture: transformers' ``GptOssForCausalLM`` at a small size (:data:`TINY_CONFIG`): 3 layers alternating
sliding-window (8) and full attention, hidden 64, 4 heads of 16 with 2 KV heads, attention biases and sinks,
YaRN RoPE as in gpt-oss (factor 32 over 4096), 4 experts with top-2 routing, intermediate 64, clamped SwiGLU
(alpha 1.702, limit 7) with biases, vocabulary 256.

Weights are drawn from ``torch.Generator().manual_seed(seed)`` on CPU, so a seed gives the same bytes:
O(1) embeddings, matrices with standard deviation 1/sqrt(fan-in) times a per-expert factor (x1, x1/2, x2,
x1), small biases, norm gains near 1. The experts are quantized to MXFP4 with the OCP FLOOR rule. In layer 1,
expert 3's ``gate_up_proj`` has 8 rows scaled by 2^-20, so its exponent spread exceeds the 17 that an
NVFP4 global scale can hold: the one expert that converts lossily. Everything else is stored bf16, norms
float32, as in the released checkpoints.

Naming ``"hf"`` (default): ``config.json`` of ``GptOssConfig`` with ``quantization_config`` {quant_method:
mxfp4} and ``model.safetensors`` with transformers' names (``...experts.gate_up_proj_blocks`` [E, 2I, H/32,
16] uint8, ``..._scales`` [E, 2I, H/32] uint8). Naming ``"openai"``: the gpt-oss package's names and
config.json (``block.{n}.mlp.mlp1_weight.blocks``, ``block.{n}.attn.qkv``, ...).

    python -m fp4pass.examples.gpt_oss_tiny OUTDIR [--naming hf|openai] [--seed N]

The same model as ONNX (:func:`export_tiny_gpt_oss_onnx`), and calibration data for it
(:func:`write_tiny_calib`)::

    python -m fp4pass.examples.gpt_oss_tiny --onnx models/tiny_gpt_oss.onnx --calib models/tiny_gpt_oss_calib.npz

The ONNX model is the checkpoint loaded by :func:`fp4pass.fx.load_gpt_oss` (float32), wrapped by
:class:`fp4pass.fx.gpt_oss.CausalLMLogits`, traced by ``torch.export`` with a dynamic batch and sequence
length and written by :func:`fp4pass.fx.export`: ``input_ids`` int64 [batch, seq] -> ``logits`` float32
[batch, seq, vocab], the experts as MXFP4 ``DequantizeLinear`` (FLOAT4E2M1 codes, FLOAT8E8M0 scales, opset 24).
The calibration data is one ``input_ids`` array of :data:`CALIB_SHAPE`, uniform over the vocabulary, drawn
from ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from fp4pass.formats import MXFP4Tensor

__all__ = ["TINY_CONFIG", "GPT_OSS_20B_CONFIG", "tiny_state_dict", "build_tiny_gpt_oss", "build_sized_gpt_oss",
           "export_tiny_gpt_oss_onnx", "tiny_calib_ids", "write_tiny_calib", "main"]

#: GptOssConfig fields of the tiny model (others take transformers' gpt-oss defaults).
TINY_CONFIG = {
    "num_hidden_layers": 3,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 64,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "sliding_window": 8,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
}
#: gpt-oss-20b's layer shapes (hidden 2880, intermediate 2880, 32 experts, top-4, 64 heads of 64, 8 KV heads,
#: sliding window 128, vocabulary 201088): for :func:`build_sized_gpt_oss`, which writes random bytes of
#: these shapes (not the released weights).
GPT_OSS_20B_CONFIG = {
    **TINY_CONFIG,
    "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128,
}
EXPERT_FACTORS = (1.0, 0.5, 2.0, 1.0)
LOSSY = {"layer": 1, "expert": 3, "rows": 8, "factor": 2.0 ** -20}
_MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_state_dict(seed: int = 0, config: dict | None = None) -> dict[str, torch.Tensor]:
    """Float32 weights in transformers' names; experts as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    (rows = outputs, the checkpoint's orientation)."""
    c = {**TINY_CONFIG, **(config or {})}
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    h, i, e, hd = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    sd = {"model.embed_tokens.weight": normal(c["vocab_size"], h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = 1 + normal(h, std=0.1)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{name}_proj.weight"] = normal(rows, h, std=h ** -0.5)
            sd[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = normal(h, q, std=q ** -0.5)
        sd[p + "self_attn.o_proj.bias"] = normal(h, std=0.1)
        sd[p + "self_attn.sinks"] = normal(c["num_attention_heads"])
        sd[p + "post_attention_layernorm.weight"] = 1 + normal(h, std=0.1)
        sd[p + "mlp.router.weight"] = normal(e, h, std=h ** -0.5)
        sd[p + "mlp.router.bias"] = normal(e, std=0.1)
        factors = torch.tensor(EXPERT_FACTORS[:e] + (1.0,) * max(0, e - len(EXPERT_FACTORS))).view(e, 1, 1)
        gate_up = normal(e, 2 * i, h, std=h ** -0.5) * factors
        if n == LOSSY["layer"] and LOSSY["expert"] < e:
            gate_up[LOSSY["expert"], : LOSSY["rows"]] *= LOSSY["factor"]
        sd[p + "mlp.experts.gate_up_proj"] = gate_up
        sd[p + "mlp.experts.gate_up_proj_bias"] = normal(e, 2 * i, std=0.1)
        sd[p + "mlp.experts.down_proj"] = normal(e, h, i, std=i ** -0.5) * factors
        sd[p + "mlp.experts.down_proj_bias"] = normal(e, h, std=0.1)
    sd["model.norm.weight"] = 1 + normal(h, std=0.1)
    sd["lm_head.weight"] = normal(c["vocab_size"], h, std=h ** -0.5)
    return sd


def _stored(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: experts -> MXFP4 blocks/scales (uint8), norms float32, the rest bf16."""
    out = {}
    for name, tensor in sd.items():
        if name.endswith((".gate_up_proj", ".down_proj")):
            mx = MXFP4Tensor.quantize(tensor, scale_rule="floor", name=name)
            out[f"{name}_blocks"] = mx.codes.reshape(*mx.codes.shape[:-1], -1, 16).contiguous()
            out[f"{name}_scales"] = mx.scales.contiguous()
        elif "norm" in name:
            out[name] = tensor.float().contiguous()
        else:
            out[name] = tensor.to(torch.bfloat16).contiguous()
    return out


def _openai_names(stored: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {"embedding.weight": stored["model.embed_tokens.weight"], "norm.scale": stored["model.norm.weight"],
           "unembedding.weight": stored["lm_head.weight"]}
    for n in range(num_layers):
        p, b = f"model.layers.{n}.", f"block.{n}."
        a = p + "self_attn."
        for kind in ("weight", "bias"):
            out[b + f"attn.qkv.{kind}"] = torch.cat([stored[a + f"{x}_proj.{kind}"] for x in "qkv"]).contiguous()
            out[b + f"attn.out.{kind}"] = stored[a + f"o_proj.{kind}"]
            out[b + f"mlp.gate.{kind}"] = stored[p + f"mlp.router.{kind}"]
        out[b + "attn.sinks"] = stored[a + "sinks"]
        out[b + "attn.norm.scale"] = stored[p + "input_layernorm.weight"]
        out[b + "mlp.norm.scale"] = stored[p + "post_attention_layernorm.weight"]
        for ours, theirs in (("gate_up_proj", "mlp1"), ("down_proj", "mlp2")):
            x = p + f"mlp.experts.{ours}"
            out[b + f"mlp.{theirs}_weight.blocks"] = stored[x + "_blocks"]
            out[b + f"mlp.{theirs}_weight.scales"] = stored[x + "_scales"]
            out[b + f"mlp.{theirs}_bias"] = stored[x + "_bias"]
    return out


def _hf_config(c: dict) -> dict:
    from transformers import GptOssConfig

    config = GptOssConfig(**c).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": _MODULES_NOT_CONVERTED}
    config.pop("transformers_version", None)
    return config


def _openai_config(c: dict) -> dict:
    rope = c["rope_parameters"]
    return {
        "num_hidden_layers": c["num_hidden_layers"], "num_experts": c["num_local_experts"],
        "experts_per_token": c["num_experts_per_tok"], "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "swiglu_limit": c["swiglu_limit"], "head_dim": c["head_dim"],
        "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
        "sliding_window": c["sliding_window"], "initial_context_length": rope["original_max_position_embeddings"],
        "rope_theta": rope["rope_theta"], "rope_scaling_factor": rope["factor"],
        "rope_ntk_alpha": rope["beta_slow"], "rope_ntk_beta": rope["beta_fast"],
    }


def _write_atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the checkpoint is for everyone to read
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # and the rename itself survives a crash
        finally:
            os.close(folder)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_tiny_gpt_oss(out_dir: str | Path, seed: int = 0, naming: str = "hf", config: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of the tiny MXFP4 gpt-oss into ``out_dir``; returns it.

    ``config``: GptOssConfig fields to change from :data:`TINY_CONFIG` (the hidden and intermediate sizes must
    stay multiples of 32).
    """
    from safetensors.torch import save_file

    if naming not in ("hf", "openai"):
        raise ValueError(f"naming must be 'hf' or 'openai', not {naming!r}")
    c = {**TINY_CONFIG, **(config or {})}
    stored = _stored(tiny_state_dict(seed, c))
    if naming == "openai":
        stored, config_json = _openai_names(stored, c["num_hidden_layers"]), _openai_config(c)
    else:
        config_json = _hf_config(c)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "model.safetensors", lambda p: save_file(stored, p, metadata={"format": "pt"}))
    _write_atomic(out / "config.json", lambda p: Path(p).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n"))
    return out


def _sized_tensors(c: dict, seed: int):
    """(name, stored tensor) of a model of config ``c``, drawn one tensor at a time: the experts as random MXFP4
    bytes (E2M1 codes uniform over the 16, E8M0 scales 2^-8..2^-6), never through a float copy; the rest bf16
    (norms float32) with standard deviation 1/sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    h, i, e, hd = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def normal(*shape, std=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def packed(rows, k):
        blocks = torch.randint(0, 256, (e, rows, k // 32, 16), generator=g, dtype=torch.uint8)
        return blocks, torch.randint(119, 122, (e, rows, k // 32), generator=g, dtype=torch.uint8)

    yield "model.embed_tokens.weight", normal(c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", 1 + normal(h, std=0.1, dtype=torch.float32)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{name}_proj.weight", normal(rows, h, std=h ** -0.5)
            yield p + f"self_attn.{name}_proj.bias", normal(rows, std=0.1)
        yield p + "self_attn.o_proj.weight", normal(h, q, std=q ** -0.5)
        yield p + "self_attn.o_proj.bias", normal(h, std=0.1)
        yield p + "self_attn.sinks", normal(c["num_attention_heads"])
        yield p + "post_attention_layernorm.weight", 1 + normal(h, std=0.1, dtype=torch.float32)
        yield p + "mlp.router.weight", normal(e, h, std=h ** -0.5)
        yield p + "mlp.router.bias", normal(e, std=0.1)
        for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = packed(rows, k)
            yield p + f"mlp.experts.{proj}_blocks", blocks
            yield p + f"mlp.experts.{proj}_scales", scales
            yield p + f"mlp.experts.{proj}_bias", normal(e, rows, std=0.1)
    yield "model.norm.weight", 1 + normal(h, std=0.1, dtype=torch.float32)
    yield "lm_head.weight", normal(c["vocab_size"], h, std=h ** -0.5)


def build_sized_gpt_oss(out_dir: str | Path, config: dict | None = None, seed: int = 0, *,
                        shard_bytes: int = 2_000_000_000) -> Path:
    """Write a gpt-oss checkpoint of any size (Hugging Face naming, MXFP4 experts) into ``out_dir``; returns it.

    ``config``: GptOssConfig fields over :data:`GPT_OSS_20B_CONFIG` (e.g. ``{"num_hidden_layers": 2,
    "vocab_size": 4096}`` for two gpt-oss-20b-shaped layers with a small vocabulary; ``{}`` for the whole
    24-layer model, about 13 GB). The weights are random (:func:`_sized_tensors`): for memory and speed
    measurements at real shapes, not for accuracy.

    Written shard by shard: tensors are drawn one at a time and a shard is saved as soon as adding the next
    tensor would take it past ``shard_bytes``, so memory holds one shard (about 0.4 GB of packed experts per
    layer at gpt-oss-20b's shapes), whatever the model's size. One shard is ``model.safetensors``; several are
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, as Hugging Face writes them.
    """
    from safetensors.torch import save_file

    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    c = {**GPT_OSS_20B_CONFIG, **(config or {})}
    c.setdefault("layer_types", None)
    if c["layer_types"] is None:
        c["layer_types"] = ["sliding_attention" if n % 2 == 0 else "full_attention"
                            for n in range(c["num_hidden_layers"])]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str], int]] = []  # (written part, its tensor names, its bytes)
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        part = out / f".part-{len(parts):05d}.safetensors"
        _write_atomic(part, lambda p: save_file(current, p, metadata={"format": "pt"}))
        parts.append((part, list(current), size))
        current, size = {}, 0

    for name, tensor in _sized_tensors(c, seed):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
        current[name], size = tensor, size + nbytes
    if current:
        flush()
    n = len(parts)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for (part, _, _), name in zip(parts, names):
        os.replace(part, out / name)
    if n > 1:
        index = {"metadata": {"total_size": sum(p[2] for p in parts)},
                 "weight_map": {t: name for (_, tensors, _), name in zip(parts, names) for t in tensors}}
        _write_atomic(out / "model.safetensors.index.json",
                      lambda p: Path(p).write_text(json.dumps(index, indent=2) + "\n"))
    _write_atomic(out / "config.json", lambda p: Path(p).write_text(json.dumps(_hf_config(c), indent=2,
                                                                                sort_keys=True) + "\n"))
    return out


#: Shape of the calibration ``input_ids`` (batch, sequence).
CALIB_SHAPE = (8, 32)
#: Example input the ONNX export is traced with (batch and sequence are dynamic in the model).
_EXAMPLE_SHAPE = (2, 16)


def tiny_program(checkpoint_dir: str | Path, dynamic: bool = True):
    """``torch.export`` of the tiny gpt-oss in ``checkpoint_dir`` as ``input_ids -> logits`` (dynamic batch and
    sequence when ``dynamic``), traced on a seeded example input."""
    import fp4pass.fx
    from fp4pass.fx.gpt_oss import CausalLMLogits

    model = fp4pass.fx.load_gpt_oss(checkpoint_dir)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, _EXAMPLE_SHAPE, generator=torch.Generator().manual_seed(0))
    shapes = None
    if dynamic:
        shapes = ({0: torch.export.Dim("batch", max=4096), 1: torch.export.Dim("seq", min=2, max=4096)},)
    return torch.export.export(CausalLMLogits(model), (ids,), dynamic_shapes=shapes), (ids,)


def _name_io(model) -> None:
    """Name the graph's input dims ``batch`` / ``seq`` (everywhere they occur) and its output ``logits``."""
    import onnx_ir as ir

    (ids,) = model.graph.inputs
    rename = {str(d): n for d, n in zip(ids.shape, ("batch", "seq")) if isinstance(d, ir.SymbolicDim)}
    values = [*model.graph.inputs, *model.graph.outputs, *(v for node in model.graph for v in node.outputs)]
    for value in values:
        if value.shape is not None and any(str(d) in rename for d in value.shape if isinstance(d, ir.SymbolicDim)):
            value.shape = ir.Shape([rename.get(str(d), d) if isinstance(d, ir.SymbolicDim) else d
                                    for d in value.shape])
    (logits,) = model.graph.outputs
    logits.name = "logits"
    for node in model.graph:  # source paths of this machine: not part of the model
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def export_tiny_gpt_oss_onnx(path: str | Path, checkpoint_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Write the tiny gpt-oss as MXFP4 ONNX (module docstring) to ``path``; returns it.

    ``checkpoint_dir``: an existing checkpoint; by default one is built from ``seed`` in a temporary folder.
    Rebuilding gives the same bytes.
    """
    import fp4pass.fx
    from fp4pass.onnx.loading import save

    with tempfile.TemporaryDirectory() as tmp:
        source = checkpoint_dir if checkpoint_dir is not None else build_tiny_gpt_oss(tmp, seed=seed)
        program, example = tiny_program(source)
        model = fp4pass.fx.export(program, example)
    _name_io(model)
    model.producer_name, model.producer_version = "fp4pass.examples.gpt_oss_tiny", None
    save(model, path, external_data="never")
    return Path(path)


def tiny_calib_ids(seed: int = 0, shape: tuple[int, int] = CALIB_SHAPE, vocab: int = TINY_CONFIG["vocab_size"]):
    """Seeded calibration ``input_ids`` (int64, uniform over the vocabulary)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int64)


def write_tiny_calib(path: str | Path, seed: int = 0) -> Path:
    """Write ``{"input_ids": tiny_calib_ids(seed)}`` as ``.npz`` (the ``--calib`` file of ``fp4pass convert``)."""
    import numpy as np

    path = Path(path)
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, input_ids=tiny_calib_ids(seed))

    _write_atomic(path, write)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp4pass.examples.gpt_oss_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", help="write the safetensors checkpoint here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--naming", choices=("hf", "openai"), default="hf")
    parser.add_argument("--onnx", metavar="MODEL.onnx", help="write the model as MXFP4 ONNX (fp4pass.fx.export)")
    parser.add_argument("--calib", metavar="DATA.npz", help="write seeded calibration input_ids")
    args = parser.parse_args(argv)
    if not (args.out_dir or args.onnx or args.calib):
        parser.error("nothing to write: give OUT_DIR, --onnx or --calib")
    if args.out_dir:
        path = build_tiny_gpt_oss(args.out_dir, seed=args.seed, naming=args.naming)
        print(f"wrote {path}/config.json and {path}/model.safetensors")
    if args.onnx:
        print(f"wrote {export_tiny_gpt_oss_onnx(args.onnx, seed=args.seed)}")
    if args.calib:
        print(f"wrote {write_tiny_calib(args.calib, seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
