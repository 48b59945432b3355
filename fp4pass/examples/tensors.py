"""What the example checkpoints are made of: seeded random MXFP4 codes and scales, bf16 and float32 values,
shards written by the ``safetensors`` package itself (with an index when sharded), and a tiny tokenizer.

Nothing here uses fp4pass's conversion code: the examples are inputs to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["TOKENIZER_FILES", "ShardedWriter", "save_shard", "mxfp4_codes", "bf16_values", "f32_values"]

TOKENIZER_FILES = {
    "tokenizer.json": json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(["<unk>", " ", ".", ","]
                                                          + [chr(c) for c in range(ord("a"), ord("z") + 1)]
                                                          + ["<s>", "</s>"])},
                  "merges": []}}),
    "tokenizer_config.json": json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}),
    "generation_config.json": json.dumps({"do_sample": False, "eos_token_id": 1}),
    "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
}


def save_shard(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600; a shard is a normal file, for everyone to read


def mxfp4_codes(rng, shape_rows: tuple, k: int, base: int, lossy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes [..., k/2] and E8M0 codes [..., k/32] around exponent ``base``."""
    codes = rng.integers(0, 256, size=(*shape_rows, k // 2), dtype=np.uint8)
    scales = (127 + base + rng.integers(-3, 4, size=(*shape_rows, k // 32))).astype(np.uint8)
    if lossy:
        flat = scales.reshape(-1, k // 32)
        flat[0, 0] = 127 + base - 20  # 20 octaves below: spread > 17 within this weight
        codes.reshape(-1, k // 2)[0, :16] = 0x77  # the block holds values (6.0)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def bf16_values(rng, *shape) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * 0.02).astype(np.float32)).to(torch.bfloat16)


def f32_values(rng, *shape, one: bool = False) -> torch.Tensor:
    """float32 values around 0.02 (or around 1.0 with ``one``: norm weights and scales)."""
    values = rng.standard_normal(shape) * 0.02 + (1.0 if one else 0.0)
    return torch.from_numpy(values.astype(np.float32))


class ShardedWriter:
    """Collects tensors, writing a shard whenever ``shard_bytes`` is reached; ``finish`` writes the index."""

    def __init__(self, folder: Path, shard_bytes: int | None):
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.size += tensor.numel() * tensor.element_size()
        if self.shard_bytes is not None and self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_shard(self.pending, self.folder / name)
        self.files.append((name, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        if self.shard_bytes is None and len(self.files) == 1:
            (self.folder / self.files[0][0]).rename(self.folder / "model.safetensors")
            return
        n = len(self.files)
        weight_map = {}
        total = 0
        for i, (old, names) in enumerate(self.files):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / old).rename(self.folder / new)
            total += (self.folder / new).stat().st_size
            weight_map.update({t: new for t in names})
        (self.folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


