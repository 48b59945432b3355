"""Calibrate a gpt-oss-120b-shaped checkpoint on this machine and report its peak memory.

    python tests/calibrate_120b_check.py [--layers 36] [--keep DIR]

The checkpoint has gpt-oss-120b's shapes (36 layers, 128 experts of H = I = 2880, 64 query heads and 8 key/value
heads of 64, vocabulary 201088: 60.8 GB of MXFP4 experts) and no values: its one shard is a sparse file, every
byte zero (E2M1 code 0 is +0, E8M0 code 0 is 2^-127, bf16 0 is +0), so it costs no disk and no time to write,
while the calibration reads, dequantizes and runs every layer's 128 experts as it would a real one's. With
zero router weights every token picks experts 0-3, so few tokens are run; the memory is the weights'.

A child process runs ``fp4pass.checkpoint.calibrate`` on 4 x 64 tokens; its peak RSS (VmHWM) and time are
printed as JSON beside the formula of docs/checkpoint.md ("Memory"). Not part of the test suite: ~10 minutes
on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

H = I = 2880
EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 4, 64, 8, 64, 201088

CHILD = """
import json, sys, time
import fp4pass.checkpoint
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before, start = hwm(), time.perf_counter()
scales = fp4pass.checkpoint.calibrate(sys.argv[1], sys.argv[2], batch_size=4, device="cpu")
print(json.dumps({"seconds": time.perf_counter() - start, "rss_before": before, "rss_peak": hwm(),
                  "layers": scales.layers, "timings": scales.timings,
                  "routed_experts": sum(1 for r in scales.experts if r["tokens"])}))
"""


def tensors(layers: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a gpt-oss checkpoint of 120b's shapes with ``layers`` layers."""
    out = [("model.embed_tokens.weight", "BF16", [VOCAB, H]), ("model.norm.weight", "BF16", [H]),
           ("lm_head.weight", "BF16", [VOCAB, H])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", [H]), (p + "post_attention_layernorm.weight", "BF16", [H]),
                (p + "self_attn.sinks", "BF16", [HEADS])]
        for proj, rows, cols in (("q_proj", HEADS * HEAD_DIM, H), ("k_proj", KV_HEADS * HEAD_DIM, H),
                                 ("v_proj", KV_HEADS * HEAD_DIM, H), ("o_proj", H, HEADS * HEAD_DIM)):
            out += [(f"{p}self_attn.{proj}.weight", "BF16", [rows, cols]),
                    (f"{p}self_attn.{proj}.bias", "BF16", [rows])]
        out += [(p + "mlp.router.weight", "BF16", [EXPERTS, H]), (p + "mlp.router.bias", "BF16", [EXPERTS])]
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            e = f"{p}mlp.experts.{proj}"
            out += [(e + "_blocks", "U8", [EXPERTS, rows, cols // 32, 16]),
                    (e + "_scales", "U8", [EXPERTS, rows, cols // 32]), (e + "_bias", "BF16", [EXPERTS, rows])]
    return out


def write_sparse_checkpoint(folder: Path, layers: int) -> int:
    """config.json + one all-zero sparse shard; returns the shard's apparent size in bytes."""
    folder.mkdir(parents=True)
    header, offset = {}, 0
    for name, dtype, shape in tensors(layers):
        size = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": layers,
              "hidden_size": H, "intermediate_size": I, "vocab_size": VOCAB, "num_local_experts": EXPERTS,
              "num_experts_per_tok": TOP_K, "experts_per_token": TOP_K, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": True, "sliding_window": 128,
              "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (folder / "config.json").write_text(json.dumps(config))
    return offset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--keep", type=Path, help="build the checkpoint here and leave it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp4pass-120b-", dir=args.keep and args.keep.parent) as tmp:
        folder = args.keep or Path(tmp) / "ckpt"
        apparent = write_sparse_checkpoint(folder, args.layers)
        ids = Path(tmp) / "ids.npz"
        np.savez(ids, input_ids=np.random.default_rng(0).integers(0, VOCAB, size=(4, 64)))
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(ids)], capture_output=True, text=True,
                             env=env, check=False)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        result = json.loads(out.stdout.strip().splitlines()[-1])
    expert_layer = EXPERTS * 3 * I * H * 2
    formula = VOCAB * H * 2 + 2 * expert_layer + EXPERTS * 2 * I * H // 2
    print(json.dumps({**result, "wall_seconds": time.perf_counter() - start, "checkpoint_bytes": apparent,
                      "rss_peak_GiB": result["rss_peak"] / 2**30,
                      "formula_GiB (embedding + two layers' bf16 experts + one stack's codes)": formula / 2**30,
                      "machine_memory_GiB": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
