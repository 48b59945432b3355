"""Independent numpy/ml_dtypes oracles for the MXFP4 -> NVFP4 conversion tests (no fp4pass code).

Everything here is re-derived from the format definitions (docs/formats.md): E2M1 table, E8M0 = 2^(code-127),
E4M3 via ml_dtypes, nibble order low-first; and the conversion methods of docs/conversion.md: Algo 1
(requant), Algo 3 (hybrid) and the candidate-scale bound of ``auto``, written out directly in float32/float64
numpy. Nothing here imports fp4pass.
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
    """Algo 3 (hybrid, docs/conversion.md) for one group, written out: float32 dequantized NVFP4 values [..., K].

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


F32 = np.float32
E4M3_CODE_MAX = 0x7E  # 448; 0x7F is NaN


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e4m3_code(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3FN code, RNE, saturating at 448 (clamped first: ml_dtypes turns overflow into NaN)."""
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest E2M1 value (RNE, saturating at 6) as float32."""
    return np.clip(np.asarray(x, np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


def requant(codes: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """Algo 1 for one group: float32 NVFP4 values [..., K] of plain NVFP4 quantization of the MXFP4 values.

    S = max(amax/(6*448), 2^-140) in float32; s = e4m3(clamp(amax16/(6S), 2^-9, 448)); q = rne_e2m1(v/(s*S)).
    """
    x = mx_dequant(codes, e8m0).astype(np.float32)
    amax = F32(np.abs(x).max())
    S = max(F32(amax / F32(6 * 448)), F32(2.0**-140)) if amax > 0 else F32(1.0)
    return _quantize_halves(x.reshape(-1, 16), S).reshape(x.shape)


def _quantize_halves(halves: np.ndarray, S, code_offset: int = 0) -> np.ndarray:
    amax = np.abs(halves).max(-1)
    s0 = e4m3_code(np.clip(amax / (F32(6) * F32(S)), F32(2.0**-9), F32(448)))
    s = np.clip(s0.astype(np.int32) + code_offset, 1, E4M3_CODE_MAX).astype(np.uint8)
    full = (e4m3_value(s) * F32(S)).astype(np.float32)[:, None]
    return (e2m1_round((halves / full).astype(np.float32)) * full).astype(np.float32)


def mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))


def auto_candidates(codes: np.ndarray, e8m0: np.ndarray) -> list[np.float32]:
    """The global scales ``auto`` tries on a group whose spread exceeds 17 (docs/conversion.md), in float32:
    2^(k_max-8), 2^(k_max-8)/c for c = 1.125..1.75, 2^(k_max-7)/c for c = 1.125..1.875, and amax/(6*448)."""
    holds = (codes.reshape(*e8m0.shape, 32) & 7).any(-1)
    k_max = int(e8m0.astype(np.int64)[holds].max()) - 127
    low, high = F32(2.0 ** (k_max - 8)), F32(2.0 ** (k_max - 7))
    mantissas = [1 + i / 8 for i in range(1, 8)]
    amax = F32(np.abs(mx_dequant(codes, e8m0)).max())
    return ([low] + [F32(low / F32(c)) for c in mantissas if c <= 1.75] + [F32(high / F32(c)) for c in mantissas]
            + [max(F32(amax / F32(6 * 448)), F32(2.0**-140))])


def auto_best_candidates(codes: np.ndarray, e8m0: np.ndarray) -> list[tuple[tuple, np.float32]]:
    """The global scales of ``auto``'s wide ("best") search on a group of spread > 17, labelled, in float32:
    (("octave", d, c), 2^(k_max-8+d)/c) for d in -2..2 and c in 1, 1.125..1.875, and (("amax", s), amax/(6*s))
    for s = 448 (requant's) and the E4M3 codes 256, 288, .., 416."""
    holds = (codes.reshape(*e8m0.shape, 32) & 7).any(-1)
    k_max = int(e8m0.astype(np.int64)[holds].max()) - 127
    out = []
    for d in (-2, -1, 0, 1, 2):
        base = F32(2.0 ** (k_max - 8 + d))
        out += [(("octave", d, c), F32(base / F32(c))) for c in [1 + i / 8 for i in range(8)]]
    amax = F32(np.abs(mx_dequant(codes, e8m0)).max())
    out.append((("amax", 448), max(F32(amax / F32(6 * 448)), F32(2.0**-140))))
    # amax/(6*s) for the E4M3 codes s of the top octave below 448, quotient in float64 rounded once
    return out + [(("amax", s), F32(max(float(amax) / (6 * s), 2.0**-140))) for s in (256, 288, 320, 352, 384, 416)]


def sse_at(codes: np.ndarray, e8m0: np.ndarray, S, steps=(0, -1, 1)) -> float:
    """Least total squared error over the 16-halves of one group at global scale S, each half taking its
    verbatim scale (some E4M3 s with float32(s*S) == 2^k exactly) where there is one, else the best of the
    standard code s0 and its neighbours s0 + ``steps``. The bound ``auto`` must meet at each of its candidates."""
    S = F32(S)
    x = mx_dequant(codes, e8m0).astype(np.float32)
    halves = x.reshape(-1, 16)
    k = np.repeat(e8m0.reshape(-1).astype(np.int64) - 127, 2)
    target = np.exp2(k.astype(np.float64)).astype(np.float32)
    guess = e4m3_code(np.clip(target / S, 0, 448)).astype(np.int32)
    verbatim = np.abs(halves).max(-1) == 0
    for step in (-1, 0, 1):
        s = np.clip(guess + step, 1, E4M3_CODE_MAX).astype(np.uint8)
        verbatim |= (e4m3_value(s) * S).astype(np.float32) == target
    errors = [((halves.astype(np.float64) - _quantize_halves(halves, S, d).astype(np.float64)) ** 2).sum(-1)
              for d in steps]
    best = np.minimum.reduce(errors)
    return float(np.where(verbatim, 0.0, best).sum())


def auto_bound(codes: np.ndarray, e8m0: np.ndarray) -> float:
    """The least SSE ``auto`` may reach on one group: 0 when the spread is at most 17, else the minimum of
    :func:`sse_at` over :func:`auto_candidates`."""
    if spread(codes, e8m0) <= 17:
        return 0.0
    return min(sse_at(codes, e8m0, S) for S in auto_candidates(codes, e8m0))


# -- test data and measures -------------------------------------------------------------------------------

def expert_codes(seed: int):
    """Element codes [4, 32, 128] and E8M0 codes [4, 32, 4] for four experts of different kinds.

    0: spread 12 (lossless); 1: spread 18, one block at k_max - 18 whose magnitudes avoid 0.5 and 1.5, so
    that at S = 2^(k_max-8) its halves are reproduced exactly with other nibbles (verbatim means nibbles
    kept too); 2: spread 25 with zero blocks; 3: spread 40, values 2^-30 apart from the top.
    """
    rng = np.random.default_rng(seed)
    experts = []
    for spread_, zero_rate, k_low in ((12, 0.0, -10), (18, 0.0, -12), (25, 0.2, -20), (40, 0.0, -30)):
        experts.append(random_mx(rng, (32, 128), spread_, zero_block_rate=zero_rate, k_low=k_low))
    codes = np.stack([c for c, _ in experts])
    e8m0 = np.stack([s for _, s in experts])
    block = codes[1].reshape(32, 4, 32)
    low = np.argwhere(e8m0[1] == e8m0[1].min())[0]
    even = rng.choice(np.array([2, 4, 5, 6, 7, 10, 12, 13, 14, 15], np.uint8), 32)
    block[low[0], low[1]] = even
    return codes, e8m0


def verbatim_count(mx_codes, mx_values, nv_codes, nv_values) -> int:
    """16-halves whose E2M1 codes are the input's and whose values are reproduced exactly."""
    kept = (mx_codes.reshape(-1, 16) == nv_codes.reshape(-1, 16)).all(-1)
    exact = (mx_values.reshape(-1, 16) == nv_values.reshape(-1, 16)).all(-1)
    return int((kept & exact).sum())


def snr_db(signal, error):
    """10 log10(sum signal^2 / sum error^2) in float64; None when the error is zero."""
    sse = float(np.sum((error.astype(np.float64)) ** 2))
    return None if sse == 0 else 10 * np.log10(float(np.sum(signal.astype(np.float64) ** 2)) / sse)
