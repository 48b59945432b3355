"""Independent decoders for the checkpoint tests: numpy + ml_dtypes + the safetensors package, no fp4pass code.

- MXFP4 source: packed E2M1 (low nibble = even element) times 2^(E8M0 byte - 127);
- NVFP4 output: E2M1 times float8_e4m3fn block scale times the FP32 global multiplier (or divided by
  compressed-tensors' divisor);
- ModelOpt's gpt-oss stack layout: [E, K/2, N] codes and [E, K/16, N] scales, transposed back per expert.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def _values(codes: np.ndarray) -> np.ndarray:
    codes = codes.astype(np.uint8)
    pairs = np.stack((codes & 0x0F, codes >> 4), axis=-1)
    return E2M1[pairs.reshape(*codes.shape[:-1], codes.shape[-1] * 2)]


def mx_decode(codes: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """float64 [..., K] of packed codes [..., K/2] and E8M0 bytes [..., K/32]."""
    v = _values(codes).reshape(*e8m0.shape, 32)
    scale = np.ldexp(1.0, e8m0.astype(np.int64) - 127)
    return (v * scale[..., None]).reshape(*codes.shape[:-1], -1)


def nv_decode(codes: np.ndarray, e4m3: np.ndarray, multiplier: float) -> np.ndarray:
    """float64 [..., K] of packed codes [..., K/2], E4M3 bytes [..., K/16] and a global multiplier."""
    v = _values(codes).reshape(*e4m3.shape, 16)
    block = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.float64(np.float32(multiplier))
    return (v * block[..., None]).reshape(*codes.shape[:-1], -1)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes as uint8 numpy of its shape (float8 dtypes included)."""
    return t.contiguous().view(torch.uint8).numpy()


class Folder:
    """Every tensor of a checkpoint folder through the safetensors package (index or not)."""

    def __init__(self, folder):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = {}
        self.where = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            f = safe_open(str(path), framework="pt")
            self.files[path.name] = f
            for key in f.keys():
                assert key not in self.where, key
                self.where[key] = path.name

    def __contains__(self, name):
        return name in self.where

    def keys(self):
        return list(self.where)

    def get(self, name) -> torch.Tensor:
        return self.files[self.where[name]].get_tensor(name)

    def dtype(self, name) -> str:
        return self.files[self.where[name]].get_slice(name).get_dtype()

    def shape(self, name) -> list:
        return list(self.files[self.where[name]].get_slice(name).get_shape())


