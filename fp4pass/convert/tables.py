"""Encoding 16-halves by table: every float operation of ``halves.encode_halves``, done once per *kind* of half.

A 16-half of group g holds E2M1 magnitudes j in 0..7 (values v_j = e2m1(j) * 2^k, k its MX exponent). At a
global scale S everything ``encode_halves`` computes depends on the half only through

    key = (g, k, j_max)       j_max the largest magnitude code: amax = e2m1(j_max) * 2^k, hence s0 and its
                              neighbours, the effective scales t_i = fp32(e4m3(s_i) * S), and whether the
                              verbatim scale 2^k / S is exact
    counts_j                  how many of its 16 elements have magnitude j

and the squared error of one element of magnitude j at t_i is a number E[key, i, j] (float64, formed with
the very float32 operations of ``encode_halves``: x = v_j / t_i, q = rne_e2m1(x), e = v_j - fp32(q * t_i)).
So the SSE of a half at code i is sum_j counts_j * E[key, i, j] (integer counts times float64: exact up to
the order of summation), verbatim halves contribute 0, and the chosen code is the first i of least SSE (the
order s0, s0 - 1, s0 + 1, as ``encode_halves``). The element codes follow from a code table Q[key, i, j]
plus each element's sign bit. Tables have L * C * (k range) * 8 * I * 8 entries: small, built once per call.

This turns ``C`` candidate global scales x ``I`` block codes x 16 elements of float work per half into one
gather of C * I * 8 table entries and a tiny batched dot product per half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4pass.convert.layout import GroupLayout, exact_pow2
from fp4pass.formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_MIN_SUBNORMAL, decode_e4m3, encode_e2m1

__all__ = ["HalfTables", "build_tables", "half_keys", "candidate_sse", "encode_at", "group_amax_from_codes"]

E4M3_CODE_MAX = 0x7E  # 448; 0x7F is NaN
E4M3_CODE_MIN = 0x01  # 2^-9
#: halves per gather step: C * I * 8 float64 per half (at most 15 * 3 * 8 * 8 bytes = 2.9 KB)
HALVES_PER_STEP = 1 << 13


def _magnitudes(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=device)


def _rne_e2m1_magnitude(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 float32 -> E2M1 magnitude code 0..7 (RNE, saturating), from the one E2M1 encoder."""
    return encode_e2m1(x) & 0x07


@dataclass
class HalfTables:
    """Tables over keys (group l in 0..L-1, E8M0 code in code0..code0+NK-1, j_max in 0..7) and C candidates.

    sse: float64 [L*NK*8, C, I, 8], squared error per element of magnitude j at code i (0 where verbatim).
    block_codes: uint8 [L*NK*8, C, I], the E4M3 code tried as i (s0, s0-1, s0+1 clamped to 0x01..0x7E).
    element_codes: uint8 [L*NK*8, C, I, 8], the E2M1 magnitude code of magnitude j at code i.
    verbatim: bool [L*NK*8, C], the key's halves keep their nibbles (exact verbatim scale, or all zero).
    verbatim_codes: uint8 [L*NK*8, C], the E4M3 code of a verbatim half (s_v, or s0 for an all-zero half).
    """

    code0: int
    nk: int
    sse: torch.Tensor
    block_codes: torch.Tensor
    element_codes: torch.Tensor
    verbatim: torch.Tensor
    verbatim_codes: torch.Tensor


