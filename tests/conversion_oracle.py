"""Independent numpy/ml_dtypes oracles for the MXFP4 -> NVFP4 conversion tests (no fp4pass code).

Everything here is re-derived from FACTS.md: E2M1 table, E8M0 = 2^(code-127), E4M3 via ml_dtypes, nibble
order low-first, seed 000's Algo 3 (hybrid) written out directly in float64/float32 numpy.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., B] -> element codes [..., 2B], low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def pack(codes: np.ndarray) -> np.ndarray:
    pairs = codes.reshape(*codes.shape[:-1], -1, 2).astype(np.uint8)
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def mx_dequant(codes: np.ndarray, e8m0: np.ndarray, block: int = 32) -> np.ndarray:
    """Element codes [..., K] and E8M0 codes [..., K/block] -> float64 values."""
    v = E2M1[codes].reshape(*e8m0.shape, block)
    return (v * np.exp2(e8m0.astype(np.float64) - 127)[..., None]).reshape(codes.shape)


def nv_dequant(codes: np.ndarray, e4m3: np.ndarray, global_scale) -> np.ndarray:
    """NVFP4 dequant in float32 as ONNX's two DQs: e2m1 * float32(e4m3 * g)."""
    s = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = np.asarray(global_scale, np.float32)
    g = g.reshape(g.shape + (1,) * (s.ndim - g.ndim))
    full = (s * g).astype(np.float32)
    v = E2M1[codes].astype(np.float32).reshape(*s.shape, 16)
    return (v * full[..., None]).astype(np.float32).reshape(codes.shape)


def spread(codes: np.ndarray, e8m0: np.ndarray, block: int = 32) -> int:
    holds = (codes.reshape(*e8m0.shape, block) & 7).any(-1)
    k = e8m0.astype(np.int64)[holds] - 127
    return int(k.max() - k.min()) if k.size else 0


def hybrid(codes: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """Seed 000 Algo 3 for one group, written out: float32 dequantized NVFP4 values [..., K].

    m = k_max - 8 over blocks holding a value; blocks with k - m in [-9, 8] are exact; each other 16-half is
    quantized with S = 2^m: s = e4m3(clamp(amax/(6S), 2^-9, 448)), q = rne_e2m1(v / (s*S)), x = q*s*S.
    """
    x = mx_dequant(codes, e8m0).astype(np.float32)
    holds = (codes.reshape(*e8m0.shape, 32) & 7).any(-1)
    k = e8m0.astype(np.int64) - 127
    m = k[holds].max() - 8 if holds.any() else 0
    S = np.float32(2.0**m)
    in_range = (k - m >= -9) | ~holds
    halves = x.reshape(-1, 16)
    exact = np.repeat(in_range.reshape(-1), 2)
    amax = np.abs(halves).max(-1)
    s = np.clip(amax / (np.float32(6) * S), np.float32(2.0**-9), np.float32(448)).astype(np.float32)
    s = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = (s * S).astype(np.float32)
    q = (halves / full[:, None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    requant = (q * full[:, None]).astype(np.float32)
    return np.where(exact[:, None], halves, requant).reshape(x.shape)


def random_mx(rng: np.random.Generator, shape, spread_: int, zero_block_rate: float = 0.0, k_low: int = -20):
    """Random element codes [shape] and E8M0 codes with exponents in [k_low, k_low + spread_], both ends used."""
    *lead, k = shape
    nb = k // 32
    codes = rng.integers(0, 16, size=shape).astype(np.uint8)
    exps = rng.integers(k_low, k_low + spread_ + 1, size=(*lead, nb))
    flat = exps.reshape(-1)
    flat[0], flat[-1] = k_low, k_low + spread_
    blocks = codes.reshape(*lead, nb, 32)
    mag = blocks[..., 0] & 7
    blocks[..., 0] = (blocks[..., 0] & 8) | np.where(mag == 0, 1, mag)  # every block holds a value
    if zero_block_rate:
        zero = rng.random((*lead, nb)) < zero_block_rate
        zero.reshape(-1)[[0, -1]] = False
        blocks[zero] = 0
    return blocks.reshape(shape), (exps + 127).astype(np.uint8)