def tree_hash(folder) -> dict:
    """{relative path: (sha256, mode, mtime_ns)} of every file under ``folder``."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(folder))] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mode,
                                                  st.st_mtime_ns)
    return out


def requant_sse(x: np.ndarray) -> float:
    """SSE of plain NVFP4 quantization of x [N, K] (ModelOpt's formulas, in numpy + ml_dtypes)."""
    x32 = x.astype(np.float32)
    amax = np.float32(np.abs(x32).max())
    g = np.float32(amax / np.float32(2688.0)) if amax > 0 else np.float32(1.0)
    blocks = x32.reshape(x.shape[0], -1, 16)
    bamax = np.abs(blocks).max(-1)
    s = np.clip(bamax / (np.float32(6.0) * g), 2.0**-9, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = (s * g)[..., None]
    q = np.clip(blocks / full, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    y = (q * full.astype(np.float64)).reshape(x.shape)
    return float(((y - x) ** 2).sum())


def require_direct_writes(folder) -> None:
    """Skip the test where ``folder``'s file system does not open files for O_DIRECT (the shard writer then
    writes everything through the page cache, which other tests cover)."""
    flag = getattr(os, "O_DIRECT", 0)
    probe = Path(folder) / "direct-probe"
    probe.touch()
    try:
        fd = os.open(probe, os.O_WRONLY | flag) if flag else -1
    except OSError:
        fd = -1
    probe.unlink()
    if fd < 0:
        pytest.skip("the test folder's file system takes no O_DIRECT writes")
    os.close(fd)


# -- inputs: small checkpoints of the kinds of input real models have (numpy + the safetensors package) ----------

#: expert projection names (gate, up, down): DeepSeek/Mixtral style and Hugging Face style
NAMINGS = {"w": ("w1", "w3", "w2"), "hf": ("gate_proj", "up_proj", "down_proj")}
EXPERTS_PREFIX = "model.layers.0.mlp.experts"
#: a lossy weight's low blocks lie this many octaves below the weight's base exponent (E4M3 spans 17)
LOW_OCTAVES = 21


def write_checkpoint(folder, tensors: dict, config: dict, shards: int = 1, files: dict | None = None):
    """A checkpoint folder written by the safetensors package: ``tensors`` (name -> torch tensor) in order, cut
    into ``shards`` files of about equal tensor counts named ``model-0000i-of-0000n.safetensors`` with an index
    (one file: ``model.safetensors``, no index), config.json, and ``files`` (name -> text) beside them."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return folder


def _mx_bytes(rng, rows: int, k: int, base: int, low_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Random packed codes uint8 [rows, k/2] and E8M0 bytes [rows, k/32] within +-3 octaves of ``base``; the first
    ``low_blocks`` blocks of row 0 (then row 1, ...) are LOW_OCTAVES below it and hold 6.0 everywhere."""
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = (127 + base + rng.integers(-3, 4, (rows, k // 32))).astype(np.uint8)
    for b in range(low_blocks):
        r, c = divmod(b, k // 32)
        scales[r, c] = 127 + base - LOW_OCTAVES
        codes[r, c * 16:(c + 1) * 16] = 0x77
    return codes, scales


def moe_checkpoint(folder, form: str = "compressed-tensors", naming: str = "w", experts: int = 3, hidden: int = 64,
                   inter: int = 64, lossy: dict | None = None, seed: int = 0, shards: int = 1,
                   files: dict | None = None, fp4_config: bool = True):
    """One MoE layer of MXFP4 experts and bf16 ``lm_head`` / ``mlp.gate`` (copied by a conversion).

    ``form``: "compressed-tensors" (``E.{proj}.weight_packed`` + ``.weight_scale`` uint8) or "deepseek"
    (``.weight`` int8 + ``.scale`` float8_e8m0fnu), per expert ``E = model.layers.0.mlp.experts.{e}`` with the
    projection names of ``naming`` (NAMINGS); or "gpt-oss" (stacks ``gate_up_proj_blocks`` [E, 2I, H/32, 16]
    and ``down_proj_blocks``, one global scale for all experts). Expert e's gate sits at base exponent -8 + e,
    its up one octave higher (a pair's shared global scale is then up's, not gate's own), its down at the base.
    ``lossy``: {(expert, "gate" | "up" | "down"): n}: that weight gets n blocks LOW_OCTAVES below its base
    (spread > 17: converted lossily; two lossy weights with different n have different errors).
    ``fp4_config``: DeepSeek's config says ``expert_dtype: fp4``.
    """
    import torch

    rng = np.random.default_rng(seed)
    lossy = lossy or {}
    h, i = hidden, inter
    tensors: dict = {"model.embed_tokens.weight": torch.zeros(8, h, dtype=torch.bfloat16)}
    roles = (("gate", i, h, 0), ("up", i, h, 1), ("down", h, i, 0))
    if form == "gpt-oss":
        for proj, parts in (("gate_up_proj", roles[:2]), ("down_proj", roles[2:])):
            rows, k = parts[0][1] * len(parts), parts[0][2]
            codes = np.empty((experts, rows, k // 2), dtype=np.uint8)
            scales = np.empty((experts, rows, k // 32), dtype=np.uint8)
            for e in range(experts):
                low = sum(lossy.get((e, role), 0) for role, *_ in parts)
                codes[e], scales[e] = _mx_bytes(rng, rows, k, -8 + e, low)
            tensors[f"{EXPERTS_PREFIX}.{proj}_blocks"] = torch.from_numpy(codes.reshape(experts, rows, k // 32, 16))
            tensors[f"{EXPERTS_PREFIX}.{proj}_scales"] = torch.from_numpy(scales)
            tensors[f"{EXPERTS_PREFIX}.{proj}_bias"] = torch.zeros(experts, rows, dtype=torch.bfloat16)
        config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    else:
        names = dict(zip(("gate", "up", "down"), NAMINGS[naming]))
        for e in range(experts):
            for role, rows, k, above in roles:
                codes, scales = _mx_bytes(rng, rows, k, -8 + e + above, lossy.get((e, role), 0))
                m = f"{EXPERTS_PREFIX}.{e}.{names[role]}"
                if form == "compressed-tensors":
                    tensors[f"{m}.weight_packed"] = torch.from_numpy(codes)
                    tensors[f"{m}.weight_scale"] = torch.from_numpy(scales)
                else:
                    tensors[f"{m}.weight"] = torch.from_numpy(codes).view(torch.int8)
                    tensors[f"{m}.scale"] = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
        if form == "compressed-tensors":
            config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}
        else:
            config = {"quantization_config": {"quant_method": "fp8"}, **({"expert_dtype": "fp4"} if fp4_config else {})}
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(experts, h, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.ones(8, h, dtype=torch.bfloat16)
    return write_checkpoint(folder, tensors, {"hidden_size": h, **config}, shards=shards, files=files)


def expert_modules(naming: str, experts: int) -> list[tuple[str, str, str]]:
    """(gate, up, down) module names of every expert of :func:`moe_checkpoint`."""
    return [tuple(f"{EXPERTS_PREFIX}.{e}.{p}" for p in NAMINGS[naming]) for e in range(experts)]


def source_linear(folder, module: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [N, K/2], E8M0 bytes [N, K/32]) of one per-Linear MXFP4 weight of a source folder."""
    f = Folder(folder)
    if f"{module}.weight_packed" in f:
        return as_bytes(f.get(f"{module}.weight_packed")), as_bytes(f.get(f"{module}.weight_scale"))
    return as_bytes(f.get(f"{module}.weight")), as_bytes(f.get(f"{module}.scale"))


def snr_db(x: np.ndarray, y: np.ndarray) -> float:
    """10 log10(sum x^2 / sum (y - x)^2), float64."""
    return float(10 * np.log10(np.square(x).sum() / np.square(y - x).sum()))


def rewrite_shard(path, edit) -> None:
    """Rewrite a shard with the safetensors package: ``edit(tensors)`` changes the dict of its tensors in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