def build_tables(global_scale: torch.Tensor, code0: int, code1: int, *, allow_verbatim: bool = True,
                 neighbours: int = 1) -> HalfTables:
    """Tables for candidate global scales ``global_scale`` float32 [L, C] and E8M0 codes code0..code1."""
    device = global_scale.device
    L, C = global_scale.shape
    nk = code1 - code0 + 1
    S = global_scale.float().reshape(L, 1, 1, C)  # [L, k, jmax, C]
    k = torch.arange(code0, code1 + 1, device=device, dtype=torch.int32) - 127
    pow2k = exact_pow2(k).reshape(1, nk, 1, 1)
    mags = _magnitudes(device)
    amax = mags.reshape(1, 1, 8, 1) * pow2k  # exact: e2m1 * 2^k
    amax, S4 = torch.broadcast_tensors(amax, S)  # [L, nk, 8, C]
    s0 = (amax / (E2M1_MAX * S4)).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    steps = [0] + [d for i in range(1, neighbours + 1) for d in (-i, i)]
    codes = torch.stack([(s0.to(torch.int16) + d).clamp(E4M3_CODE_MIN, E4M3_CODE_MAX) for d in steps], -1)
    codes = codes.to(torch.uint8)  # [L, nk, 8, C, I]
    t = decode_e4m3(codes) * S4.unsqueeze(-1)  # fp32(e4m3 * S), [L, nk, 8, C, I]
    v = (mags.reshape(1, 8) * pow2k.reshape(nk, 1)).reshape(1, nk, 1, 1, 1, 8)  # element values [.., j]
    x = v / t.unsqueeze(-1)
    q = _rne_e2m1_magnitude(x)
    recon = mags[q.long()] * t.unsqueeze(-1)
    sse = (v.double() - recon.double()).square()  # [L, nk, 8(jmax), C, I, 8(j)]
    # magnitudes above j_max never occur in such a half (count 0); zero them, as they may overflow (inf * 0)
    above = torch.arange(8, device=device).reshape(1, 8) > torch.arange(8, device=device).reshape(8, 1)
    sse = torch.where(above.reshape(1, 1, 8, 1, 1, 8), torch.zeros((), dtype=sse.dtype, device=device), sse)

    if allow_verbatim:
        target = exact_pow2(k).reshape(1, nk, 1)
        s_v = (target / S.reshape(L, 1, C)).clamp(0, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        exact = (decode_e4m3(s_v) * S.reshape(L, 1, C) == target) & (s_v != 0)  # [L, nk, C]
        exact = exact.unsqueeze(2).expand(L, nk, 8, C)
        zero = torch.zeros(8, dtype=torch.bool, device=device)
        zero[0] = True
        verbatim = exact | zero.reshape(1, 1, 8, 1)
        verbatim_codes = torch.where(exact, s_v.unsqueeze(2).expand(L, nk, 8, C), s0)
        sse = torch.where(verbatim[..., None, None], torch.zeros((), dtype=sse.dtype, device=device), sse)
    else:
        verbatim = torch.zeros(L, nk, 8, C, dtype=torch.bool, device=device)
        verbatim_codes = s0
    keys = L * nk * 8
    return HalfTables(code0, nk, sse.reshape(keys, C, len(steps), 8).contiguous(),
                      codes.reshape(keys, C, len(steps)).contiguous(), q.reshape(keys, C, len(steps), 8).contiguous(),
                      verbatim.reshape(keys, C).contiguous(), verbatim_codes.reshape(keys, C).contiguous())


def half_keys(codes: torch.Tensor, scales: torch.Tensor, layout: GroupLayout, lo: int, hi: int,
              row_local: torch.Tensor, code0: int, nk: int, *, with_counts: bool = True):
    """For rows lo:hi: (key int64 [n], counts float64 [n, 8] or None, magnitude codes uint8 [n, 16], sign bits).

    ``row_local``: the local group index of each row (int64 [hi - lo]). n = (hi - lo) * K / 16 halves.
    """
    packed = codes[lo:hi]
    element = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(-1, 16)
    mag = element & 0x07
    jmax = mag.amax(-1).long()
    e8m0 = scales[lo:hi].long() - code0
    per_row = layout.k // 16
    e8m0 = e8m0.repeat_interleave(layout.halves_per_block, dim=-1).reshape(-1)
    local = row_local.repeat_interleave(per_row)
    key = (local * nk + e8m0) * 8 + jmax
    counts = None
    if with_counts:
        counts = torch.zeros(mag.shape[0], 8, dtype=torch.float64, device=codes.device)
        counts.scatter_add_(1, mag.long(), torch.ones((), dtype=torch.float64, device=codes.device).expand(mag.shape))
    return key, counts, mag, element & 0x08


def candidate_sse(tables: HalfTables, key: torch.Tensor, counts: torch.Tensor, half_local: torch.Tensor,
                  total: torch.Tensor) -> None:
    """Add to ``total`` [L, C] each half's SSE at each candidate: min over codes i of sum_j counts_j * E[key, i, j].

    Halves verbatim at every candidate add 0 and are skipped (on real tensors most halves of a lossy group).
    """
    keys, C, I, _ = tables.sse.shape
    todo = (~tables.verbatim.all(-1))[key].nonzero().squeeze(-1)
    flat = tables.sse.reshape(keys, C * I, 8)
    for a in range(0, todo.numel(), HALVES_PER_STEP):
        some = todo[a:a + HALVES_PER_STEP]
        per_code = torch.bmm(flat[key[some]], counts[some].unsqueeze(-1)).reshape(-1, C, I)
        total.index_add_(0, half_local[some], per_code.amin(-1))


def encode_at(tables: HalfTables, key: torch.Tensor, counts: torch.Tensor | None, mag: torch.Tensor,
              sign: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At the tables' single candidate (C = 1): (E2M1 codes uint8 [n, 16], E4M3 codes uint8 [n]).

    ``counts`` may be None when the tables hold one code per half (I = 1: nothing to choose).
    """
    keys, C, I, _ = tables.sse.shape
    if C != 1:
        raise ValueError(f"encode_at needs tables for one candidate, got {C}")
    if I == 1:
        best = torch.zeros_like(key)
    else:  # first minimum: s0 before its neighbours, as encode_halves
        best = torch.bmm(tables.sse.reshape(keys, I, 8)[key], counts.unsqueeze(-1)).squeeze(-1).argmin(-1)
    verbatim = tables.verbatim[key, 0]
    block = tables.block_codes.reshape(keys, I)[key].gather(1, best.unsqueeze(-1)).squeeze(-1)
    block = torch.where(verbatim, tables.verbatim_codes[key, 0], block)
    q = tables.element_codes.reshape(keys, I * 8)[key]  # [n, I*8]
    new = q.gather(1, best.unsqueeze(-1) * 8 + mag.long()) | sign
    element = torch.where(verbatim.unsqueeze(-1), mag | sign, new)
    return element, block


def group_amax_from_codes(codes: torch.Tensor, scales: torch.Tensor, layout: GroupLayout, chunks) -> torch.Tensor:
    """max |x| per group [G] float32 from the codes: max over blocks of e2m1(max magnitude code) * 2^k (exact)."""
    amax = torch.zeros(layout.groups, dtype=torch.float32, device=codes.device)
    mags = _magnitudes(codes.device)
    per_block = layout.mx_block // 2
    for lo, hi in chunks:
        packed = codes[lo:hi].reshape(hi - lo, -1, per_block)
        jmax = torch.maximum((packed & 0x07).amax(-1), ((packed >> 4) & 0x07).amax(-1))
        block_amax = mags[jmax.long()] * exact_pow2(scales[lo:hi].to(torch.int32) - 127)
        groups = torch.arange(lo, hi, device=codes.device) // layout.rows_per_group
        amax.scatter_reduce_(0, groups, block_amax.amax(-1), reduce="amax")
    return amax
