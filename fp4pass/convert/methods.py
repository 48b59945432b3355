"""The four MXFP4 -> NVFP4 methods, each choosing one FP32 global scale S per group (module ``layout``).

Notation: block b of an MX tensor has exponent k_b; k_max/k_min over the blocks that hold a value;
spread = k_max - k_min. A block's nibbles stay valid at block scale s = 2^(k_b)/S when s is an exact E4M3 value.

1. ``requant`` (Algo 1, docs/conversion.md): S = amax/(6*448), then plain NVFP4 quantization of the dequantized values.
2. ``verbatim`` (Algo 2): S = 2^m, every nibble kept, block scale 2^clamp(k_b - m, -9, 8) (out-of-window
   blocks snapped). m_rule ``midpoint``: m = floor((k_max + k_min + 1)/2); ``search``: the m minimizing the
   closed-form snap error sum_b (sum_i e2m1_i^2) * (2^k_b - 2^(m + clamp(k_b - m, -9, 8)))^2.
3. ``hybrid`` (Algo 3): m = k_max - 8; blocks with k_b - m in [-9, 8] verbatim (lossless when spread <= 17),
   every other 16-half requantized on its own with S = 2^m.
4. ``auto``: groups with spread <= 17 take hybrid's lossless path (no code is unpacked). Every other group
   tries candidate global scales S and, at each S, gives every 16-half its verbatim scale when exact, else the
   least-SSE E4M3 code among the standard s0 and its neighbours; the S of least total SSE wins.
   effort ``best`` (default): S = 2^(k_max-8)/c for every E4M3 mantissa c in 1, 1.125..1.875 (8 scales),
       amax/(6*448) (requant's) and amax/(6*s) for the E4M3 codes s = 256, 288, .., 416 (``AMAX_CODES``;
       15 scales); codes s0, s0 -+ 1, s0 -+ 2. No octave other than hybrid's: the amax/(6*s) scales follow
       the group's largest magnitude down (for amax = 1.5 * 2^k_max they are 2^(k_max-10)/c), and with them
       no group is known where 2^(k_max-8+d)/c with d in -2..2 reaches a lower error (searched: 2,900
       random and structured groups; the brute-force optimum below on the study and on gpt-oss-like experts).
   effort ``fast``: S = 2^(k_max-8) (hybrid's), 2^(k_max-8)/c for c in 1.125..1.75, 2^(k_max-7)/c for c in
       1.125..1.875, amax/(6*448); codes s0, s0 -+ 1.
   Since hybrid's and requant's S are candidates and their per-half choices are among the options, auto's
   SSE <= min(requant, hybrid) per group. S = 2^m/c keeps the verbatim path exact for the blocks where
   2^(k_b-m)*c is still an E4M3 value; S = amax/(6*s) keeps the group's largest element exact at E2M1 6 with
   block code s, which for amax = 4 * 2^k_max is no 2^m/c (it is 2^m * (4/3)/c). Against a brute-force optimum
   (``tests/search_headroom.py``: every 16-half at its best of all 126 E4M3 codes, S on a 128-per-octave grid
   plus every scale where some element can be exact) ``best`` is within a relative 1e-7 of it on the study's
   five lossy scenarios (geomean MSE 1.436e-07; before the amax/(6*s) scales 1.497e-07, 23% above the optimum
   on the single extreme outlier); docs/conversion-search.md. The search runs on distinct half patterns
   (:mod:`fp4pass.convert.patterns`), so its cost grows with the patterns (~10^5 per expert), not the halves.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fp4pass.convert import layout as layout_mod
from fp4pass.convert.layout import E4M3_POW2_CODES, EMPTY_K, GroupLayout, exact_pow2
from fp4pass.formats import decode_e2m1, global_scale_from_amax, unpack_nibbles
from fp4pass.formats.constants import (E4M3_MIN_NORMAL_EXP, E4M3_POW2_MAX_EXP, E4M3_POW2_MIN_EXP, E8M0_BIAS,
                                       E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN, GLOBAL_SCALE_MIN)

__all__ = ["verbatim_scales", "pow2_scale_codes", "choose_m", "auto_candidates", "AUTO_STEPS", "AMAX_CODES"]

log = logging.getLogger(__name__)

# E4M3 mantissas c > 1: S = 2^m/c keeps s = 2^(k-m)*c an E4M3 value (c <= 1.75 at the top exponent 8).
MANTISSAS = tuple(1 + i / 8 for i in range(1, 8))


def verbatim_scales(scales: torch.Tensor, m_rows: torch.Tensor, halves_per_block: int) -> torch.Tensor:
    """E8M0 codes [n, B] and per-row m [n] -> E4M3 codes [n, B*h] of 2^clamp(k - m, -9, 8), straight from exponents."""
    lut = torch.tensor(E4M3_POW2_CODES, dtype=torch.uint8, device=scales.device)
    e = (scales.to(torch.int32) - E8M0_BIAS - m_rows.to(torch.int32).unsqueeze(-1)).clamp(
        E4M3_POW2_MIN_EXP, E4M3_POW2_MAX_EXP) - E4M3_POW2_MIN_EXP
    codes = lut[e]
    return codes.repeat_interleave(halves_per_block, dim=-1) if halves_per_block > 1 else codes


def pow2_scale_codes(scales: torch.Tensor, layout: GroupLayout, m: list[int], lo: list[int],
                     hi: list[int]) -> torch.Tensor:
    """``verbatim_scales`` for per-group m, given each group's E8M0 code range lo/hi (host lists of G ints).

    When every block of every group has k - m in [-6, 8] (E4M3 normals: the usual case), the E4M3 code of
    2^(k-m) is ((k - m) + 7) << 3 = (e8m0 - 120 - m) << 3: one uint8 add (wrapping, the result is 1..15) and,
    for two 16-halves per MX block, one multiply by 8 * 257 into int16, whose two bytes are then both the
    code (a byte repeated twice needs no endianness). Otherwise the clamped LUT of ``verbatim_scales``.
    """
    h = layout.halves_per_block
    device = scales.device
    normal = all(l - E8M0_BIAS - g >= E4M3_MIN_NORMAL_EXP and u - E8M0_BIAS - g <= E4M3_POW2_MAX_EXP
                 for l, u, g in zip(lo, hi, m))
    if layout.total_rows and not normal and layout_mod.on_host(scales):
        return torch.from_numpy(_pow2_codes_host_lut(scales.reshape(layout.groups, -1).numpy(), m, h)).reshape(
            layout.total_rows, -1)
    if layout.total_rows == 0 or not normal:
        m_rows = torch.tensor(m, dtype=torch.int32, device=device).repeat_interleave(layout.rows_per_group)
        return verbatim_scales(scales, m_rows, h)
    if layout_mod.on_host(scales):  # numpy on the same memory, one thread
        return torch.from_numpy(_pow2_codes_host(scales.reshape(layout.groups, -1).numpy(), m, h)).reshape(
            layout.total_rows, -1)
    if len(set(m)) == 1:  # one offset for the whole tensor: a scalar add
        t = scales + ((-(120 + m[0])) % 256)
    else:
        offset = torch.tensor([(-(120 + g)) % 256 for g in m], dtype=torch.uint8, device=device)
        t = scales.reshape(layout.groups, -1) + offset.unsqueeze(-1)  # (k - m) + 7 in 1..15
    if h == 2:
        spread = torch.tensor([8 * 257], dtype=torch.int16, device=device)
        return (t * spread).view(torch.uint8).reshape(layout.total_rows, -1)
    t = t.bitwise_left_shift_(3).reshape(layout.total_rows, -1)
    return t.repeat_interleave(h, dim=-1) if h > 1 else t


def _pow2_codes_host(scales: np.ndarray, m: list[int], h: int) -> np.ndarray:
    """The integer fast path of ``pow2_scale_codes`` in numpy: scales uint8 [G, n] -> E4M3 codes [G, n*h].

    Why numpy on CPU: ``layout.on_host``.
    """
    offset = np.array([(-(120 + g)) % 256 for g in m], dtype=np.uint8).reshape(-1, 1)
    t = np.add(scales, offset, dtype=np.uint8)  # (k - m) + 7 in 1..15, wrapping
    if h == 2:
        return np.multiply(t, np.uint16(8 * 257), dtype=np.uint16).view(np.uint8)
    t <<= 3
    return np.repeat(t, h, axis=-1) if h > 1 else t


def _pow2_codes_host_lut(scales: np.ndarray, m: list[int], h: int) -> np.ndarray:
    """``verbatim_scales`` in numpy for any window (subnormal block scales too): scales uint8 [G, n] -> E4M3
    codes [G, n*h], through one 256-entry table per group (E8M0 code -> E4M3 code of 2^clamp(k - m, -9, 8)).

    One gather pass per group and no wide temporaries (``mode="clip"``: a uint8 index is always in the table, and
    numpy's default mode buffers the whole output); with two halves per block the table holds the code in
    both bytes of a uint16, so the gather writes both halves at once.
    """
    codes = np.arange(256, dtype=np.int64) - E8M0_BIAS
    pow2 = np.array(E4M3_POW2_CODES, dtype=np.uint16)
    out = np.empty((scales.shape[0], scales.shape[1] * h), dtype=np.uint8)
    step = 1 << 20  # numpy widens the uint8 indices to intp: in pieces, so that costs 8 MiB, not 8 bytes a scale
    for g, m_g in enumerate(m):
        lut = pow2[np.clip(codes - m_g, E4M3_POW2_MIN_EXP, E4M3_POW2_MAX_EXP) - E4M3_POW2_MIN_EXP]
        table = (lut * 257).astype(np.uint16) if h == 2 else lut.astype(np.uint8)
        target = out[g].view(np.uint16) if h == 2 else np.empty(scales.shape[1], dtype=np.uint8)
        for i in range(0, scales.shape[1], step):
            np.take(table, scales[g, i:i + step], out=target[i:i + step], mode="clip")
        if h != 2:
            out[g] = np.repeat(target, h) if h > 1 else target
    return out


def choose_m(codes, scales, layout: GroupLayout, k_max, k_min, rule: str, chunks) -> torch.Tensor:
    """Verbatim exponent m per group (int64 [G]); rules in the module docstring."""
    empty = k_max == EMPTY_K
    mid = torch.div(k_max + k_min + 1, 2, rounding_mode="floor").to(torch.int64)
    mid = torch.where(empty, torch.zeros_like(mid), mid)
    if rule == "midpoint":
        return mid
    # Weight per (group, exponent): W[g, k] = sum over blocks of sum_i e2m1_i^2 (E2M1 squares, exact in float64).
    device = codes.device
    weight = torch.zeros(layout.groups * 256, dtype=torch.float64, device=device)
    for lo, hi in chunks:
        element = decode_e2m1(unpack_nibbles(codes[lo:hi])).double()
        block_energy = element.square().reshape(hi - lo, -1, layout.mx_block).sum(-1)
        groups = (torch.arange(lo, hi, device=device) // layout.rows_per_group).unsqueeze(-1)
        weight.index_add_(0, (groups * 256 + scales[lo:hi].long()).flatten(), block_energy.flatten())
    weight = weight.reshape(layout.groups, 256)[:, :E8M0_NAN]  # codes 0..254
    k = torch.arange(E8M0_MIN_EXP, E8M0_MAX_EXP + 1, device=device, dtype=torch.float64)
    m = torch.arange(-136, 137, device=device, dtype=torch.float64)
    snapped = m.unsqueeze(-1) + (k.unsqueeze(0) - m.unsqueeze(-1)).clamp(E4M3_POW2_MIN_EXP, E4M3_POW2_MAX_EXP)  # [M, 255]
    penalty = (torch.exp2(k).unsqueeze(0) - torch.exp2(snapped)).square()  # exact powers of two in float64
    objective = weight @ penalty.T  # [G, M]
    best = objective.amin(-1, keepdim=True)
    # among the minimizers, the m closest to the midpoint (lossless groups have a whole interval of them)
    distance = (m.unsqueeze(0) - mid.unsqueeze(-1).double()).abs()
    distance = torch.where(objective <= best, distance, torch.full_like(distance, float("inf")))
    chosen = m[distance.argmin(-1)].to(torch.int64)
    return torch.where(empty, torch.zeros_like(chosen), chosen)


#: per-half E4M3 code offsets from the standard s0 that auto tries, per effort (s0 first: ties keep it)
AUTO_STEPS = {"fast": (0, -1, 1), "best": (0, -1, 1, -2, 2)}
#: E4M3 block codes s of the top octave below 448 (256, 288, .., 416): "best" also tries S = amax/(6*s), which
#: keeps the group's largest element exact at E2M1 6 (requant's S is s = 448). Where the largest value is
#: e2m1 * 2^k with e2m1 in 0.5, 1, 2, 4, these are the only candidates that keep it exact (2^k*4/3 per code)
#: while the bulk of the group sits near E4M3's subnormal floor: single outliers, gpt-oss experts with outliers
AMAX_CODES = tuple(256 * c for c in (1.0,) + MANTISSAS[:5])

def auto_candidates(k_max: torch.Tensor, amax: torch.Tensor, effort: str = "best") -> torch.Tensor:
    """Candidate global scales [L, C] float32 for the lossy groups (module docstring, hybrid's first)."""
    hybrid = exact_pow2(k_max - 8)
    columns = [hybrid]
    if effort == "fast":
        above = exact_pow2(k_max - 7)
        columns += [hybrid / c for c in MANTISSAS if c <= 1.75]
        columns += [above / c for c in MANTISSAS]
    else:
        columns += [hybrid / c for c in MANTISSAS]
    columns.append(global_scale_from_amax(amax))
    if effort != "fast":  # lossy groups hold a value: amax > 0; float64 quotient rounded once to float32
        columns += [(amax.double() / (6 * s)).float().clamp(min=GLOBAL_SCALE_MIN) for s in AMAX_CODES]
    return torch.stack(columns, dim=-1)
