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
